"""Pipeline parallelism: schedules, partitioning, equivalence with one process, bytes, events, torch parity."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.parallel.pp.build import balanced_starts, build_pipeline, stage_starts
from shardwise.parallel.pp.placement import Placement
from shardwise.parallel.pp.run import pipeline_step, resplit
from shardwise.parallel.pp.schedules import (
    Action,
    Recorder,
    bubble_fraction,
    check_message_order,
    gpipe_bubble,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
    simulate,
)
from shardwise.parallel.pp.timeline import replay
from shardwise.strategies.pp import PP
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


def make_gpt(tie: bool = False) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(**{**CFG.__dict__, "tie_weights": tie}))
    # Zero-gradient key bias (softmax ignores a shift shared by all keys): frozen so Adam's
    # amplified rounding noise does not decide the comparison.
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)
    return m


def make_tied_gpt() -> GPT:
    return make_gpt(tie=True)


def make_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    for b in m.transformer.h:  # the fused q|k|v bias holds the zero-gradient key bias
        b.attn.c_attn.bias.requires_grad_(False)
    return m


def logits_loss(out, y):
    return lm_loss(getattr(out, "logits", out), y)


def fit(strategy, devices, make=make_gpt, steps=4, clip=None, accumulate=1):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, gradient_clip_val=clip,
                      accumulate_grad_batches=accumulate).fit(
        make(), CharText(stdlib_text(20_000), 16), logits_loss, ADAMW, batch_size=8, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


# ---- schedules (no processes) ------------------------------------------------------
def test_1f1b_warms_up_then_alternates():
    assert [repr(a) for a in one_f_one_b(4, 6, 0)] == \
        ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert [repr(a) for a in one_f_one_b(4, 6, 3)] == \
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_simulated_bubble_equals_formula_and_1f1b_holds_at_most_p(p, m):
    for schedule in ("gpipe", "1f1b"):
        ev = simulate(schedule, p, m)
        assert bubble_fraction(ev) == pytest.approx(gpipe_bubble(p, m), abs=1e-12)
    assert peak_in_flight(simulate("gpipe", p, m)) == {s: m for s in range(p)}
    assert peak_in_flight(simulate("1f1b", p, m)) == {s: min(p - s, m) for s in range(p)}


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (2, 2, 3)])
def test_interleaving_divides_the_bubble_by_the_chunk_count(p, m, v):
    ev = simulate("interleaved", p, m, chunks=v, t_f=1.0 / v, t_b=2.0 / v)
    assert bubble_fraction(ev) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    check_message_order("interleaved", p, m, v)


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"number of micro-batches \(6\) to be a multiple of the pipeline size \(4\)"):
        interleaved_1f1b(4, 6, 0, 2)

    def backward_first(p, m, s, v=1):
        return [Action("B", 0), Action("F", 0)] if s == 0 else one_f_one_b(p, m, s)

    with pytest.raises(RuntimeError, match="schedule deadlocks"):
        simulate(backward_first, 2, 1)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zigzag'; valid: gpipe, 1f1b, interleaved, zb-h1"):
        PP(schedule="zigzag")


# ---- partitioning --------------------------------------------------------------------
def test_balanced_partition_minimises_the_largest_stage():
    assert balanced_starts([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_starts([10, 1, 1, 1, 1, 10], 2) == [0, 3]
    assert balanced_starts([5, 1, 1, 1, 8], 3) == [0, 1, 4]
    layers = [(n, nn.Linear(4, 4)) for n in ("a", "b", "c", "d")]
    assert stage_starts(layers, 2, ["c"]) == [0, 2]
    with pytest.raises(ValueError, match=r"split point 'x' is not a pipeline layer; layers are \['a', 'b', 'c', 'd'\]"):
        stage_starts(layers, 2, ["x"])
    with pytest.raises(ValueError, match=r"3 stages need 2 split points, got 1"):
        stage_starts(layers, 3, ["b"])
    with pytest.raises(ValueError, match=r"the model has 4 pipeline layers .*fewer than the 5 stages"):
        stage_starts(layers, 5)


def test_fewer_layers_than_stages_is_an_error_before_any_process_starts(no_spawn):
    with pytest.raises(ValueError, match=r"^the model has 4 pipeline layers \(\['embed', 'blocks.0', 'blocks.1', "
                                         r"'head'\]\), fewer than the 8 stages asked for; every stage needs at least "
                                         r"one layer$"):
        fit(PP(), 8, steps=1)
    # Interleaving asks for stages x chunks pieces.
    with pytest.raises(ValueError, match=r"fewer than the 6 stages asked for"):
        fit(PP(schedule="interleaved", chunks=2, microbatches=3), 3, steps=1)


def test_fewer_micro_batches_than_stages_warns_before_any_process_starts(no_spawn):
    msg = (r"^pipeline: 2 micro-batch\(es\) per step for 4 stages: fewer micro-batches than stages leaves stages "
           r"idle \(bubble \(p-1\)/\(m\+p-1\) = 60% of the step\); use microbatches >= 4$")
    with pytest.warns(UserWarning, match=msg), pytest.raises(no_spawn):
        fit(PP(microbatches=2), 4, steps=1)
    # Without microbatches=, the trainer's accumulation chunks are the micro-batches.
    with pytest.warns(UserWarning, match=msg), pytest.raises(no_spawn):
        fit(PP(), 4, steps=1, accumulate=2)
    with pytest.raises(ValueError, match=r"^pipeline: the local batch of 8 samples does not split into "
                                         r"microbatches=3 equal micro-batches"):
        fit(PP(microbatches=3), 2, steps=1)
    import warnings

    with warnings.catch_warnings():
        # Enough micro-batches (the default: one per stage): no pipeline warning.
        warnings.filterwarnings("error", message="pipeline:")
        with pytest.raises(no_spawn):
            fit(PP(), 4, steps=1)


def test_resplit_needs_equal_micro_batches():
    x, y = torch.zeros(8, 3), torch.zeros(8)
    assert [a.shape[0] for a, _ in resplit([(x[:4], y[:4]), (x[4:], y[4:])], 4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"local batch of 8 samples does not split into microbatches=3 equal"):
        resplit([(x, y)], 3)


# ---- training equals one process ----------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_equals_single(reference, same_run, schedule, stages):
    split = ["blocks.1"] if stages == 2 and schedule == "gpipe" else None  # named split points, once
    run = fit(PP(schedule=schedule, microbatches=4, split_points=split), stages)
    same_run(reference, run)
    if stages == 2:
        # Stage 0 sends each micro-batch's activations (B*T*D*itemsize bytes per step in all) plus one
        # 80-byte shape header in the first step; stage 1 sends the same bytes of gradients back.
        act = 8 * 16 * CFG.n_embd * torch.empty(()).element_size()
        assert run.stats[0]["comm_bytes_per_step"] == (4 * act + 80) / 4
        assert run.stats[1]["comm_bytes_per_step"] == act


def test_interleaved_1f1b_equals_single(reference, same_run):
    same_run(reference, fit(PP(schedule="interleaved", chunks=2, microbatches=4), 2))


def test_tied_weights_stay_in_sync_with_accumulation_and_clipping(same_run):
    # Embedding on stage 0, output head on stage 1, one weight: the copies' gradients are summed.
    ref = fit("single", 1, make_tied_gpt, clip=0.05)
    same_run(ref, fit(PP(schedule="1f1b"), 2, make_tied_gpt, clip=0.05, accumulate=4))


def test_tied_weights_can_be_rejected():
    with pytest.raises(Exception, match=r"parameter 'tok_emb.weight' \(also \['head.weight'\]\) is used by stages "
                                        r"\[0, 1\].*rejected with tied='error'"):
        fit(PP(tied="error"), 2, make_tied_gpt, steps=1)


def test_hf_gpt2_trains_under_pp(same_run):
    # GPT-2 ties lm_head to wte: the pipeline keeps the two stages' copies in sync.
    same_run(fit("single", 1, make_gpt2), fit(PP(schedule="gpipe", microbatches=2), 2, make_gpt2))


# ---- events and activation memory ------------------------------------------------------
def _record(rank: int, device: torch.device, m: int, path: str) -> None:
    topo = Topology.create(device, dp=1, tp=1, pp=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (8, 16), generator=g)
    y = torch.randint(0, 128, (8, 16), generator=g)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        pm = build_pipeline(make_gpt(), topo)
        rec = Recorder(track_saved=True)
        pipeline_step(pm, [(x, y)], lm_loss, topo, schedule, m, rec)
        events = rec.gather(topo.comm("pp"))
        peaks = topo.comm("pp").all_gather_object(rec.peak_saved_bytes, name="test")
        out[schedule] = (events, peaks)
    if rank == 0:
        torch.save(out, path)


def test_recorder_counts_in_flight_micro_batches_and_saved_activation_bytes(tmp_path):
    m, p = 4, 2
    path = str(tmp_path / "events.pt")
    launch.spawn(_record, p, args=(m, path))
    out = torch.load(path, weights_only=False)
    for events, _ in out.values():
        assert sorted((e.stage, e.kind, e.mb) for e in events) == \
            sorted((s, k, i) for s in range(p) for k in "FB" for i in range(m))
        assert all(e.end >= e.start for e in events)
    assert peak_in_flight(out["gpipe"][0]) == {0: m, 1: m}
    assert peak_in_flight(out["1f1b"][0]) == {0: p, 1: 1}
    # Every micro-batch saves the same activations: GPipe holds m of them, 1F1B p - s.
    g_peaks, f_peaks = out["gpipe"][1], out["1f1b"][1]
    assert g_peaks[0] * p == f_peaks[0] * m
    assert g_peaks[1] == f_peaks[1] * m


# ---- parity with torch.distributed.pipelining -------------------------------------------
def _against_torch(rank: int, device: torch.device) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    topo = Topology.create(device, dp=1, tp=1, pp=2)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    ours = build_pipeline(_clone(base), topo, split_points=["2"])
    mine = ours.stage(0)
    sub = _clone(base)[:2] if rank == 0 else _clone(base)[2:]
    theirs = Schedule1F1B(PipelineStage(sub, rank, 2, device, input_args=(torch.zeros(2, 16 if rank == 0 else 32),),
                                        group=topo.group("pp")), n_microbatches=4, loss_fn=F.mse_loss)
    o1, o2 = ADAMW(mine.parameters()), ADAMW(sub.parameters())
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        pipeline_step(ours, [(x, y)], F.mse_loss, topo, "1f1b", 4)
        theirs.step(x) if rank == 0 else theirs.step(target=y, losses=[])
        for o in (o1, o2):
            o.step()
            o.zero_grad()
    for (n, a), b in zip(mine.named_parameters(), sub.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {rank} {n}: {m}")


def _clone(m: nn.Sequential) -> nn.Sequential:
    import copy

    return copy.deepcopy(m)


def test_our_1f1b_equals_torch_schedule1f1b():
    launch.spawn(_against_torch, 2)


# ---- receives posted ahead -------------------------------------------------------------
class _Log:
    """A runner that computes nothing and logs what :func:`execute` asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        if name in ("in_flight", "saved_bytes"):
            return lambda: 0
        return lambda a, *rest, **kw: self.calls.append(f"{name} {a.kind}{a.mb}")


def test_execute_posts_the_next_receives_before_each_compute():
    from shardwise.parallel.pp.run import execute
    from shardwise.parallel.pp.schedules import zb_h1

    log = _Log()
    acts = zb_h1(2, 3, 0, 1)  # stage 0: F0 F1 B0 W0 F2 B1 W1 B2 W2
    assert [f"{a.kind}{a.mb}" for a in acts] == "F0 F1 B0 W0 F2 B1 W1 B2 W2".split()
    execute(acts, log, 0)
    posts = [c for c in log.calls if c.startswith("post_recv")]
    computes = [c.split()[1] for c in log.calls if c.split()[0] in ("forward", "backward_input", "backward_weight")]
    assert computes == "F0 F1 B0 W0 F2 B1 W1 B2 W2".split()
    # Before each compute, the next F and the next B after it are asked for (a receive that is not possible yet,
    # a backward whose forward has not run, is asked for again after the compute).
    for i, name in enumerate(computes):
        at = log.calls.index(next(c for c in log.calls if c.endswith(" " + name) and c.split()[0] in
                                  ("forward", "backward_input", "backward_weight")))
        before = {c.split()[1] for c in log.calls[:at] if c.startswith("post_recv")}
        wanted = {next((n for n in computes[i + 1:] if n[0] == k), None) for k in "FB"} - {None}
        assert wanted <= before, (name, wanted, before)
    # Each kind's receives are asked for in that kind's action order (no receive overtakes another on its
    # channel), every one but the very first action's.
    for k in "FB":
        firsts = list(dict.fromkeys(c.split()[1] for c in posts if c.split()[1][0] == k))
        assert firsts == [n for n in computes[1:] if n[0] == k]


def test_execute_runs_a_whole_backward_in_one_pass():
    """A whole B (DualPipeV's pairs) is the plain backward, the chunk's reduction in it when its W is the chunk's
    last; its W computes nothing and is recorded with no length. A whole B must be followed by its W."""
    from shardwise.parallel.pp.run import execute
    from shardwise.parallel.pp.schedules import Recorder, _dualpipev_order

    class Last(_Log):
        def backward(self, a, last):
            self.calls.append(f"backward {a!r} last={last}")

    acts = _dualpipev_order(2, 4, 0)  # DualPipe's own whole backwards only: whole and split ones mixed
    assert " ".join(map(repr, acts)) == ("F0 F1 F2 F0.1 B0.1 W0.1 F1.1 F3 BW1.1 W1.1 F2.1 BW0 W0 BW2.1 W2.1 F3.1 "
                                         "BW1 W1 BW3.1 W3.1 B2 W2 B3 W3")
    log, rec = Last(), Recorder()
    execute(acts, log, 0, rec)
    computes = [c for c in log.calls if c.split()[0] in ("forward", "backward", "backward_input", "backward_weight")]
    # BW3.1's W is chunk 1's last: data-parallel wrappers reduce chunk 1 in that pass.
    assert [c for c in computes if not c.startswith("forward")] == [
        "backward_input B0", "backward_weight W0", "backward BW1.1 last=False", "backward BW0 last=False",
        "backward BW2.1 last=False", "backward BW1 last=False", "backward BW3.1 last=True", "backward_input B2",
        "backward_weight W2", "backward_input B3", "backward_weight W3"]
    ws = {(e.mb, e.chunk): e for e in rec.events if e.kind == "W"}
    assert all((ws[a.mb, a.chunk].end == ws[a.mb, a.chunk].start) == a.whole for a in acts if a.kind == "B")
    with pytest.raises(ValueError, match=r"the whole backward BW0.1 must be followed at once by its W \(W0.1\)"):
        execute([Action("F", 0, 1), Action("B", 0, 1, True), Action("F", 1, 1), Action("W", 0, 1)], _Log(), 1)


def _ahead(rank: int, device: torch.device, path: str) -> None:
    from shardwise.parallel.pp import run as pipeline_run

    topo = Topology.create(device, dp=1, tp=1, pp=2)
    posted: list[str] = []
    real = pipeline_run._Runner.post_recv

    def counting(self, a):
        n = len(self.posted)
        real(self, a)
        if len(self.posted) > n:
            posted.append(f"{a.kind}{a.mb}")
    pipeline_run._Runner.post_recv = counting
    pm = build_pipeline(make_gpt(), topo)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
    per_step = []
    for _ in range(2):
        posted.clear()
        pipeline_step(pm, [(x, y)], lm_loss, topo, "zb-h1", 4)
        per_step.append(list(posted))
    out = topo.comm("pp").all_gather_object(per_step, name="test")
    if rank == 0:
        torch.save(out, path)


@pytest.mark.timeout(120)
def test_receives_are_posted_ahead_once_shapes_are_known(tmp_path):
    path = str(tmp_path / "posted.pt")
    launch.spawn(_ahead, 2, args=(path,))
    (first0, second0), (first1, second1) = torch.load(path, weights_only=False)
    # Stage 0 receives gradients only: each known once its forward ran, from the first step on; B0's receive is
    # posted while F1 computes (it is the next B then), the others as their turn comes near.
    assert first0 == second0 == ["B0", "B1", "B2", "B3"]
    # Stage 1 receives activations: their shape arrives with the first one (a header), so F0's is never posted
    # ahead, and in the first step the header's own receive comes first.
    assert first1 == ["F1", "F2", "F3"] and second1 == ["F1", "F2", "F3"]


@pytest.mark.timeout(10)
def test_replay_runs_the_plans_of_the_placement_it_is_given():
    plans = [one_f_one_b(2, 2, s) for s in range(2)]
    # stage 1's F1 waits behind its B0 (4), stage 0's B1 for stage 1's (7): each action when rank and input are ready
    assert sorted((e.stage, e.start, e.end, e.kind, e.mb) for e in replay(plans, Placement(2, 1))) == [
        (0, 0.0, 1.0, "F", 0), (0, 1.0, 2.0, "F", 1), (0, 4.0, 6.0, "B", 0), (0, 7.0, 9.0, "B", 1),
        (1, 1.0, 2.0, "F", 0), (1, 2.0, 4.0, "B", 0), (1, 4.0, 5.0, "F", 1), (1, 5.0, 7.0, "B", 1)]
    with pytest.raises(ValueError, match=r"^3 ranks' actions for a placement of 2 ranks$"):
        replay(plans + [[]], Placement(2, 1))


class _Send:
    def __init__(self, name: str, done: bool) -> None:
        self.name, self.done, self.polls = name, done, 0

    def poll(self) -> bool:
        self.polls += 1
        return self.done


@pytest.mark.timeout(10)
def test_finished_sends_are_dropped_oldest_first_and_no_send_is_polled_behind_one_in_flight():
    from collections import deque
    from types import SimpleNamespace

    from shardwise.parallel.pp.run import _Runner

    runner = SimpleNamespace(sends=deque())
    a, b, c, d = _Send("a", True), _Send("b", False), _Send("c", True), _Send("d", False)
    for h in (a, b, c):
        _Runner._sent(runner, h)
    # a finished and went when b was sent; b is in flight, so c (finished) waits behind it unpolled.
    assert [h.name for h in runner.sends] == ["b", "c"] and c.polls == 0
    b.done = True
    _Runner._sent(runner, d)
    assert [h.name for h in runner.sends] == ["d"] and (a.polls, b.polls, c.polls, d.polls) == (1, 2, 1, 0)
