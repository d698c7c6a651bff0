"""engine="torch" for sw.Parallel's compositions, in torchtitan's order: pp, then tp, then FSDP2 over dp (and tp, then
FSDP2 as ZeRO-2 or HSDP), each equal to one device in float64, with a checkpoint that crosses engines.

One 4-rank launch trains every case in turn (the helpers of tests/strategies/torch_engine/test_torch_engine.py:
gradient accumulation, clipping by the global norm and parameter groups in each run), on our GPT (its embedding
tied to the head across the two stages) and a tiny Hugging Face Llama (GQA); one 8-rank launch runs all three: pp,
then tp, then FSDP2.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from test_torch_engine import ADAMW, _chain, _equal_one_device, fit, gpt

import shardwise as sw
from shardwise import launch
from shardwise.models import lm_loss
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

PP_FSDP = functools.partial(sw.Parallel, pp=2, dp=2, zero=3)
PP_TP = functools.partial(sw.Parallel, pp=2, tp=2)


def _compositions(rank: int, device: torch.device, folder: str) -> None:
    """Under torch: Parallel(pp=2, dp=2, zero=3) (FSDP2 on each stage chunk, driven by torch's schedule) on Llama
    under GPipe and on our GPT under zbv (a split backward: FSDP2 reduces after the weight backwards), and as HSDP
    (2 replicas of 1 shard) interleaved; Parallel(pp=2, dp=2) under zbv (zero=0: the gradients averaged after the
    schedule, not by torch's DDP); Parallel(pp=2, tp=2) (parallelize_module on each stage's modules) on Llama
    interleaved; tp, then FSDP2 as ZeRO-2 (zero=2) and as HSDP on the 2-D and 3-D meshes; on Llama,
    Parallel(pp=2, dp=2, zero=1) (ZeroRedundancyOptimizer over each stage's dp ranks, under torch's DDP) and
    zero=2 (FSDP2 unresharded) under zbv. A chain on one
    checkpoint directory, each run resuming the one before under the other engine: torch's Parallel(pp=2, dp=2,
    zero=3) (FSDP2 shards), ours, torch's Parallel(pp=2, tp=2) (our shards into DTensor tp slices)."""
    runs = {"llama pp-fsdp gpipe": PP_FSDP(schedule="gpipe"),
            "gpt pp-fsdp zbv": PP_FSDP(schedule="zbv"),
            "gpt pp-dp zbv": sw.Parallel(pp=2, dp=2, schedule="zbv"),
            "gpt pp-hsdp interleaved": PP_FSDP(replicate=2, schedule="interleaved"),
            "llama pp-tp interleaved": PP_TP(schedule="interleaved"),
            "gpt tp-zero2": sw.Parallel(dp=2, tp=2, zero=2),
            "llama tp-hsdp": sw.Parallel(dp=2, tp=2, zero=3, replicate=2),
            "llama pp-zero1": sw.Parallel(pp=2, dp=2, zero=1),
            "llama pp-zero2 zbv": sw.Parallel(pp=2, dp=2, zero=2, schedule="zbv")}
    out = {f"{case} torch": fit(case.split()[0], strategy, 4, steps=2, engine="torch")
           for case, strategy in runs.items()}
    _chain(out, folder, "gpt", [PP_FSDP(engine="torch"), PP_FSDP(), PP_TP(engine="torch")], 4)
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def test_parallel_compositions_with_pp_under_torch_equal_one_device_and_cross_engines(tmp_path, same_run):
    launch.spawn(_compositions, 4, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)


def test_dp_over_tp_in_a_pipeline_with_torch_s_ddp_is_refused_before_start(no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.Parallel(pp=2, tp=2, dp=2), 8, accelerator="cpu", progress=False, engine="torch").fit(
            gpt(), CharText(stdlib_text(2_000), 16), lm_loss, ADAMW, batch_size=8, max_steps=1)
    assert str(e.value) == (
        "engine='torch' runs strategy 'parallel' with dp > 1 over tp > 1 only with zero=2 or 3 (tp, then FSDP2 over "
        "dp), not zero=0: torch's DDP refuses tp's DTensor parameters over a process group (c10d.broadcast_ has no "
        "DTensor sharding strategy), and over a device mesh turns them into plain local tensors (torch's interim DDP "
        "+ tp transform), which hides their tp layout from the checkpoint and the clip; engine='shardwise' runs it")


def _three_ways(rank: int, device: torch.device, folder: str) -> None:
    """Parallel(pp=2, tp=2, dp=2, zero=3) under torch on 8 ranks: the pipeline's stages, tp on each stage's
    modules, then FSDP2 over dp on each chunk; rank 0 saves the run."""
    run = fit("gpt", sw.Parallel(pp=2, tp=2, dp=2, zero=3), 8, steps=2, engine="torch")
    if rank == 0:
        torch.save({"gpt pp-tp-fsdp torch": (run.losses, run.state_dict)}, os.path.join(folder, "runs.pt"))


def test_pp_then_tp_then_fsdp_under_torch_on_eight_ranks_equals_one_device(tmp_path, same_run):
    launch.spawn(_three_ways, 8, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)
