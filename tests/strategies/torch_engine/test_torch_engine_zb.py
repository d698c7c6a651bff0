"""engine="torch" with the zero-bubble schedules: ``zb-h1`` under torch's ``ScheduleInterleavedZeroBubble`` given
one stage per rank, ``dualpipev`` under ``ScheduleDualPipeV`` on the V (rank r holds stages r and 2p-1-r).

One 2-rank launch runs, for each, a chain on one checkpoint directory: torch's schedule, then ours, then torch's,
each resuming the other engine's checkpoint and each equal to one device in float64 on our GPT (its embedding
tied to the head across the stages). torch's ZB-H1 order is checked here against ours for more sizes than the
launch runs; the V orders are checked in tests/parallel/pp/test_zero_bubble.py (test_v_orders_are_torchs).
"""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch
from test_torch_engine import ADAMW, _chain, _equal_one_device, gpt
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

import shardwise as sw
from shardwise import launch
from shardwise.models import lm_loss
from shardwise.parallel.pp.schedules import Action, zb_h1
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ZBH1 = functools.partial(sw.PP, schedule="zb-h1")
DUALPIPEV = functools.partial(sw.PP, schedule="dualpipev", microbatches=4)  # DualPipeV needs m >= 2p


def _zero_bubble_rows(rank: int, device: torch.device, folder: str) -> None:
    """Both chains in the ranks of one launch; rank 0 saves (losses, weights) by run."""
    out: dict[str, sw.FitResult] = {}
    for name, schedule in (("zb-h1", ZBH1), ("dualpipev", DUALPIPEV)):
        chain: dict[str, sw.FitResult] = {}  # its runs' names, "gpt pp torch -> pp shardwise", do not say which
        _chain(chain, os.path.join(folder, name), "gpt", [schedule(engine="torch"), schedule(),
                                                          schedule(engine="torch")], 2)
        out.update({f"{k} ({name})": run for k, run in chain.items()})
    if rank == 0:
        torch.save({k: (r.losses, r.state_dict) for k, r in out.items()}, os.path.join(folder, "runs.pt"))


def test_zero_bubble_schedules_under_torch_equal_one_device_and_cross_engines(tmp_path, same_run):
    launch.spawn(_zero_bubble_rows, 2, args=(str(tmp_path),))
    _equal_one_device(tmp_path, same_run)


def _torch_zb_h1(p: int, m: int, r: int) -> list[Action]:
    """torch's ScheduleInterleavedZeroBubble for rank r of p, one stage each, in our notation (its I is our B)."""
    rounds = max(1, m // p)
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, n_local_stages=1, microbatches_per_round=m // rounds)
    kinds = {"F": "F", "I": "B", "W": "W"}
    return [Action(kinds[a.computation_type.value], a.microbatch_index)
            for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r) if a is not None]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_torch_zero_bubble_on_one_stage_per_rank_runs_our_zb_h1(p):
    """Every micro-batch count torch takes (it refuses those its rounds do not divide), from fewer than p."""
    for m in (m for m in range(1, 3 * p + 2) if m % max(1, m // p) == 0):
        for r in range(p):
            assert _torch_zb_h1(p, m, r) == zb_h1(p, m, r), (p, m, r)


def test_an_m_torch_s_rounds_do_not_divide_is_refused_before_start(no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.PP(schedule="zb-h1", microbatches=5), 2, accelerator="cpu", progress=False,
                   engine="torch").fit(gpt(), CharText(stdlib_text(2_000), 16), lm_loss, ADAMW,
                                       batch_size=10, max_steps=1)
    assert str(e.value) == ("engine='torch' cannot run strategy 'pp' with schedule='zb-h1': torch's "
                            "ScheduleInterleavedZeroBubble runs the micro-batches in max(1, m // p) = 2 rounds of "
                            "equal size, and microbatches=5 does not split into 2; use a multiple of the 2 stages; "
                            "engine='shardwise' runs it")
