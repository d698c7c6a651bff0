"""Megatron sequence parallelism (Korthikanti et al. 2022): training equal to one device, the bytes of each layer
equal to plain tensor parallelism's, the saved activations of a block against their formula, the refusals."""
from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from tiny_hf import gpt2, llama, logits_loss

import shardwise as sw
from shardwise import launch
from shardwise.comm.autograd import (
    all_reduce_grad,
    check_sequence_split,
    gather_from_sequence,
    is_sequence_gathered,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from shardwise.comm.topology import Topology
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.checkpointing import apply_activation_checkpointing, track_saved_activations
from shardwise.parallel.tp.apply import apply_tp, gather_tensor, tp_spec
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.float64, pytest.mark.timeout(300)]

CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def make_gpt(n_layer: int = CFG.n_layer) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=CFG.vocab_size, block_size=CFG.block_size, n_layer=n_layer, n_head=CFG.n_head,
                      n_embd=CFG.n_embd))
    # The key bias's gradient is identically zero (softmax ignores a shift shared by all keys): frozen, so that
    # Adam does not turn rounding noise into updates and weights compare meaningfully (as in test_tp.py).
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)
    return m


def fit(strategy, devices, make, lr=1e-3, seq=16, steps=4, **trainer):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **trainer).fit(
        make(), CharText(stdlib_text(20_000), seq), logits_loss, functools.partial(torch.optim.AdamW, lr=lr),
        batch_size=8, max_steps=steps)


SP = functools.partial(sw.Parallel, tp=2, sequence_parallel=True)


# ---- the operators, and split models equal to whole ones -----------------------------------------------
def _sequence_operators(rank: int, device: torch.device) -> None:
    topo = Topology.create(device, dp=1, tp=2)
    comm = topo.comm("tp")
    full = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)     # the same on both ranks; rank r holds tokens 2r, 2r+1
    mine = full[:, 2 * rank:2 * rank + 2]
    # gather: the whole sequence forward; backward sums the partial gradients and keeps this rank's tokens ...
    x = mine.clone().requires_grad_()
    y = gather_from_sequence(x, comm)
    assert torch.equal(y, full) and is_sequence_gathered(y) and is_sequence_gathered(y.view(2, 12)[:, 1:])
    y.backward(torch.full_like(full, rank + 1.0))
    assert torch.equal(x.grad, torch.full_like(mine, 3.0))
    # ... or, for replicated consumers (equal gradients), keeps its own slice of it.
    x.grad = None
    y = gather_from_sequence(x, comm, reduce_grad=False)
    assert not is_sequence_gathered(y)
    y.backward(full)
    assert torch.equal(x.grad, mine)
    # reduce-scatter: this rank's tokens of the sum; backward all-gathers the gradient.
    p = (full * (rank + 1)).requires_grad_()
    z = reduce_scatter_to_sequence(p, comm)
    assert torch.equal(z, 3 * mine)
    z.backward(torch.full_like(z, rank + 1.0))
    assert torch.equal(p.grad, torch.cat([torch.full_like(mine, 1.0), torch.full_like(mine, 2.0)], 1))
    # scatter (here along dim -2 of a (T, H) position table): own rows; backward all-gathers.
    pos = full[0].clone().requires_grad_()
    rows = scatter_to_sequence(pos, comm, dim=-2)
    assert torch.equal(rows, full[0, 2 * rank:2 * rank + 2])
    rows.backward(torch.full_like(rows, rank + 1.0))
    assert torch.equal(pos.grad, torch.tensor([1.0, 1, 2, 2]).unsqueeze(1).expand(4, 3))
    # A replicated parameter applied to this rank's tokens: its gradient summed over tp before it accumulates.
    w = torch.ones(3, requires_grad=True)
    all_reduce_grad(w, comm, "sp_grads.w")
    for _ in range(2):
        (mine * w).sum().backward()
    assert torch.equal(w.grad, 2 * full.sum((0, 1)))


def test_sequence_operators():
    launch.spawn(_sequence_operators, 2)


def _bare(kind: str):
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    if kind == "gpt2-bare":
        return GPT2Model(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return LlamaModel(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                  bos_token_id=0, eos_token_id=0))


WHOLE = {"gpt": make_gpt, "gpt2": gpt2, "llama": llama, "gpt2-bare": functools.partial(_bare, "gpt2-bare"),
         "llama-bare": functools.partial(_bare, "llama-bare")}


def _split_equals_whole(rank: int, device: torch.device, kinds: list[str]) -> None:
    world = torch.distributed.get_world_size()
    comm = Topology.create(device, dp=1, tp=world).comm("tp")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (3, 16), generator=g)
    weights = torch.randn(3, 16, 128, generator=g)            # a loss that weighs every output differently
    for kind in kinds:
        whole = WHOLE[kind]()
        split = apply_tp(copy.deepcopy(whole), None, comm, sequence_parallel=True)
        outs = []
        for m in (whole, split):
            out = m(ids)
            out = out.logits if hasattr(out, "logits") else getattr(out, "last_hidden_state", out)
            (out * weights[..., :out.shape[-1]]).sum().backward()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12, msg=lambda m, k=kind: f"{k}: {m}")
        for name, p in split.named_parameters():
            want = whole.get_parameter(name).grad
            if p.grad is None or want is None:
                assert p.grad is None and want is None, f"{kind} {name}"
                continue
            spec = tp_spec(p)
            got = gather_tensor(p.grad, spec[0], spec[1], comm) if spec else p.grad
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, k=kind, n=name: f"{k} grad of {n}: {m}")


@pytest.mark.parametrize("world,kinds", [(2, ["gpt", "gpt2", "llama", "gpt2-bare", "llama-bare"]),
                                         (4, ["gpt", "gpt2"])])
def test_split_model_outputs_and_gradients_equal_whole(world, kinds):
    """Bare Hugging Face models end the region with a gather whose gradient each rank slices (their hidden
    states are consumed replicated); the others feed the column-parallel head, and reduce-scatter."""
    launch.spawn(_split_equals_whole, world, args=(kinds,))


# ---- 1. the same training as one device ------------------------------------------------------------------
# lr 1e-4 for the Hugging Face models, as in test_tp.py: their row-parallel sums change the rounding of
# near-zero gradients, which Adam's normalisation turns into differences proportional to lr.
@pytest.mark.parametrize("make,lr", [(make_gpt, 1e-3), (llama, 1e-4), (gpt2, 1e-4)], ids=["gpt", "llama", "gpt2"])
def test_sequence_parallel_trains_like_one_device(same_run, make, lr):
    """Two micro-batches a step and a clipped norm: the norms' gradients (summed over tp in backward) count
    once in the global norm, and every micro-batch's part of them is summed once."""
    opts = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    same_run(fit("single", 1, make, lr, **opts), fit(SP(), 2, make, lr, **opts))


@pytest.mark.parametrize("layout", [{"pp": 2}, {"dp": 2, "zero": 3}, {"checkpointing": True}],
                         ids=["pp2", "fsdp-dp2", "activation-checkpointing"])
def test_sequence_parallel_composes(same_run, layout):
    """Pipeline stages pass S/t tokens on (the GPT layout is stage-safe); FSDP keeps the norms' parameter objects,
    so their gradient hooks still fire; a checkpointed block replays its gathers when backward recomputes it."""
    opts = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    layout = dict(layout)  # the parameter itself stays as collected
    checkpointed = layout.pop("checkpointing", False)

    def make() -> GPT:
        m = make_gpt()
        if checkpointed:
            apply_activation_checkpointing(m)
        return m

    devices = 2 * max(layout.get("pp", 1), layout.get("dp", 1))
    same_run(fit("single", 1, make_gpt, **opts), fit(SP(**layout), devices, make, **opts))


# ---- 2. the bytes ------------------------------------------------------------------------------------------
def test_sequence_parallel_moves_the_bytes_of_plain_tp_per_layer():
    """Per step (B=8, S=16, H=32, V=128, t=2, float64): exact bytes of both runs, and per layer the same ones.

    Comm counts an all-reduce of n bytes as 2(t-1)/t n and a reduce-scatter or an all-gather as (t-1)/t n,
    so each pair of plain tp (f and g, forward and backward) costs the same as its replacement: per layer,
    4 all-reduces of the activation (B, S, H) under tp; under sp, 2 all-gathers at the attention and MLP
    inputs (reduce-scatters in backward) and 2 reduce-scatters at their row-parallel outputs (all-gathers
    in backward). What sp adds are the gradients of the parameters it splits the tokens of: per layer the
    two LayerNorms' weights and biases and the two row-parallel biases (6 vectors of H), all-reduced.
    """
    t, b, s, h, v, item = 2, 8, 16, CFG.n_embd, CFG.vocab_size, 8
    n = b * s * h * item                         # one activation, bytes

    def ar(x: int) -> int:
        return 2 * (t - 1) * x // t

    def half(x: int) -> int:                     # a reduce-scatter or an all-gather of a full tensor of x bytes
        return (t - 1) * x // t

    logits = (t - 1) * b * s * (v // t) * item   # the head's vocabulary gather, the same in both
    per_layer = 4 * ar(n)
    assert per_layer == 8 * half(n)
    grads_per_layer = 6 * ar(h * item)
    tp_step = {L: L * per_layer + ar(n) + ar(n) + logits for L in (1, 2)}    # embedding g; head f + gather
    sp_step = {L: L * (per_layer + grads_per_layer)
               + 2 * half(n)                     # token embedding: reduce-scatter, all-gather in backward
               + half(s * h * item)              # position rows: all-gather of their gradient
               + 2 * half(n) + logits            # final norm's output: all-gather, reduce-scatter in backward
               + ar(2 * h * item)                # the final norm's weight and bias
               for L in (1, 2)}
    runs = {(sp, L): fit(sw.Parallel(tp=2, sequence_parallel=sp), 2, functools.partial(make_gpt, L), steps=2)
            for sp in (False, True) for L in (1, 2)}
    for (sp, L), run in runs.items():
        for st in run.stats:
            assert st["comm_bytes_per_step"] == (sp_step if sp else tp_step)[L], (sp, L)
    def layer(sp: bool, key: str, rank: int) -> int:
        """What one more layer adds to the bytes named ``key.*`` over the whole run."""
        two, one = (runs[sp, L].stats[rank]["comm_by_name"].get(key, 0) for L in (2, 1))
        return two - one

    for r in range(2):
        # One more layer: the same "tp" bytes (2 steps of 4 all-reduces, or of 4 reduce-scatter + all-gather
        # pairs, plus the final gather of that layer's weight shards), and sp's gradients of its split tokens.
        assert layer(True, "tp", r) == layer(False, "tp", r)
        assert layer(True, "sp_grads", r) == 2 * grads_per_layer and layer(False, "sp_grads", r) == 0


# ---- 3. saved activations --------------------------------------------------------------------------------
def block_saved_bytes(b: int, s: int, h: int, a: int, t: int, sp: bool, item: int = 8) -> int:
    """Bytes one :class:`~shardwise.models.Block` saves for backward (no dropout), per tp rank.

    What each operation keeps, in elements (b sequences of s tokens, hidden size h, a heads, tp size t):

    ===============================  =================  ==============================
    saved by                         plain tp           sequence parallel
    ===============================  =================  ==============================
    ln1: its input (block input)     bsh                bsh/t
    ln1: mean and 1/std per token    2bs                2bs/t
    q, k, v: their input             bsh (ln1's out)    bsh (the all-gathered ln1 out)
    attention: q, k, v               3bsh/t             3bsh/t
    attention: its output, which is  bsh/t              bsh/t
    also proj's input (one storage)
    attention: log-sum-exp per row   abs/t              abs/t
    ln2: its input (x + attention)   bsh                bsh/t
    ln2: mean and 1/std              2bs                2bs/t
    fc1: its input                   bsh (ln2's out)    bsh (the all-gathered ln2 out)
    gelu: its input (fc1's output)   4bsh/t             4bsh/t
    fc2: its input (gelu's output)   4bsh/t             4bsh/t
    ===============================  =================  ==============================

    so plain tp keeps ``bsh (4 + 12/t) + 4bs + abs/t`` elements and sequence parallelism
    ``bsh (2 + 14/t) + (4bs + abs)/t``; the difference is ``(1 - 1/t)(2bsh + 4bs)``: the norms' inputs
    and statistics, split t ways. The residual sums, the all-reduces (in place) and the reduce-scatters
    save nothing; attention is CPU SDPA's flash kernel (no s x s scores, a log-sum-exp per query and head).

    Korthikanti et al.'s Table 2 counts the same tensors in 16-bit units with dropout masks and the
    s x s scores: without those, their ``10 + 24/t`` is our ``2 * (4 + 12/t)``. Their ``34/t`` for
    sequence parallelism also splits the all-gathered inputs of q/k/v and fc1 (``2bsh`` here), which
    Megatron keeps as the local part and all-gathers again in backward: one more all-gather per
    gathered input. Here they are kept whole, so that each layer moves exactly plain tp's bytes.
    """
    if sp:
        elements = b * s * h * (2 * t + 14) // t + (4 * b * s + a * b * s) // t
    else:
        elements = b * s * h * (4 * t + 12) // t + 4 * b * s + a * b * s // t
    return elements * item


def _block_activations(rank: int, device: torch.device, sp: bool, path: str) -> None:
    world = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=world)
    model = apply_tp(make_gpt(), None, topo.comm("tp"), sequence_parallel=sp)
    b, s = 4, CFG.block_size
    x = torch.randn(b, s // world if sp else s, CFG.n_embd, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    # The block's input is counted: its first norm keeps it for backward (Korthikanti et al. count it too).
    with track_saved_activations(model.parameters()) as saved:
        y = model.blocks[0](x)
        kept = saved.current
        y.sum().backward()
    if rank == 0:
        torch.save(torch.tensor([kept, saved.current]), path)


@pytest.mark.parametrize("world", [2, 4])
def test_saved_activations_of_a_block_match_the_formula(tmp_path, world):
    got = {}
    for sp in (False, True):
        path = str(tmp_path / f"{sp}.pt")
        launch.spawn(_block_activations, world, args=(sp, path))
        kept, after_backward = torch.load(path).tolist()
        assert after_backward == 0
        got[sp] = kept
        assert kept == block_saved_bytes(4, CFG.block_size, CFG.n_embd, CFG.n_head, world, sp), sp
    b, s, h, t = 4, CFG.block_size, CFG.n_embd, world
    assert got[False] - got[True] == 8 * (2 * b * s * h + 4 * b * s) * (t - 1) // t
    # at t=2: 166,912 bytes under plain tp, 149,504 under sequence parallelism.
    if world == 2:
        assert (got[False], got[True]) == (166_912, 149_504)


# ---- 4. refusals -------------------------------------------------------------------------------------------
INDIVISIBLE = ("sequence parallel: the sequence length is 15, not divisible by tp=2 (15 % 2 = 1): outside the "
               "tensor-parallel layers each tp rank holds an equal 1/2 of the sequence; use a sequence length "
               "that is a multiple of 2 (e.g. 16), or sequence_parallel=False")


def test_a_sequence_that_does_not_split_is_refused_with_the_fix(no_spawn):
    fake = types.SimpleNamespace(size=2, rank=0)
    with pytest.raises(ValueError) as e:
        check_sequence_split(15, fake)  # type: ignore[arg-type]
    assert str(e.value) == INDIVISIBLE
    # The model's first sequence-parallel operation (the embedding's reduce-scatter) checks before it talks.
    model = apply_tp(make_gpt(), None, fake, sequence_parallel=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as e:
        model(torch.zeros(2, 15, dtype=torch.long))
    assert str(e.value) == INDIVISIBLE
    # And before any process of a run starts, for a Hugging Face model too (its first block splits the
    # sequence): the Trainer's checks run the split plan on a meta copy with the batch's shapes.
    with pytest.raises(ValueError) as e:
        fit(SP(), 2, llama, seq=15, steps=1)
    assert str(e.value) == INDIVISIBLE


def test_a_hugging_face_model_cut_into_pipeline_stages_is_refused():
    # Its forward derives positions and the causal mask from the embedding's length; the pipeline's block
    # adapters would derive them from a split sequence.
    with pytest.raises(Exception, match=r"sequence parallel: this model's sequence layout starts at the first "
                                        r"block, .* Use sequence_parallel with pp=1 for this model"):
        fit(SP(pp=2), 4, llama, steps=1)


def test_a_plan_without_a_sequence_layout_is_refused():
    from shardwise.models import MLP

    with pytest.raises(ValueError, match=r"sequence parallel: the 'mlp' tensor-parallel plan has no sequence "
                                         r"layout .* give your Plan a SequenceLayout"):
        apply_tp(MLP(), None, types.SimpleNamespace(size=2, rank=0), sequence_parallel=True)  # type: ignore
