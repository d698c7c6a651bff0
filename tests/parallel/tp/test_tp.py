"""Tensor parallelism: Megatron's f/g, split layers equal to unsplit ones, training equivalence, exact bytes, errors."""
from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.comm.autograd import (
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    scatter_to_parallel,
)
from shardwise.comm.topology import Topology
from shardwise.models import GPT, Block, GPTConfig, lm_loss
from shardwise.parallel.tp.apply import apply_tp, gather_tensor, tp_spec
from shardwise.parallel.tp.layers import shard_tensor
from shardwise.strategies.tp import TP
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def make_gpt(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    m = GPT(cfg)
    # The key bias has an identically zero gradient (softmax ignores a shift shared by all keys), so
    # Adam would turn its rounding noise into updates of size lr: frozen, so weights compare meaningfully.
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)
    return m


def make_gpt2(n_head: int = 4, freeze_qkv_bias: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=n_head,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0))
    if freeze_qkv_bias:
        # The fused q|k|v bias holds the key bias, whose gradient is identically zero (see make_gpt);
        # frozen for training comparisons. Its split gradient is checked directly in the test above.
        for b in m.transformer.h:
            b.attn.c_attn.bias.requires_grad_(False)
    return m


def make_gpt2_frozen() -> nn.Module:
    return make_gpt2(freeze_qkv_bias=True)


def make_llama(kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads,
                                        max_position_embeddings=16, bos_token_id=0, eos_token_id=0))


MAKERS = {"gpt": make_gpt, "gpt2": make_gpt2, "llama": make_llama}


def logits_loss(out, y):
    """lm_loss on a tensor of logits or a Hugging Face output object."""
    return lm_loss(getattr(out, "logits", out), y)


def text() -> CharText:
    return CharText(stdlib_text(20_000), 16)


def fit(strategy, devices, make=make_gpt, steps=4, clip=None, optimizer=ADAMW):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, gradient_clip_val=clip).fit(
        make(), text(), logits_loss, optimizer, batch_size=8, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


# ---- differentiable collectives ------------------------------------------------------
def _collectives(rank: int, device: torch.device) -> None:
    topo = Topology.create(device, dp=1, tp=2)
    comm = topo.comm("tp")
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    # f: identity forward, all-reduce backward.
    y = copy_to_parallel(x, comm)
    assert torch.equal(y, x)
    y.backward(torch.full((2, 3), float(10 * (rank + 1))))
    assert torch.equal(x.grad, torch.full((2, 3), 30.0))
    # g: all-reduce forward, identity backward.
    x.grad = None
    y = reduce_from_parallel(x, comm)
    assert torch.equal(y, torch.full((2, 3), 3.0))
    y.backward(torch.full((2, 3), float(rank + 5)))
    assert torch.equal(x.grad, torch.full((2, 3), float(rank + 5)))
    # g on a fresh intermediate: reduced in place (no copy), the same values and gradient.
    x.grad = None
    part = x * 2
    y = reduce_from_parallel(part, comm, fresh=True)
    assert y.data_ptr() == part.data_ptr() and torch.equal(y, torch.full((2, 3), 6.0))
    y.backward(torch.full((2, 3), float(rank + 5)))
    assert torch.equal(x.grad, torch.full((2, 3), 2.0 * (rank + 5)))
    # ... but never a leaf that requires grad, nor a view: those are copied as before.
    x.grad = None
    for src in (x, (x * 1).t()):
        y = reduce_from_parallel(src, comm, fresh=True)
        assert y.data_ptr() != src.data_ptr() and torch.equal(y, torch.full(src.shape, 3.0))
    assert torch.equal(x, torch.full((2, 3), float(rank + 1)))
    # gather along the last dim: concatenation in rank order; backward keeps own slice.
    x.grad = None
    y = gather_from_parallel(x, comm)
    assert torch.equal(y, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], -1))
    y.backward(torch.arange(6.0).repeat(2, 1))
    assert torch.equal(x.grad, torch.arange(6.0)[3 * rank:3 * rank + 3].repeat(2, 1))
    # scatter: own slice forward, all-gather backward.
    full = torch.arange(8.0).reshape(2, 4).requires_grad_()
    s = scatter_to_parallel(full, comm)
    assert torch.equal(s, full.detach()[:, 2 * rank:2 * rank + 2])
    s.backward(torch.ones_like(s) * (rank + 1))
    assert torch.equal(full.grad, torch.tensor([[1.0, 1, 2, 2], [1, 1, 2, 2]]))


def test_megatron_f_and_g_and_gathers():
    launch.spawn(_collectives, 2)


def test_shard_and_gather_are_inverse_for_fused_parts():
    full = torch.arange(4 * 12.0).reshape(4, 12)  # 3 fused parts of width 4
    shards = [shard_tensor(full, 1, 3, r, 2) for r in range(2)]
    # Each rank keeps whole halves of q, k and v, not a contiguous third of the fused matrix.
    assert torch.equal(shards[0], torch.cat([full[:, 0:2], full[:, 4:6], full[:, 8:10]], 1))
    fake = types.SimpleNamespace(size=1)
    assert gather_tensor(shards[0], 1, 3, fake) is shards[0]


# ---- split layers equal unsplit ones -------------------------------------------------
def _forward_backward(rank: int, device: torch.device, kinds: list[str]) -> None:
    world = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=world)
    comm = topo.comm("tp")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (3, 16), generator=g)   # the same on every rank
    tgt = torch.randint(0, 128, (3, 16), generator=g)
    for kind in kinds:
        ref = MAKERS[kind]()
        model = apply_tp(copy.deepcopy(ref), None, comm)
        assert any(tp_spec(p) is not None for p in model.parameters()), kind
        out_ref, out = ref(ids), model(ids)
        out_ref, out = getattr(out_ref, "logits", out_ref), getattr(out, "logits", out)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} logits: {m}")
        lm_loss(out_ref, tgt).backward()
        lm_loss(out, tgt).backward()
        for name, p in model.named_parameters():
            want = ref.get_parameter(name).grad
            if p.grad is None or want is None:
                assert p.grad is None and want is None, f"{kind} {name}"
                continue
            spec = tp_spec(p)
            got = gather_tensor(p.grad, spec[0], spec[1], comm) if spec else p.grad
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, scale),
                                       msg=lambda m: f"{kind} grad of {name}: {m}")


@pytest.mark.parametrize("world,kinds", [(2, ["gpt", "gpt2", "llama"]), (4, ["gpt", "gpt2"])])
def test_tp_forward_and_gradients_equal_unsplit(world, kinds):
    launch.spawn(_forward_backward, world, args=(kinds,))


# ---- training --------------------------------------------------------------------------
def test_tp_training_equals_single_and_bytes_match_megatron_count(reference, same_run):
    run = fit(TP(), 2)
    same_run(reference, run)
    # Per step (batch B=8, T=16, D=32, V=128, N=2): one all-reduce per row-parallel layer and per
    # vocab embedding forward (g), one per column-parallel group backward (f), and the logits all-gather.
    n, b, t, d, v = 2, 8, 16, CFG.n_embd, CFG.vocab_size
    item = torch.empty(()).element_size()  # the default dtype's (float64 in this module)
    act = b * t * d * item
    ar = 2 * (n - 1) * act // n
    per_block = 4 * ar            # attn.proj g + mlp.fc2 g forward; f before q|k|v and fc1 backward
    embed = ar                    # vocab-parallel embedding g (its f-free input needs no gradient)
    head = ar + (n - 1) * b * t * (v // n) * item   # f backward + all-gather of the logits
    want = CFG.n_layer * per_block + embed + head
    for s in run.stats:
        assert s["comm_bytes_per_step"] == want
        assert s["params_bytes"] < sum(p.numel() * item for p in make_gpt().parameters())


def test_tp4_training_with_clipping_equals_single(same_run):
    same_run(fit("single", 1, clip=0.05), fit(TP(), 4, clip=0.05))


def test_hf_gpt2_trains_under_tp(same_run):
    same_run(fit("single", 1, make_gpt2_frozen), fit("tp", 2, make_gpt2_frozen))


def test_hf_llama_trains_under_tp_with_the_builtin_plan(same_run):
    # LlamaForCausalLM from a tiny config (no download): the "llama" plan is picked by model type;
    # q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel, 2 query heads and 1 kv head per rank.
    # lr=1e-4: the row-parallel sums change the rounding of near-zero gradients, which Adam's normalisation
    # turns into differences proportional to lr (at 1e-3, 1 of 2048 down_proj weights was off by 4.6e-6).
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    same_run(fit("single", 1, make_llama, optimizer=adamw), fit("tp", 2, make_llama, optimizer=adamw))


def _block_bytes(rank: int, device: torch.device, needs_grad: bool, path: str) -> None:
    topo = Topology.create(device, dp=1, tp=2)
    torch.manual_seed(0)
    block = Block(CFG)
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
            "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    apply_tp(block, plan, topo.comm("tp"))
    x = torch.randn(8, 16, CFG.n_embd, generator=torch.Generator().manual_seed(1)).requires_grad_(needs_grad)
    before = topo.stats.sent, topo.stats.calls
    block(x).sum().backward()
    if rank == 0:
        torch.save(torch.tensor([topo.stats.sent - before[0], topo.stats.calls - before[1]]), path)


@pytest.mark.float32  # the claim is fp32 bytes
def test_one_block_costs_two_all_reduces_forward_and_two_backward(tmp_path):
    path = str(tmp_path / "bytes.pt")
    launch.spawn(_block_bytes, 2, args=(True, path))
    sent, calls = torch.load(path).tolist()
    act = 8 * 16 * CFG.n_embd * 4
    # q, k and v share one f (one all-reduce in backward), as Megatron's fused qkv does.
    assert calls == 4
    assert sent == 4 * 2 * (2 - 1) * act // 2


# ---- clear errors ----------------------------------------------------------------------
FAKE4 = types.SimpleNamespace(size=4, rank=0)


@pytest.mark.parametrize("model,message", [
    (lambda: GPT(GPTConfig(n_head=6, n_embd=48)), r"n_head=6 is not divisible by tp=4 \(6 % 4 = 2\): attention is "
                                                  r"split by heads, so every rank must hold the same whole number"),
    (lambda: GPT(GPTConfig(vocab_size=130)), r"vocab_size=130 is not divisible by tp=4 \(130 % 4 = 2\): the "
                                            r"embedding and output head are split by vocabulary rows"),
    (lambda: make_gpt2(n_head=2), r"num_attention_heads=2 is not divisible by tp=4"),
    (lambda: make_llama(kv_heads=2), r"num_key_value_heads=2 is not divisible by tp=4"),
])
def test_indivisible_sizes_say_which_number_and_why(model, message):
    with pytest.raises(ValueError, match=message):
        apply_tp(model(), None, FAKE4)


def test_indivisible_hidden_size_in_a_custom_plan():
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    with pytest.raises(ValueError, match=r"the output size of '0' is 6, not divisible by tp=4 \(6 % 4 = 2\): a "
                                         r"column-parallel layer gives every rank an equal slice"):
        apply_tp(net, {"0": "colwise", "2": "rowwise"}, FAKE4)
    with pytest.raises(ValueError, match=r"plan pattern\(s\) \['3'\] match no module of Sequential"):
        apply_tp(net, {"3": "colwise"}, FAKE4)
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style 'diagonal'"):
        apply_tp(net, {"0": "diagonal"}, FAKE4)
    with pytest.raises(ValueError, match=r"no built-in tensor-parallel plan for Sequential"):
        apply_tp(net, None, FAKE4)


def test_mlp_builtin_plan_pairs_hidden_layers_and_trains_like_single(same_run):
    from shardwise.models import MLP
    from shardwise.parallel.tp.apply import plan_for
    from shardwise.workloads import digits

    assert plan_for(MLP(depth=3)).styles == {"net.0": "colwise", "net.2": "rowwise"}  # net.4 unpaired, head replicated
    assert plan_for(MLP(depth=2)).styles == {"net.0": "colwise", "net.2": "rowwise"}
    work = digits()

    def fit(strategy, devices):
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=4)

    same_run(fit("single", 1), fit("tp", 2))
