"""engine="torch": PyTorch's DDP and FSDP2 under the same Trainer, equal to one device and to our engines, with
checkpoints that cross between the engines; what the engine does not run is refused before any process starts.

One 2-rank launch trains every case in turn (the Trainer joins the running group), each with gradient
accumulation, clipping by the global norm and parameter groups, on our GPT and a tiny Hugging Face Llama (GQA).
"""
from __future__ import annotations

import functools
import os
import pathlib

import pytest
import torch
from tiny_hf import gpt2, llama, logits_loss

import shardwise as sw
from shardwise import launch
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
STEPS = 2


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))


MODELS = {"gpt": (gpt, lm_loss), "llama": (llama, logits_loss)}


def no_decay_for_vectors(model: torch.nn.Module) -> list[dict]:
    """Parameter groups by name: no weight decay for biases and norms (engines must keep the names)."""
    named = list(model.named_parameters())
    return [{"params": [n for n, p in named if p.dim() >= 2]},
            {"params": [n for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def fit(model: str, strategy: object, devices: int = 2, steps: int = STEPS, ckpt: str | None = None,
        **kw: object) -> sw.FitResult:
    make, loss = MODELS[model]
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2,
                      gradient_clip_val=0.05, checkpoint_dir=ckpt, memory_check="off", **kw).fit(
        make(), CharText(stdlib_text(20_000), 16), loss, ADAMW, batch_size=8, max_steps=steps,
        param_groups=no_decay_for_vectors)


class StartStep(sw.Callback):
    """Records the step a run starts at (a resumed run's checkpoint step)."""

    def on_fit_start(self, info) -> None:  # noqa: D102
        self.step = info.step


def _every_case(rank: int, device: torch.device, folder: str) -> None:
    """Every 2-rank run of this file, in the ranks of one launch; rank 0 saves (losses, weights) by case."""
    out: dict[str, sw.FitResult] = {}
    for model in MODELS:
        for strategy in ("ddp", "fsdp"):
            out[f"{model} {strategy} torch"] = fit(model, strategy, engine="torch")
    out["gpt fsdp shardwise"] = fit("gpt", "fsdp")
    # Each rank counts its FSDP2 shards (the local tensors of the DTensors): together, the model once.
    whole = sum(p.numel() * p.element_size() for p in gpt().parameters())
    assert sum(s["params_bytes"] for s in out["gpt fsdp torch"].stats) == whole
    # torch's traffic passes outside our communication layer: the stats say their comm bytes do not count it.
    assert [s["comm_counted"] for s in out["gpt fsdp torch"].stats + out["gpt fsdp shardwise"].stats] == \
        [False, False, True, True]
    # Save after 1 step under one engine, resume to STEPS under the other.
    starts = [StartStep(), StartStep()]
    fit("gpt", sw.DDP(engine="torch"), steps=1, ckpt=os.path.join(folder, "torch-ddp"))
    out["torch ddp -> shardwise fsdp"] = fit("gpt", sw.FSDP(), ckpt=os.path.join(folder, "torch-ddp"),
                                             callbacks=[starts[0]])
    fit("gpt", sw.FSDP(), steps=1, ckpt=os.path.join(folder, "fsdp"))
    out["shardwise fsdp -> torch ddp"] = fit("gpt", "ddp", ckpt=os.path.join(folder, "fsdp"), engine="torch",
                                             callbacks=[starts[1]])
    assert [s.step for s in starts] == [1, 1]  # both resumed from the other engine's step-1 checkpoint
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def test_torch_engines_equal_one_device_and_ours_and_checkpoints_cross_engines(tmp_path, same_run):
    launch.spawn(_every_case, 2, args=(str(tmp_path),))
    runs = {k: sw.FitResult(losses, state) for k, (losses, state) in torch.load(tmp_path / "runs.pt").items()}
    refs = {model: fit(model, "single", 1) for model in MODELS}
    for case, run in runs.items():
        same_run(refs.get(case.split()[0], refs["gpt"]), run)
    same_run(runs["gpt fsdp shardwise"], runs["gpt fsdp torch"])  # the same run under both engines


# The rows below run 1 or 2 steps and hand their checkpoint to a run under the other engine, which resumes it
# to 2 or 3: the suite's budget, with the mechanism's whole cycle (accumulation, clipping, the optimizer's step,
# a save, a load) in each. Each run equals the single-device run of its length, so the same run under both
# engines is equal too.
TP_THEN_FSDP = functools.partial(sw.Parallel, dp=2, tp=2, zero=3)
SP = functools.partial(sw.Parallel, tp=2, sequence_parallel=True)


def _chain(out: dict[str, sw.FitResult], folder: str, model: str, strategies: list[sw.Strategy],
           devices: int) -> None:
    """Run ``strategies`` one after another on one checkpoint directory, the i-th to step i + 1 (resuming the
    one before, which ran under the other engine); every run goes to ``out``."""
    ckpt, names = os.path.join(folder, f"{model} chain"), []
    for steps, strategy in enumerate(strategies, 1):
        start = StartStep()
        names.append(f"{strategy.name} {strategy.engine or 'shardwise'}")
        out[f"{model} {' -> '.join(names)}"] = fit(model, strategy, devices, steps=steps, ckpt=ckpt,
                                                   callbacks=[start])
        assert start.step == steps - 1  # resumed from the other engine's checkpoint


def _new_rows(rank: int, device: torch.device, folder: str) -> None:
    """zero1, zero2, hsdp and tp under torch's engines (and sw.Parallel split by dp alone, as zero=3 and zero=1),
    and tp with sequence parallelism (sw.Parallel split by
    tp alone), in one 2-rank launch; hsdp runs as 2 replicas of 1 shard (the 2-D mesh). Llama runs tp (its own
    plan under torch's styles; its sequence parallelism is refused); the other rows run on GPT alone: zero1
    (torch's DDP and ZeroRedundancyOptimizer) treats every model alike, and zero2 and hsdp wrap Llama's blocks
    in FSDP2 as fsdp does (test_torch_engines_equal_one_device_and_ours_and_checkpoints_cross_engines).
    Checkpoints cross engines: ZeroRedundancyOptimizer's states (saved by the rank that owns each) into our FSDP,
    and our sequence-parallel tp slices into torch's DTensors and back."""
    out: dict[str, sw.FitResult] = {}
    for model, strategy in [("gpt", sw.ZeRO2()), ("gpt", sw.HSDP(shard_size=1)), ("gpt", sw.Parallel(dp=2, zero=3)),
                            ("gpt", sw.Parallel(dp=2, zero=1)), ("llama", sw.TP())]:
        out[f"{model} {strategy.describe(2).label()} torch"] = fit(model, strategy, steps=2, engine="torch")
    _chain(out, os.path.join(folder, "zero1"), "gpt", [sw.ZeRO1(engine="torch"), sw.FSDP()], 2)
    _chain(out, os.path.join(folder, "sp"), "gpt", [SP(), SP(engine="torch"), SP()], 2)
    for strategy in (sw.DDP(), sw.FSDP(), sw.TP(), sw.PP()):  # checkpointed blocks, wrapped by torch's engines
        out[f"gpt {strategy.name}-ac torch"] = fit("gpt", strategy, steps=2, engine="torch",
                                                   activation_checkpointing=True)
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def _tp_then_fsdp(rank: int, device: torch.device, folder: str) -> None:
    """Parallel(dp=2, tp=2, zero=3) under torch (tp, then FSDP2 over dp) on both models in one 4-rank launch;
    on our GPT between two runs of our FSDP, whose checkpoint it resumes and leaves. Parallel(pp=2, dp=2) under
    torch (ScheduleInterleaved1F1B over torch's DDP on each stage) on our GPT."""
    out = {"llama parallel torch": fit("llama", TP_THEN_FSDP(), 4, steps=2, engine="torch"),
           "gpt parallel pp torch": fit("gpt", sw.Parallel(pp=2, dp=2, schedule="interleaved"), 4, steps=2,
                                        engine="torch")}
    _chain(out, folder, "gpt", [sw.FSDP(), TP_THEN_FSDP(engine="torch"), sw.FSDP()], 4)
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def _pp_rows(rank: int, device: torch.device, folder: str) -> None:
    """pp under torch.distributed.pipelining in one 2-rank launch: our GPT (its embedding tied to the head across
    the two stages) between two runs of our DDP, resuming one's checkpoint and leaving its own to the other;
    torch's zbv and interleaved schedules around our 1f1b, each resuming the other engine's stages; Llama under
    torch's GPipe."""
    out = {"llama pp torch": fit("llama", sw.PP(schedule="gpipe"), steps=2, engine="torch")}
    _chain(out, os.path.join(folder, "ddp"), "gpt", [sw.DDP(), sw.PP(engine="torch"), sw.DDP()], 2)
    _chain(out, os.path.join(folder, "pp"), "gpt", [sw.PP(schedule="zbv", engine="torch"), sw.PP(),
                                                    sw.PP(schedule="interleaved", engine="torch")], 2)
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def _equal_one_device(folder: pathlib.Path, same_run) -> None:
    """The launch's runs (saved by rank 0), each checked against the single-device run of its model and length."""
    runs = {k: sw.FitResult(losses, state) for k, (losses, state) in torch.load(folder / "runs.pt").items()}
    refs = {(k.split()[0], len(r.losses)): None for k, r in runs.items()}
    refs = {(model, steps): fit(model, "single", 1, steps=steps) for model, steps in refs}
    for case, run in runs.items():
        same_run(refs[case.split()[0], len(run.losses)], run)


def test_zero_hsdp_and_tp_rows_under_torch_equal_one_device(tmp_path, same_run):
    launch.spawn(_new_rows, 2, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)


def test_pp_under_torch_equals_one_device_and_crosses_engines(tmp_path, same_run):
    launch.spawn(_pp_rows, 2, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)


def test_tp_then_fsdp_and_pp_then_ddp_under_torch_equal_one_device_and_cross_engines(tmp_path, same_run):
    launch.spawn(_tp_then_fsdp, 4, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)


@pytest.mark.parametrize("strategy, kw, message", [
    (sw.DDP(engine="torch"), {"engine": "shardwise"},
     "Trainer(engine='shardwise') conflicts with the strategy's "
     "own engine='torch' (DDP(engine='torch')); give one "
     "of them"),
    ("ddp", {"engine": "pytorch"}, "engine must be 'shardwise' or 'torch', got 'pytorch'"),
    ("ps", {"engine": "torch"}, "engine='torch' has no engine for strategy 'ps': PyTorch has none for a parameter "
                                "server; engine='shardwise' runs it"),
    (sw.Parallel(dp=1, ep=2), {"engine": "torch"}, "engine='torch' has no engine for expert parallelism (ep > 1): "
                                                   "PyTorch has none; engine='shardwise' runs it"),
    (sw.Parallel(cp=2, engine="torch"), {}, "engine='torch' runs context parallelism on CUDA only: torch's "
     "context_parallel runs its ring attention through SDPA's "
     "flash, efficient and cuDNN kernels, which are CUDA's, "
     "and has no sharding strategy for the CPU's (aten._scaled_dot_product_flash_attention_for_cpu); "
     "engine='shardwise' runs it on CPU"),
    (sw.Parallel(pp=2, tp=2, sequence_parallel=True, engine="torch"), {}, "engine='torch' cannot run strategy "
     "'parallel' with pp > 1 and sequence_parallel=True: torch's sequence-parallel styles for our plan hold the "
     "sequence region from the embedding to the head within one module (shardwise.parallel.tp.torch_tp), and a "
     "pipeline stage holds only part of it; engine='shardwise' runs it"),
    ("ddp", {"engine": "torch", "sync_batchnorm": True}, "engine='torch' runs sync_batchnorm on CUDA only: torch's "
     "nn.SyncBatchNorm takes CUDA inputs only (on CPU its "
     "forward raises 'SyncBatchNorm expected input tensor to be "
     "on GPU', and its statistics kernel, batch_norm_stats, "
     "has no CPU implementation); engine='shardwise' runs it "
     "on CPU"),
])
def test_what_engine_torch_does_not_run_is_refused_before_start(strategy, kw, message, no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, 4, accelerator="cpu", progress=False, **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("model, strategy, devices, message", [
    ("gpt2", "tp", 2, "engine='torch' cannot run strategy 'tp' on GPT2LMHeadModel: the 'gpt2' plan adjusts module "
     "attributes to the local widths (fixup, local_attrs), "
     "which torch's styles do not; engine='shardwise' runs it"),
    ("llama", sw.Parallel(tp=2, sequence_parallel=True), 2,
     "engine='torch' cannot run strategy 'parallel' on "
     "LlamaForCausalLM: the 'llama' plan's sequence-parallel region "
     "starts at a block's input or ends without a head; "
     "engine='torch' runs it only from the embeddings to the head "
     "(shardwise's GPT); engine='shardwise' runs it"),
    ("gpt", sw.Parallel(tp=2), 4, "engine='torch' runs strategy 'parallel' with dp > 1 over tp > 1 only with zero=2 "
     "or 3 (tp, then FSDP2 over dp), not zero=0: torch's DDP "
     "refuses tp's DTensor parameters over a process group "
     "(c10d.broadcast_ has no DTensor sharding strategy), and "
     "over a device mesh turns them into plain local tensors "
     "(torch's interim DDP + tp transform), which hides their tp layout from the checkpoint and the clip; "
     "engine='shardwise' runs it"),
])
def test_what_torch_tp_cannot_run_is_refused_before_start(model, strategy, devices, message, no_spawn):
    make = {"gpt2": gpt2, "llama": llama, "gpt": gpt}[model]
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, devices, accelerator="cpu", progress=False, engine="torch").fit(
            make(), CharText(stdlib_text(2_000), 16), logits_loss, ADAMW, batch_size=8, max_steps=1)
    assert str(e.value) == message


def test_a_strategy_s_own_engine_wins_and_single_needs_none():
    assert type(sw.Trainer(sw.FSDP(engine="torch"), 2, accelerator="cpu").strategy).__name__ == "TorchFSDP"
    assert type(sw.Trainer("zero3", 2, accelerator="cpu", engine="torch").strategy).__name__ == "TorchFSDP"
    assert type(sw.Trainer("pp", 2, accelerator="cpu", engine="torch").strategy).__name__ == "TorchPP"
    assert type(sw.Trainer("ddp", 2, accelerator="cpu", engine="shardwise").strategy).__name__ == "DDP"
    assert sw.Trainer("single", 1, accelerator="cpu", engine="torch").strategy.name == "single"
    assert [sw.Trainer(s, 2, accelerator="cpu").engine for s in (sw.DDP(engine="torch"), "ddp")] == ["torch",
                                                                                                   "shardwise"]


def test_the_hand_written_loop_refuses_what_engine_torch_does_not_run(no_spawn):
    with pytest.raises(ValueError) as e:
        sw.setup(gpt(), functools.partial(torch.optim.SGD, lr=0.1), sw.Parallel(cp=2, engine="torch"),
                 accelerator="cpu")
    assert str(e.value).startswith("engine='torch' runs context parallelism on CUDA only: torch's context_parallel")


def test_one_process_without_a_group_is_refused_with_the_way_to_launch(no_spawn):
    with pytest.warns(UserWarning, match="runs one process"), pytest.raises(ValueError) as e:
        fit("gpt", "fsdp", devices=1, engine="torch")
    assert str(e.value) == ("engine='torch' runs torch's engine for strategy 'fsdp' in a process group, and this "
                            "one-process run has none: launch it with `shardwise run --nproc 1`, or drop "
                            "engine='torch' (one device splits nothing)")
