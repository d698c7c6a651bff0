"""Compiled blocks (``compile=``) under each family of strategy: the same training as eager, and checkpoints that
resume either way.

Every run uses the ``aot_eager`` backend: dynamo captures each block (with the strategy's layers in it, its
communication left outside the graphs) and AOTAutograd builds the joint forward/backward graph, exactly what
inductor is given; only inductor's code generation is skipped, which costs 15-35 s per process on CPU (a cold
cache: 17.5 s for this model on one process, measured). The claim here is the capture and our wrappers around
it, so that is what each strategy runs (float64 throughout); inductor itself, ``compile=True``, runs in
tests/gpu/test_gpu_compile.py and in ``shardwise bench --pairs compile``. All of it is one test, so that the
ranks of the pool compile one model after another.

One strategy of each mechanism runs compiled: gradient hooks that reduce buckets while backward runs (``ddp``;
``zero1``'s hooks reduce-scatter the same buckets and its sharded step is outside the graph), FSDP's gathers around
each block (``fsdp``), the tensor-parallel layers and their collectives (``Parallel(dp=2, tp=2, zero=3)``, which
applies the same plan as ``tp`` alone, with FSDP over it) and a pipeline's stages (``PP``).
"""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

import shardwise as sw
from shardwise.workloads import gpt

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
STEPS = 3  # a checkpoint at step 2 and one step after it
STRATEGIES = [("single", 1), ("ddp", 2), ("fsdp", 2), (sw.PP(schedule="1f1b", microbatches=2), 2),
              (sw.Parallel(dp=2, tp=2, zero=3), 4)]


def fit(strategy, devices, compile=False, ckpt=None, every=None):
    work = gpt(n_layer=2, n_embd=32, n_head=4, block=16, max_chars=20_000)
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, compile=compile, checkpoint_dir=ckpt,
                      checkpoint_every=every).fit(work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=8,
                                                  max_steps=STEPS)


def resumable(src, dst):
    """A checkpoint directory holding only ``src``'s step-2 checkpoint."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "step_00000002"), os.path.join(dst, "step_00000002"))
    return dst


def test_compiled_training_equals_eager_under_each_strategy_family_and_checkpoints_resume_either_way(tmp_path,
                                                                                                  same_run):
    eager = fit("single", 1, ckpt=str(tmp_path / "eager"), every=2)
    for strategy, devices in STRATEGIES:
        name = getattr(strategy, "name", strategy)
        ckpt = every = None
        if name == "parallel":  # an eager run's checkpoint, resumed compiled (tp slices, FSDP shards)
            ckpt = resumable(str(tmp_path / "eager"), str(tmp_path / "to-compiled"))
        elif name == "ddp":  # a compiled run's checkpoint, resumed eager below
            ckpt, every = str(tmp_path / "compiled"), 2
        run = fit(strategy, devices, "aot_eager", ckpt, every)
        same_run(eager, run)
        assert all(s["compile_frames"] > 0 and s["compile_recompiles"] == 0 for s in run.stats), (name, run.stats)
    resumed = fit("single", 1, ckpt=resumable(str(tmp_path / "compiled"), str(tmp_path / "to-eager")))
    same_run(eager, resumed)


def test_split_backward_schedules_refuse_compiled_blocks(no_spawn):
    with pytest.raises(ValueError, match=r"^compile=True cannot run with strategy 'pp': schedule='zb-h1' splits each "
                                         r"backward into the input's gradient and the weights'"):
        sw.Trainer(sw.PP(schedule="zb-h1"), 2, accelerator="cpu", compile=True)
    with pytest.raises(ValueError, match="^compile must be True, False or a torch.compile backend name, got 1$"):
        sw.Trainer("ddp", 2, accelerator="cpu", compile=1)


@pytest.mark.float32  # fp16 autocast is the claim: it computes in half from float32 masters
def test_compiled_blocks_with_activation_checkpointing_and_the_fp16_scaler_train_as_eager(same_run):
    """Checkpointed blocks are what gets compiled (their recomputation inside the graph), and the loss scaler
    steps around them: without inductor's fusions the compiled run computes the eager run's numbers exactly."""
    def run(compile):
        work = gpt(n_layer=2, n_embd=32, n_head=4, block=16, max_chars=20_000)
        return sw.Trainer("single", 1, accelerator="cpu", progress=False, compile=compile, precision="16-mixed",
                          activation_checkpointing=True).fit(work.make_model(), work.train, work.loss_fn, ADAMW,
                                                             batch_size=8, max_steps=STEPS)
    eager, compiled = run(False), run("aot_eager")
    same_run(eager, compiled, rtol=0.0, atol=0.0)
    assert compiled.stats[0]["compile_frames"] > 0 and compiled.stats[0]["compile_recompiles"] == 0
