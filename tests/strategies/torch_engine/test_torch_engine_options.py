"""engine="torch" with the options around the engine: FSDP2's CPU offload, a meta-device model (each module's own
initialisation, a ``param_init_fn``, or ``init_from``'s weights), compiled blocks, and DDP's ``reduce_dtype`` as
torch's compress hook. Each run equals one device (float64); what torch's engines cannot run is refused, with
the reason, before any process starts.

One 2-rank launch trains every case in turn (the Trainer joins the running group), with gradient accumulation,
clipping by the global norm and parameter groups, as tests/strategies/torch_engine/test_torch_engine.py does.
"""
from __future__ import annotations

import os

import pytest
import torch
from test_torch_engine import ADAMW, gpt, no_decay_for_vectors
from tiny_hf import llama, logits_loss
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

import shardwise as sw
from shardwise import launch
from shardwise.models import MLP, lm_loss
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]


def mlp() -> nn.Module:
    """Built under the Trainer's seed (0): a meta copy, whose Linears' reset_parameters() run in the same order
    under the same seed, gets the same weights."""
    torch.manual_seed(0)
    return MLP(8, 16, 2, 4)


def regression() -> Dataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))


def text() -> Dataset:
    return CharText(stdlib_text(20_000), 16)


def scaled_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) * 2**12


WORK = {"gpt": (text, lm_loss), "mlp": (regression, F.mse_loss), "mlp-scaled": (regression, scaled_mse),
        "llama": (text, logits_loss)}


def fit(work: str, model: nn.Module, strategy: object, devices: int = 2, init_from: str | None = None,
        steps: int = 2, **kw: object) -> sw.FitResult:
    data, loss = WORK[work]
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2,
                      gradient_clip_val=0.05, memory_check="off", **kw).fit(
        model, data(), loss, ADAMW, batch_size=8, max_steps=steps, param_groups=no_decay_for_vectors,
        init_from=init_from)


def on_meta(make) -> nn.Module:  # noqa: ANN001
    with torch.device("meta"):
        return make()


def copy_from(model: nn.Module, reference: nn.Module):  # noqa: ANN201
    """A param_init_fn giving each module of ``model`` the tensors of the same names in ``reference`` (each module
    carries its name: the Trainer sets up a copy of the model)."""
    for name, m in model.named_modules():
        m.init_name = name and name + "."
    state = reference.state_dict()

    def init(m: nn.Module) -> None:
        for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            t.copy_(state[m.init_name + k])
    return init


def meta_llama(saved: str) -> nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(AutoConfig.from_pretrained(saved)).to(torch.float64)


def _every_case(rank: int, device: torch.device, folder: str, saved: str) -> None:
    """Every 2-rank run of this file, in the ranks of one launch; rank 0 saves (losses, weights) by case."""
    meta = on_meta(gpt)
    out = {
        # offload="all" is FSDP2's CPUOffloadPolicy (here CPU to CPU, unpinned: pinning needs an accelerator).
        "gpt fsdp offload": fit("gpt", gpt(), sw.FSDP(offload="all", engine="torch")),
        "gpt fsdp param_init_fn": fit("gpt", meta, sw.FSDP(param_init_fn=copy_from(meta, gpt()), engine="torch")),
        "gpt fsdp compiled": fit("gpt", gpt(), sw.FSDP(engine="torch"), compile="aot_eager"),
        # 3 steps: float16's rounding then moves a weight by more than 1e-6 (the test's check that it rounded).
        "mlp ddp fp16-hook": fit("mlp-scaled", mlp(), sw.DDP(reduce_dtype="float16", engine="torch"), steps=3),
        "mlp ddp fp16-ours": fit("mlp-scaled", mlp(), sw.DDP(reduce_dtype="float16"), steps=3),
        "mlp ddp meta": fit("mlp", on_meta(mlp), sw.DDP(engine="torch")),
        "mlp hsdp meta offload": fit("mlp", on_meta(mlp), sw.HSDP(shard_size=1, offload="all", engine="torch")),
    }
    assert all(s["compile_frames"] > 0 for s in out["gpt fsdp compiled"].stats)  # the blocks ran compiled
    for strategy in ("ddp", "fsdp"):
        out[f"llama {strategy} init_from"] = fit("llama", meta_llama(saved), strategy, engine="torch",
                                                 init_from=saved)
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny GQA Llama in float64 with weights no initialisation reproduces, saved as Hugging Face does."""
    path = str(tmp_path_factory.mktemp("llama"))
    model = llama()
    torch.manual_seed(46)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def test_options_around_torch_engines_equal_one_device(tmp_path, saved, same_run):
    from transformers import LlamaForCausalLM

    launch.spawn(_every_case, 2, args=(str(tmp_path), saved))
    runs = {k: sw.FitResult(losses, state) for k, (losses, state) in torch.load(tmp_path / "runs.pt").items()}
    refs = {"gpt": fit("gpt", gpt(), "single", 1), "mlp": fit("mlp", mlp(), "single", 1),
            "llama": fit("llama", LlamaForCausalLM.from_pretrained(saved, dtype=torch.float64), "single", 1)}
    hooked = {k: runs.pop(k) for k in ("mlp ddp fp16-hook", "mlp ddp fp16-ours")}
    for case, run in runs.items():
        same_run(refs[case.split()[0]], run)
    # Gradients sent in float16: torch's hook casts, then halves; ours halves, then casts. With every gradient in
    # float16's normal range (the loss scaled by 2**12) both round once, to the same numbers.
    same_run(hooked["mlp ddp fp16-ours"], hooked["mlp ddp fp16-hook"])
    wide = fit("mlp-scaled", mlp(), "single", 1, steps=3).state_dict  # and float16 rounded them: not the float64 run
    assert max((wide[k] - v).abs().max().item() for k, v in hooked["mlp ddp fp16-hook"].state_dict.items()) > 1e-6


FSDP_OFFLOAD = "engine='torch' cannot run strategy '{}' with offload='optimizer': torch's one offload is FSDP2's " \
    "CPUOffloadPolicy, which keeps the parameter shards on the CPU too and copies them over at each gather (our " \
    "offload='all'); no torch engine keeps a shard on the device and offloads only the optimizer; " \
    "engine='shardwise' runs it"


@pytest.mark.parametrize("strategy, message", [
    (sw.FSDP(offload="optimizer"), FSDP_OFFLOAD.format("fsdp")),
    (sw.ZeRO1(offload="optimizer"), FSDP_OFFLOAD.format("zero1")),
    (sw.FSDP(offload="all", offload_device="cuda:1"), "engine='torch' cannot run strategy 'fsdp' with "
     "offload_device='cuda:1': FSDP2's CPUOffloadPolicy offloads to the CPU only; engine='shardwise' runs it"),
    (sw.Parallel(dp=2, tp=2, zero=3, offload="all"), "engine='torch' cannot run strategy 'parallel' with "
     "offload='all' after tp: FSDP2's CPUOffloadPolicy is run here for fsdp, zero3 and hsdp alone; "
     "engine='shardwise' runs it"),
    (sw.DDP(allreduce="ring"), "engine='torch' cannot run strategy 'ddp' with allreduce='ring': torch's DDP "
     "all-reduces each bucket with the process group's own all-reduce (gloo's or NCCL's algorithm), so our "
     "algorithms have no place in it; use allreduce='native'; engine='shardwise' runs it"),
    (sw.DDP(reduce_dtype="float32"), "engine='torch' cannot run strategy 'ddp' with reduce_dtype='float32': "
     "torch's DDP sends gradients in float16 or bfloat16 only (fp16_compress_hook, bf16_compress_hook); "
     "engine='shardwise' runs it"),
])
def test_options_torch_cannot_run_are_refused_with_the_reason(strategy, message, no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, 4, accelerator="cpu", progress=False, engine="torch")
    assert str(e.value) == message


def test_bf16_gradients_on_gloo_are_refused_with_the_reason(no_spawn):
    with pytest.raises(ValueError) as e:
        fit("mlp", mlp(), sw.DDP(reduce_dtype="bfloat16", engine="torch"))
    assert str(e.value) == ("engine='torch' cannot run DDP(reduce_dtype='bfloat16') on gloo: torch's "
                            "bf16_compress_hook runs only with NCCL 2.10+ on CUDA (or XCCL); use "
                            "reduce_dtype='float16', or engine='shardwise'")
