"""engine="torch"'s CUDA-only engines on a CPU machine: context parallelism (torch's context_parallel),
``dp`` (torch.nn.DataParallel) and sync BatchNorm (torch's nn.SyncBatchNorm).

Their training runs are in tests/gpu/test_gpu_torch_cuda_only.py. Here: each is refused on CPU before any process
starts, with torch's reason; what torch runs of each on CUDA is routed to its engine, and the rest refused; and the
parts of the cp engine that CPU can run, run: in two gloo ranks, context_parallel cuts every micro-batch into our
chunks (head-tail, as shardwise.parallel.cp.apply does), the positions with them, on the meshes the engine builds; and a
Hugging Face model's attention reaches SDPA as the ring needs it (no mask, causal, as many kv heads as query heads).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import llama
from torch.nn import functional as F

import shardwise as sw
from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.data import Kwargs
from shardwise.dims import CP, DP_CP, ParallelDims
from shardwise.models import GPT, Attention, GPTConfig, lm_loss
from shardwise.parallel.cp.attention import local_positions, shard_sequence
from shardwise.parallel.cp.torch_cp import TorchContextParallel, cp_mesh, dp_shard_cp_mesh, use_torch_sdpa
from shardwise.strategies.registry import resolve
from shardwise.strategies.torch_engine.choice import engine_for
from shardwise.strategies.torch_engine.wrappers import TorchCP
from shardwise.workloads import CharText, stdlib_text

pytestmark = pytest.mark.timeout(120)

ON_CPU = "; engine='shardwise' runs it on CPU"
SGD = functools.partial(torch.optim.SGD, lr=0.1)  # float32: Adam would amplify rounding where gradients are ~0


@pytest.mark.parametrize("strategy, kw, message", [
    ("dp", {"engine": "torch"}, "engine='torch' runs strategy 'dp' on CUDA only: torch.nn.DataParallel splits the "
     "batch over CUDA devices only (on CPU it runs the module unsplit, on one replica)" + ON_CPU),
    (sw.Parallel(dp=2, cp=2, zero=3, engine="torch"), {}, "engine='torch' runs context parallelism on CUDA only: "
     "torch's context_parallel runs its ring attention through SDPA's flash, efficient and cuDNN kernels, which "
     "are CUDA's, and has no sharding strategy for the CPU's (aten._scaled_dot_product_flash_attention_for_cpu)"
     + ON_CPU),
    ("zero1", {"engine": "torch", "sync_batchnorm": True}, "engine='torch' runs sync_batchnorm on CUDA only: "
     "torch's nn.SyncBatchNorm takes CUDA inputs only (on CPU its forward raises 'SyncBatchNorm expected input "
     "tensor to be on GPU', and its statistics kernel, batch_norm_stats, has no CPU implementation)" + ON_CPU),
])
def test_cuda_only_engines_are_refused_on_cpu_with_torch_s_reason(strategy, kw, message, no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, 4, accelerator="cpu", progress=False, **kw)
    assert str(e.value) == message


CP_ONLY_WITH_DP = ("engine='torch' runs context parallelism only with dp yet (sw.Parallel(cp=N, dp=M) with zero=0: "
                   "torch's DDP over dp x cp, or zero=3: FSDP2 over dp x cp), got {}; engine='shardwise' runs it")


@pytest.mark.parametrize("strategy, sync_batchnorm, message", [
    (sw.Parallel(cp=2, tp=2), False, CP_ONLY_WITH_DP.format("tp=2, zero=0")),
    (sw.Parallel(cp=2, pp=2, zero=3), False, CP_ONLY_WITH_DP.format("pp=2, zero=3")),
    (sw.Parallel(cp=2, dp=4, zero=3, replicate=2), False, CP_ONLY_WITH_DP.format("replicate=2, zero=3")),
    (sw.Parallel(cp=2, zero=1), False, CP_ONLY_WITH_DP.format("zero=1")),
    (sw.Parallel(cp=2, tp=2, sequence_parallel=True), False,
     CP_ONLY_WITH_DP.format("tp=2, zero=0, sequence_parallel=True")),
    (sw.Parallel(cp=2, cp_mode="ulysses"), False, "engine='torch' has no engine for cp_mode='ulysses': torch's "
     "context_parallel is ring attention only; use cp_mode='ring', or engine='shardwise'"),
    ("fsdp", True, "engine='torch' does not support sync_batchnorm outside torch's DDP ('ddp', 'zero1') yet "
     "(strategy 'fsdp'); engine='shardwise' does"),
])
def test_on_cuda_what_torch_s_engines_do_not_compose_is_refused(strategy, sync_batchnorm, message):
    with pytest.raises(ValueError) as e:
        engine_for(resolve(strategy), "torch", sync_batchnorm=sync_batchnorm, cuda=True)
    assert str(e.value) == message


def test_on_cuda_the_cuda_only_rows_get_their_torch_engines():
    runs = {"TorchCP": [sw.Parallel(cp=2), sw.Parallel(dp=2, cp=2), sw.Parallel(dp=2, cp=4, zero=3)],
            "TorchDP": [sw.DP(), sw.DP(device_ids=[0, 1])], "TorchDDP": ["ddp"], "TorchZeRO1": ["zero1"]}
    for engine, strategies in runs.items():
        for s in strategies:
            sync = engine in ("TorchDDP", "TorchZeRO1")  # under torch's DDP: nn.SyncBatchNorm
            assert type(engine_for(resolve(s), "torch", sync_batchnorm=sync, cuda=True)).__name__ == engine, s


class PositionsOut(torch.nn.Module):
    """A position taker that returns the positions it was given (the cp engine's hook passes them)."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        return position_ids


def own_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention whose every query sees only its own key: no SDPA, no key crosses a cp rank, so the model
    splits over cp without the ring (which CPU lacks), and its learned positions still tell tokens apart."""
    return v + 0 * (q * k).sum(-1, keepdim=True)


def gpt_local() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for m in model.modules():
        if isinstance(m, Attention):
            m.attend = own_value  # type: ignore[method-assign]
    return model


def fit(strategy: object, devices: int) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2,
                      memory_check="off").fit(gpt_local(), CharText(stdlib_text(20_000), 16), lm_loss, SGD,
                                              batch_size=8, max_steps=3)


def _cp_engine_on_cpu(rank: int, device: torch.device, folder: str) -> None:
    """The cp engine's parts CPU runs: the cuts and meshes, then its runs at cp=2 with a token-local attention."""
    _cuts_like_ours(rank, device)
    runs = {z: fit(TorchCP(of=sw.Parallel(cp=2, zero=z)), 2) for z in (0, 3)}
    if rank == 0:
        torch.save({z: (r.losses, r.state_dict) for z, r in runs.items()}, os.path.join(folder, "runs.pt"))


def _cuts_like_ours(rank: int, device: torch.device) -> None:
    topo = Topology.create(device, ParallelDims.for_world(2, cp=2))
    mesh, shard_mesh = cp_mesh(topo), dp_shard_cp_mesh(topo)
    # The meshes and the DDP group: the cp ranks, which hold one replica's parameters and see other tokens.
    assert (mesh.size(), mesh.get_local_rank(), shard_mesh.size()) == (2, topo.coord(CP), 2)
    assert torch.distributed.get_world_size(topo.group(DP_CP)) == 2
    cp = TorchContextParallel(mesh)
    model = cp.prepare(PositionsOut())
    tokens = torch.arange(2 * 16).view(2, 16)
    batches = [(tokens, tokens + 1), (Kwargs(idx=tokens * 2), [tokens * 3, torch.ones(2)])]
    sdpa = F.scaled_dot_product_attention
    with cp.sharded(batches) as local:
        assert F.scaled_dot_product_attention is not sdpa  # torch's ring attention is on inside the block
        (x, y), (kw, (y2, w)) = local
        for got, whole in [(x, tokens), (y, tokens + 1), (kw["idx"], tokens * 2), (y2, tokens * 3)]:
            assert torch.equal(got, shard_sequence(whole, 2, rank))  # head-tail: chunks r and 2C-1-r of 2C
        assert torch.equal(w, torch.ones(2)) and isinstance(kw, Kwargs)  # one dimension: not a sequence
        assert torch.equal(model(x), local_positions(8, 2, rank).unsqueeze(0))  # its tokens' own places
    assert F.scaled_dot_product_attention is sdpa and model(tokens) is None  # off after the block
    assert torch.equal(batches[0][0], torch.arange(32).view(2, 16))  # the loader's batch stays whole


def test_context_parallel_cuts_micro_batches_as_our_cp_and_the_engine_trains_at_cp_2_but_the_ring(tmp_path,
                                                                                                     same_run):
    """At cp=2: the cuts, positions and meshes; then the engine's whole step but the ring (the block around each
    step's micro-batches, the positions, torch's DDP over dp x cp and FSDP2 over dp_shard x cp, accumulation, the
    loss's mean over cp) with an attention that calls no SDPA, equal to one device (float32: the engine refuses
    float64)."""
    launch.spawn(_cp_engine_on_cpu, 2, args=(str(tmp_path),))
    ref = fit("single", 1)
    for losses, state in torch.load(tmp_path / "runs.pt").values():
        same_run(ref, sw.FitResult(losses, state))


@pytest.mark.float64
def test_a_hugging_face_model_reaches_sdpa_as_the_ring_needs_it(monkeypatch):
    model, ref = llama(), llama()
    x = torch.randint(0, 128, (2, 8))
    want = ref(x).logits
    use_torch_sdpa(model)
    seen = []

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((attn_mask is None, is_causal, k.shape[1] == q.shape[1]))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    torch.testing.assert_close(model(x).logits, want, rtol=1e-12, atol=1e-12)  # one rank's cut: the same model
    # Head-tail positions (rank 0 of 2) would read as two packed sequences: still no mask, causal by is_causal.
    model(x[:, :4], position_ids=local_positions(4, 2, 0).unsqueeze(0))
    assert seen == [(True, True, True)] * 4  # 2 layers x 2 forwards: no mask, causal, kv heads repeated


@pytest.mark.float64
def test_the_cp_engine_refuses_a_float64_model_before_start():
    with pytest.raises(ValueError) as e:
        TorchCP(of=sw.Parallel(cp=2)).check_model(GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2,
                                                                 n_embd=8)), 2, 4, 1, "nccl")
    assert str(e.value) == ("engine='torch' cannot run strategy 'parallel' on a float64 model: torch's ring attention "
                            "has forms of SDPA's flash, efficient and cuDNN kernels only, and none takes float64 "
                            "(efficient: float32 and half; flash, cuDNN: half); use float32 or half precision, or "
                            "engine='shardwise'")
