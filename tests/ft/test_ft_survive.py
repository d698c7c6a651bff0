"""A dead replica group changes the run's time, not its model: real processes, real kills, float64 equality.

One launch of ``ddp`` on 4 ranks survives three faults, at steps and on ranks
drawn from a seeded generator: a SIGKILL between steps, a SIGKILL from a
backward hook (its peers are then inside the step's reduction: the half-applied
case), and a SIGSTOP found by the missed heartbeats. The last group finishes
alone, equal to single-device training, and the ledger shows every sample of
every step used once; its CSV logger has every step's row, written on by the
next live rank after rank 0's group dies. Under ``ddp`` on 3 ranks, one SIGKILL
after a seeded step, for three seeds. The docs' program loses one rank of
three. Two launches of two ranks take the launcher to its ends: a group lost
below ``min_replicas``, and a raised exception, which is a bug and ends the job
as without fault tolerance. The ranks fork from the worker pool's fork server
(torch imported once), each a new process that the faults really kill.
"""
from __future__ import annotations

import csv
import datetime as _dt
import functools
import json
import os
import random
import signal

import docs_snippet
import pytest
import torch
from conftest import assert_same_run
from ft_ranks import die_or_raise
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.data import GlobalBatches
from shardwise.ft.options import ReplicaPlan
from shardwise.ft.supervise import ReplicasLost, run_replicas

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]

BATCH, STEPS, SAMPLES = 24, 10, 96
OPT = functools.partial(torch.optim.AdamW, lr=1e-2)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class Fault(sw.Callback):
    """On rank ``rank``, once ``step`` steps are committed (``when="end"``) or inside the backward of step index
    ``step`` (``"backward"``: from a gradient hook on the first layer's weight, whose gradient comes last), send
    this process ``sig``."""

    def __init__(self, rank: int, step: int, sig: int = signal.SIGKILL, when: str = "end") -> None:
        self.rank, self.step, self.sig, self.when = rank, step, sig, when
        self.current = -1

    def on_fit_start(self, info: sw.callbacks.CallbackInfo) -> None:
        if self.when == "backward" and info.rank == self.rank:
            first = info.optimizer.param_groups[0]["params"][0]
            first.register_post_accumulate_grad_hook(lambda p: self._fire(self.current == self.step))

    def on_step_start(self, info: sw.callbacks.CallbackInfo) -> None:
        self.current = info.step

    def on_step_end(self, info: sw.callbacks.CallbackInfo) -> None:
        self._fire(self.when == "end" and info.rank == self.rank and info.step == self.step)

    def _fire(self, now: bool) -> None:
        if now:
            os.kill(os.getpid(), self.sig)


def train(strategy: str = "single", devices: int = 1, **options) -> sw.FitResult:
    trainer = sw.Trainer(strategy, devices, progress=False, accumulate_grad_batches=2, gradient_clip_val=1.0,
                         max_processes_per_core=None, **options)
    return trainer.fit(mlp(), dataset(), nn.functional.mse_loss, OPT, batch_size=BATCH, max_steps=STEPS)


def faults(seed: int) -> list[Fault]:
    """Three faults on three of the four ranks, one after the other, at seeded steps."""
    rng = random.Random(seed)
    victims = rng.sample(range(4), 3)
    first = rng.randrange(1, 4)  # after `first` committed steps
    second = rng.randrange(first + 1, 7)  # inside step index `second`
    third = rng.randrange(second + 1, STEPS)  # after `third` committed steps
    return [Fault(victims[0], first), Fault(victims[1], second, when="backward"),
            Fault(victims[2], third, sig=signal.SIGSTOP)]


def global_batch(step: int, **order) -> list[int]:
    return sorted(GlobalBatches(dataset(), BATCH, 1, 0, seed=0, **order).indices(step))


def test_three_faults_end_equal_to_single_device_with_every_sample_once(tmp_path, capfd):
    ref = train()
    kill, hook_kill, stop = faults(seed=58)
    ledger = tmp_path / "ledger.jsonl"
    run = train("ddp", 4, fault_tolerance=sw.FaultTolerance(timeout_s=2.5), timeout_s=60, sample_ledger=ledger,
                callbacks=[kill, hook_kill, stop], logger=sw.loggers.CSV(tmp_path / "csv"), log_every_n_steps=1)
    assert_same_run(ref, run)
    err = capfd.readouterr().err
    [survivor] = {0, 1, 2, 3} - {kill.rank, hook_kill.rank, stop.rank}
    assert f"shardwise: replica group {kill.rank} left: rank {kill.rank} killed by signal SIGKILL; 3 of 4 groups " \
           "continue" in err
    assert f"shardwise: replica group {hook_kill.rank} left: rank {hook_kill.rank} killed by signal SIGKILL; " \
           "2 of 4 groups continue" in err
    assert f"shardwise: replica group {stop.rank} left: rank {stop.rank} sent no heartbeat for 2.5 s (stopped or " \
           "hung) and was killed; 1 of 4 groups continue" in err
    [stats] = run.stats
    assert (stats["rank"], stats["failures"], stats["live_groups"]) == (survivor, 3, [survivor])
    assert stats["steps_recomputed"] >= 3 and stats["seconds_lost"] > 0

    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    for line in lines:
        used = [i for samples in line["samples"].values() for i in samples]
        assert sorted(used) == global_batch(line["step"]), line  # every sample of the step, each once
        assert sorted(s for shards in line["shards"].values() for s in shards) == [0, 1, 2, 3], line
    # Who computed: the live groups of each step. The between-steps kill leaves after its step's commit; the
    # backward kill's step is computed again without it; the stopped rank had committed its step.
    gone = {kill.rank: kill.step, hook_kill.rank: hook_kill.step, stop.rank: stop.step}
    for line in lines:
        assert sorted(line["members"]) == sorted(g for g in range(4) if gone.get(g, STEPS) > line["step"]), line
    # The loggers live on the first rank of the first live group: when its group dies the next one reopens them
    # and goes on. Every step has its row; each quorum change is in the row of the step computed again.
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    torch.testing.assert_close([float(r["train/loss"]) for r in rows], ref.losses, rtol=1e-9, atol=0)
    changes = {int(r["step"]): r for r in rows if r.get("train/ft/seconds_lost")}
    recomputed = {kill.step: kill.rank, hook_kill.step: hook_kill.rank, stop.step: stop.rank}  # step index: who
    assert sorted(changes) == sorted(recomputed)
    for step, who in recomputed.items():
        assert float(changes[step][f"train/ft/left/group{who}"]) == 1.0
        assert float(changes[step]["train/ft/live_groups"]) == 4 - sorted(recomputed).index(step) - 1
        assert float(changes[step]["train/ft/seconds_lost"]) > 0


def test_a_kill_after_a_seeded_step_three_seeds_under_ddp_x3_each_equal_to_single_device(tmp_path):
    """One group of three killed by SIGKILL after a seeded random step, for three seeds: each run equals the one
    single-device reference, and its ledger has every sample of every step once, the victim's group in the steps
    before the kill only."""
    ref = train()
    for seed in (58, 59, 60):  # victims 2, 0, 1 after steps 4, 2, 5
        rng = random.Random(seed)
        victim, after = rng.randrange(3), rng.randrange(1, STEPS)
        ledger = tmp_path / f"ledger{seed}.jsonl"
        run = train("ddp", 3, fault_tolerance=sw.FaultTolerance(timeout_s=20.0), timeout_s=60, sample_ledger=ledger,
                    callbacks=[Fault(victim, after)])
        assert_same_run(ref, run)
        lines = [json.loads(line) for line in ledger.read_text().splitlines()]
        live = [g for g in range(3) if g != victim]
        assert [line["members"] for line in lines] == [[0, 1, 2]] * after + [live] * (STEPS - after), seed
        for line in lines:
            used = sorted(i for samples in line["samples"].values() for i in samples)
            assert used == global_batch(line["step"]), (seed, line)


def test_groups_of_two_fsdp_shards_one_killed_whole_group_leaves_and_the_model_equals_single_device(tmp_path, capfd):
    """sw.Parallel(dp=4, replicate=2, zero=3) on 4 ranks: 2 replica groups of 2 shards. A SIGKILL of one rank takes
    its whole group out; the other group computes both sample shards from then on, read in the run's order (the
    dataset's own, epochs of 2 global batches) from the middle of an epoch."""
    order = {"shuffle": False, "limit_train_batches": 2}
    ref = train(**order)
    victim, after = random.Random(5).choice([(1, 2), (3, 4), (2, 3)])
    ledger = tmp_path / "ledger.jsonl"
    run = train(sw.Parallel(dp=4, replicate=2, zero=3), 4, fault_tolerance=sw.FaultTolerance(timeout_s=20.0),
                timeout_s=60, sample_ledger=ledger, callbacks=[Fault(victim, after)], **order)
    assert_same_run(ref, run)
    group = victim // 2
    assert f"shardwise: replica group {group} left: rank {victim} killed by signal SIGKILL; 1 of 2 groups " \
           "continue" in capfd.readouterr().err
    assert sorted(s["rank"] for s in run.stats) == [r for r in range(4) if r // 2 != group]
    assert all((s["failures"], s["live_groups"]) == (1, [1 - group]) for s in run.stats)
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [line["members"] for line in lines] == [[0, 1]] * after + [[1 - group]] * (STEPS - after)
    for line in lines:
        used = sorted(i for samples in line["samples"].values() for i in samples)
        assert used == global_batch(line["step"], shuffle=False, epoch=2)


def test_the_docs_program_survives_a_kill_and_its_ledger_uses_every_sample_once(tmp_path, monkeypatch, capfd):
    """docs/how-to/fault-tolerance.md's program (ddp x 3, rank 1 killed after step 3): it checks the model itself."""
    docs_snippet.run("how-to/fault-tolerance.md", "fault-tolerance", tmp_path, monkeypatch)
    out, err = capfd.readouterr()
    assert out.startswith("8 steps; 1 failure, 1 step computed again, ") and out.endswith(
        " s lost; the model equals single-device training\n")
    assert "shardwise: replica group 1 left: rank 1 killed by signal SIGKILL; 2 of 3 groups continue" in err
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [line["members"] for line in lines] == [[0, 1, 2]] * 3 + [[0, 2]] * 5
    for line in lines:
        used = sorted(i for samples in line["samples"].values() for i in samples)
        assert used == sorted(GlobalBatches(docs_data(), 24, 1, 0, seed=0).indices(line["step"])), line


def docs_data() -> torch.utils.data.TensorDataset:
    torch.manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(96, 8, dtype=torch.float64),
                                          torch.randn(96, 1, dtype=torch.float64))


def test_below_min_replicas_one_error_and_no_process_left_and_an_exception_is_a_bug(capfd):
    """The launcher's two ends of a job: a dead group below ``min_replicas`` (one error naming it, no rank left
    running), and a raised exception, which is a bug, not a fault (the job ends with its traceback)."""
    plan = ReplicaPlan(replicas=2, group_size=1, ft=sw.FaultTolerance(min_replicas=2, timeout_s=20.0))
    before = _children()
    with pytest.raises(ReplicasLost) as e:
        run_replicas(die_or_raise, plan, args=("kill",), timeout=_dt.timedelta(seconds=30))
    assert str(e.value) == ("fault tolerance: 1 replica group left, fewer than min_replicas=2; dead: group 1 (rank 1 "
                            "killed by signal SIGKILL)")
    assert _children() - before == set()
    with pytest.raises(launch.WorkerFailed) as e:
        run_replicas(die_or_raise, plan, args=("raise",), timeout=_dt.timedelta(seconds=30))
    assert str(e.value).startswith("rank 1 raised ValueError: a bug in the step\n")
    assert not isinstance(e.value, ReplicasLost)
    assert _children() - before == set()


def _children() -> set[int]:
    """Every live process below this one: the ranks (started here, or by the worker pool's fork server) and the
    pool's workers."""
    parents = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":  # a zombie has ended: only its parent has not read its exit yet
            parents[int(d)] = int(ppid)
    below, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - below
        below |= frontier
    return below
