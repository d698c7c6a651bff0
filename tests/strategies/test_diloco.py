"""DiLoCo: equal to DDP where the maths says so, equal to the paper's algorithm written out, exact bytes,
a mid-cycle resume equal to the uninterrupted run, and bad input refused before anything starts.

Every run of one world size trains in one launch (the ranks run each scenario in turn, each a Trainer.fit in
the running group); the references are computed here, in one process."""
from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import torch
from conftest import assert_same_run, once_per_run
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.comm.collectives import Comm, CommStats
from shardwise.comm.quantized import start_mean
from shardwise.data import as_source
from shardwise.parallel.dp.diloco import OuterLoop, Streaming
from shardwise.plan.comm import bytes_sent
from shardwise.plan.estimate import sync_collective
from shardwise.plan.specs import ClusterSpec

pytestmark = [pytest.mark.timeout(420), pytest.mark.float64]

SAMPLES, FEATURES, OUT, BATCH = 96, 6, 2, 8
SGD = functools.partial(torch.optim.SGD, lr=0.1)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=0.02, weight_decay=0.01)
PLAIN_OUTER = functools.partial(torch.optim.SGD, lr=1.0)
LOSS = nn.functional.mse_loss


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.sin(x[:, :OUT]) + 0.1 * torch.randn(SAMPLES, OUT, generator=g,
                                                                                         dtype=torch.float64))


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, OUT)).double()


class Run:
    def __init__(self, losses, state_dict, stats=None):
        self.losses, self.state_dict, self.stats = losses, state_dict, stats or []


def diloco(inner="ddp", replicas=2, sync_every=3, outer=None, **streaming):
    return sw.DiLoCo(inner, replicas=replicas, sync_every=sync_every, outer_optimizer=outer, **streaming)


def even_model() -> nn.Module:
    """Four equal layers (42 parameters each): 2 or 4 fragments of exactly equal bytes."""
    torch.manual_seed(2)
    layers = [nn.Linear(FEATURES, FEATURES) for _ in range(4)]
    return nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2], nn.Tanh(), layers[3]).double()


def even_loss(out, y):
    return LOSS(out[:, :OUT], y)


EVEN_BYTES = 4 * (FEATURES * FEATURES + FEATURES) * 8


# name -> (strategy, inner optimizer, steps, Trainer options); every run on 4 ranks, in one launch.
SCENARIOS = {
    "ddp sgd+momentum": ("ddp", MOMENTUM, 6, {}),
    "diloco H=1 R=2 sgd+momentum": (diloco(replicas=2, sync_every=1, outer=PLAIN_OUTER), MOMENTUM, 6, {}),
    "ddp sgd": ("ddp", SGD, 6, {}),
    "diloco H=1 R=4 sgd": (diloco(replicas=4, sync_every=1, outer=PLAIN_OUTER), SGD, 6, {}),
    "ddp adamw": ("ddp", ADAMW, 6, {}),
    "diloco R=1 H=3 adamw": (diloco(replicas=1, sync_every=3, outer=PLAIN_OUTER), ADAMW, 6, {}),
    "diloco R=2 H=3 adamw": (diloco(replicas=2, sync_every=3), ADAMW, 7, {"log_every_n_steps": 1}),
    "diloco R=4 H=2 adamw": (diloco(replicas=4, sync_every=2), ADAMW, 6, {}),
    "diloco fsdp R=2 H=2 adamw": (diloco("fsdp", replicas=2, sync_every=2), ADAMW, 6, {}),
    "diloco pp R=2 H=2 adamw": (diloco("pp", replicas=2, sync_every=2), ADAMW, 6, {}),
    # A checkpoint after step 4 (mid-cycle: one sync done, one inner step into the next), then a resume to 7.
    "resume: first 4 steps": (diloco(replicas=2, sync_every=3), ADAMW, 4, {"checkpoint_every": 4}),
    "resume: to step 7": (diloco(replicas=2, sync_every=3), ADAMW, 7, {}),
    # Streaming: fragments, delay, alpha (the even model); an 8-step run ends with a sync in flight.
    "stream F=2 H=4 d=0 a=0 R=4": (diloco(replicas=4, sync_every=4, fragments=2), ADAMW, 8, {"log_every_n_steps": 1}),
    "stream F=2 H=4 d=1 a=0.5 R=2": (diloco(replicas=2, sync_every=4, fragments=2, delay=1, alpha=0.5), ADAMW, 8, {}),
    "stream F=4 H=8 d=1 a=0 R=4": (diloco(replicas=4, sync_every=8, fragments=4, delay=1), ADAMW, 10, {}),
    # The plain model: fragments of 48 and 26 parameters.
    "stream F=2 H=2 d=0 a=0.5 R=4 uneven": (diloco(replicas=4, sync_every=2, fragments=2, alpha=0.5), ADAMW, 5,
                                            {"log_every_n_steps": 1}),
    "stream bf16 F=2 H=4 d=0 a=0 R=4": (diloco(replicas=4, sync_every=4, fragments=2, quantize="bf16"), ADAMW, 8,
                                        {"log_every_n_steps": 1}),
}
EVEN = ("stream F=2 H=4", "stream F=4", "stream bf16")


def _fit(strategy, optimizer, steps, checkpoint_dir=None, even=False, **options):
    trainer = sw.Trainer(strategy, 4, accelerator="cpu", progress=False, checkpoint_dir=checkpoint_dir, **options)
    net, loss = (even_model(), even_loss) if even else (model(), LOSS)
    result = trainer.fit(net, dataset(), loss, optimizer, batch_size=BATCH, max_steps=steps)
    return Run(result.losses, result.state_dict, result.stats)


def _loop(rank, steps=4):
    """A hand-written loop on sw.setup: 2 replicas of ddp on 2 ranks, a sync every 2 steps."""
    net, opt = sw.setup(model(), ADAMW, strategy=diloco(replicas=2, sync_every=2))
    reads = as_source(dataset()).train_batches(BATCH, 4, rank, seed=0, start=0, stop=steps)
    losses = []
    for step in range(steps):
        x, y = reads.batch(step, torch.device("cpu"))
        loss = LOSS(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(sw.all_reduce_mean(loss.detach())))
    return Run(losses, net.state_dict())


def _rank(rank, device, out, tmp):
    torch.set_num_threads(1)
    runs = {}
    for i, (name, (strategy, optimizer, steps, options)) in enumerate(SCENARIOS.items()):
        where = {"checkpoint_dir": os.path.join(tmp, "ckpt")} if name.startswith("resume") else {}
        if "log_every_n_steps" in options:
            where["metrics_path"] = os.path.join(tmp, f"metrics{i}.jsonl")
        runs[name] = _fit(strategy, optimizer, steps, even=name.startswith(EVEN), **where, **options)
        if rank == 0:
            print(f"diloco scenario ok: {name}", flush=True)
    runs["sw.setup loop"] = _loop(rank)
    torch.save(_quantized_means(rank), os.path.join(tmp, f"means{rank}.pt"))
    if rank == 0:
        torch.save({k: vars(v) for k, v in runs.items()}, out)


def _inputs(rank):
    """Rank ``rank``'s tensors for the quantized means: 1024 + 8 values over several magnitudes (one tensor of
    1024, a multiple of 4 ranks x 64 per int8 block: no padding; one of 8, which pads)."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1024, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 1024, dtype=torch.float64)
    return [x, torch.randn(8, generator=g, dtype=torch.float64)]


def _quantized_means(rank):
    """Every encoding's mean over the 4 ranks of ``_inputs``: the results and the bytes each sent."""
    out = {}
    for quantize in (None, "bf16", "int8"):
        comm = Comm(None, CommStats())
        for ts in ([_inputs(rank)[0]], _inputs(rank)):
            start_mean(comm, ts, "q.mean", quantize)()
            out[quantize, len(ts)] = ([t.clone() for t in ts], comm.stats.sent)
            comm.stats.reset()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return once_per_run("diloco-runs", tmp_path_factory, lambda: _launch_runs(tmp_path_factory))


def _launch_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diloco")
    out = str(tmp / "runs.pt")
    launch.spawn(_rank, 4, args=(out, str(tmp)))
    runs = {k: Run(**v) for k, v in torch.load(out, weights_only=False).items()}
    for i, name in enumerate(SCENARIOS):
        if (tmp / f"metrics{i}.jsonl").exists():
            runs[name].metrics = [json.loads(line) for line in (tmp / f"metrics{i}.jsonl").read_text().splitlines()]
    runs["metrics"] = runs["diloco R=2 H=3 adamw"].metrics
    runs["every rank's means"] = [torch.load(tmp / f"means{r}.pt", weights_only=False) for r in range(4)]
    return runs


# ---- the papers' algorithm, written out in one process ----------------------------------------------------
# DiLoCo (Douillard et al. 2023, Algorithm 1) and Streaming DiLoCo (Douillard et al. 2025): R replicas in a loop,
# each its own inner optimizer on its own samples (the shares of the job's data-parallel ranks r*D .. r*D + D - 1).
# Fragment p (contiguous parameters, cut by bytes: a tensor goes to fragment floor(F * bytes before it / total))
# is due after step (p + 1) H / F + k H: the mean over replicas of (θ_p - θ_r,p) is taken then; τ steps later it
# is θ_p's outer gradient, and every replica's fragment becomes α θ_r,p + (1 - α) θ_p. Means still pending when
# the run stops are applied at its end, in fragment order. F = 1, τ = 0, α = 0 is Algorithm 1.
def paper(replicas, sync_every, steps, data_ranks=1, inner=ADAMW, outer=None, fragments=1, delay=0, alpha=0.0,
          make=model, loss_fn=LOSS):
    global_model = make()
    local = [copy.deepcopy(global_model) for _ in range(replicas)]
    inners = [inner(m.parameters()) for m in local]
    theta = list(global_model.parameters())
    outer_opt = (outer or functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))(theta)
    source, shards = as_source(dataset()), replicas * data_ranks
    reads = [[source.train_batches(BATCH, shards, r * data_ranks + d, seed=0, start=0, stop=steps)
              for d in range(data_ranks)] for r in range(replicas)]
    sizes = [t.numel() * 8 for t in theta]
    part = [min(fragments - 1, fragments * sum(sizes[:j]) // sum(sizes)) for j in range(len(theta))]
    members = [[j for j in range(len(theta)) if part[j] == p] for p in range(fragments)]
    offsets = [(p + 1) * sync_every // fragments for p in range(fragments)]
    losses, norms, pending = [], [], {}

    def due(step, start):
        return step >= start and (step - start) % sync_every == 0

    def apply(p):
        with torch.no_grad():
            for j, d in zip(members[p], pending.pop(p)):
                theta[j].grad = d
            norms.append(float(torch.cat([theta[j].grad.reshape(-1) for j in members[p]] +
                                         [torch.zeros(0, dtype=torch.float64)]).norm()))
            outer_opt.step()
            outer_opt.zero_grad(set_to_none=True)
            for m in local:
                mine = list(m.parameters())
                for j in members[p]:
                    mine[j].copy_(alpha * mine[j] + (1 - alpha) * theta[j])

    for step in range(1, steps + 1):
        step_losses = []
        for r in range(replicas):
            parts = [b.batch(step - 1, torch.device("cpu")) for b in reads[r]]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = loss_fn(local[r](x), y)
            inners[r].zero_grad()
            loss.backward()
            inners[r].step()
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / replicas)
        for p in range(fragments):
            if due(step, offsets[p]):
                with torch.no_grad():
                    pending[p] = [sum(theta[j] - list(m.parameters())[j] for m in local) / replicas
                                  for j in members[p]]
        for p in [p for p in list(pending) if due(step, offsets[p] + delay)]:
            apply(p)
    for p in sorted(pending):
        apply(p)
    run = Run(losses, {k: v.detach().clone() for k, v in global_model.state_dict().items()})
    run.norms = norms
    return run


def test_one_inner_step_per_sync_with_a_plain_outer_step_is_ddp(runs):
    # θ - mean_r(θ - θ_r) = mean_r θ_r: with an inner optimizer linear in the gradient, the mean of the replicas'
    # steps is the step of the averaged gradient, momentum included (each replica's buffer, averaged, is DDP's).
    assert_same_run(runs["ddp sgd+momentum"], runs["diloco H=1 R=2 sgd+momentum"])
    assert_same_run(runs["ddp sgd"], runs["diloco H=1 R=4 sgd"])


def test_one_replica_with_a_plain_outer_step_is_the_inner_strategy(runs):
    assert_same_run(runs["ddp adamw"], runs["diloco R=1 H=3 adamw"])


@pytest.mark.parametrize("name, replicas, sync_every, steps, data_ranks", [
    ("diloco R=2 H=3 adamw", 2, 3, 7, 2),  # 7 steps: the weights are the global ones of the sync after step 6
    ("diloco R=4 H=2 adamw", 4, 2, 6, 1),
    ("diloco fsdp R=2 H=2 adamw", 2, 2, 6, 2),
    ("diloco pp R=2 H=2 adamw", 2, 2, 6, 1),
])
def test_equals_the_papers_algorithm(runs, name, replicas, sync_every, steps, data_ranks):
    assert_same_run(paper(replicas, sync_every, steps, data_ranks), runs[name])


def test_a_hand_written_loop_on_setup_runs_diloco(runs):
    assert_same_run(paper(2, 2, 4, data_ranks=2), runs["sw.setup loop"])


def test_the_loggers_get_the_outer_steps_and_the_pseudo_gradient_norm(runs):
    rows, ref = runs["metrics"], paper(2, 3, 7, data_ranks=2)
    assert [r["diloco/outer_steps"] for r in rows] == [0, 0, 1, 1, 1, 2, 2]
    synced = [r["diloco/pseudo_grad_norm"] for r in rows if "diloco/pseudo_grad_norm" in r]
    assert [r["step"] for r in rows if "diloco/pseudo_grad_norm" in r] == [2, 5]
    torch.testing.assert_close(torch.tensor(synced), torch.tensor(ref.norms), rtol=1e-9, atol=0)


def test_a_resume_mid_cycle_equals_the_uninterrupted_run(runs):
    assert_same_run(runs["diloco R=2 H=3 adamw"], runs["resume: to step 7"])
    assert runs["resume: to step 7"].losses[:4] == runs["resume: first 4 steps"].losses


def test_a_sync_sends_one_ddp_all_reduce_and_H_steps_send_one_Hth(runs):
    ddp, h1, h2 = runs["ddp sgd"], runs["diloco H=1 R=4 sgd"], runs["diloco R=4 H=2 adamw"]
    for d, one, two in zip(ddp.stats, h1.stats, h2.stats):
        # One rank per replica: the replicas' group is the world, as DDP's on 4 ranks.
        assert one["comm_by_name"]["diloco"] == 6 * d["comm_bytes_per_step"]  # the syncs (the start is apart)
        assert one["comm_bytes_per_step"] == d["comm_bytes_per_step"]
        assert two["comm_bytes_per_step"] == d["comm_bytes_per_step"] / 2


def test_the_bytes_are_the_planners(runs):
    grads = sum(p.numel() * p.element_size() for p in model().parameters())
    cluster = ClusterSpec(devices_per_node=2, nodes=2)
    four = runs["diloco R=4 H=2 adamw"].stats[0]  # 3 syncs of 4 replicas of one rank
    assert four["comm_by_name"]["diloco"] == 3 * sync_collective(grads, 4, 1, cluster).bytes_sent
    two = runs["diloco R=2 H=3 adamw"].stats[0]  # 2 syncs of 2 replicas of 2 ranks
    assert two["comm_by_name"]["diloco"] == 2 * sync_collective(grads, 2, 2, cluster).bytes_sent
    assert sync_collective(grads, 4, 1, cluster).bytes_sent == bytes_sent("all_reduce", grads, 4)  # DDP's on 4
    for name, quantize in (("stream F=2 H=4 d=0 a=0 R=4", None), ("stream bf16 F=2 H=4 d=0 a=0 R=4", "bf16")):
        one = sync_collective(EVEN_BYTES, 4, 1, cluster, fragments=2, quantize=quantize, itemsize=8).bytes_sent
        assert {r["diloco/sync_bytes"] for r in runs[name].metrics if "diloco/sync_bytes" in r} == {one}


def test_inner_ddp_traffic_stays_inside_the_replica(runs):
    grads = sum(p.numel() * p.element_size() for p in model().parameters())
    for s in runs["diloco R=2 H=3 adamw"].stats:  # 2 replicas of 2 ranks, 7 steps, 2 syncs
        assert s["comm_by_name"]["diloco"] == 2 * grads  # ring all-reduce over 2: 2 (n-1)/n of the model
        start = grads if s["rank"] % 2 == 0 else 0  # the inner DDP's broadcast, sent by each replica's first rank
        assert s["comm_by_group"]["dp"] == start + 7 * grads  # then one all-reduce a step, inside the replica


# ---- Streaming DiLoCo: fragments, delay, alpha; a sync's bytes; quantized means -----------------------------
@pytest.mark.parametrize("name, replicas, sync_every, steps, data_ranks, fragments, delay, alpha, even", [
    ("stream F=2 H=4 d=0 a=0 R=4", 4, 4, 8, 1, 2, 0, 0.0, True),
    ("stream F=2 H=4 d=1 a=0.5 R=2", 2, 4, 8, 2, 2, 1, 0.5, True),  # ends with fragment 1's sync in flight
    ("stream F=4 H=8 d=1 a=0 R=4", 4, 8, 10, 1, 4, 1, 0.0, True),  # ends with fragment 0's in flight
    ("stream F=2 H=2 d=0 a=0.5 R=4 uneven", 4, 2, 5, 1, 2, 0, 0.5, False),
])
def test_streaming_equals_the_papers_algorithm(runs, name, replicas, sync_every, steps, data_ranks, fragments,
                                               delay, alpha, even):
    shape = {"make": even_model, "loss_fn": even_loss} if even else {}
    ref = paper(replicas, sync_every, steps, data_ranks, fragments=fragments, delay=delay, alpha=alpha, **shape)
    assert_same_run(ref, runs[name])


def test_a_sync_sends_one_fragment(runs):
    ring = 2 * 3 / 4  # the ring all-reduce's factor over 4 replicas
    rows = runs["stream F=2 H=4 d=0 a=0 R=4"].metrics  # syncs after steps 2, 4, 6, 8: fragments 0, 1, 0, 1
    assert [r["step"] for r in rows if "diloco/sync_bytes" in r] == [1, 3, 5, 7]
    assert {r["diloco/sync_bytes"] for r in rows if "diloco/sync_bytes" in r} == {ring * EVEN_BYTES / 2}
    assert runs["stream F=2 H=4 d=0 a=0 R=4"].stats[0]["comm_by_name"]["diloco"] == 4 * ring * EVEN_BYTES / 2
    uneven = [r["diloco/sync_bytes"] for r in runs["stream F=2 H=2 d=0 a=0.5 R=4 uneven"].metrics
              if "diloco/sync_bytes" in r]
    assert uneven == [ring * 48 * 8, ring * 26 * 8] * 2 + [ring * 48 * 8]  # Linear(6, 8).weight; the rest
    assert max(uneven) == ring * 48 * 8  # the peak: the largest fragment


def test_a_bf16_sync_sends_a_quarter_of_the_float64_bytes(runs):
    plain, bf16 = runs["stream F=2 H=4 d=0 a=0 R=4"], runs["stream bf16 F=2 H=4 d=0 a=0 R=4"]
    sent = [r["diloco/sync_bytes"] for r in bf16.metrics if "diloco/sync_bytes" in r]
    assert sent == [2 * 3 / 4 * EVEN_BYTES / 2 / 4] * 4
    assert bf16.stats[0]["comm_by_name"]["diloco"] == plain.stats[0]["comm_by_name"]["diloco"] / 4
    # The same run but for the rounding of its means: close, not equal.
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(plain.losses), rtol=1e-2, atol=0)
    assert bf16.losses != plain.losses


U = 2.0 ** -8  # bfloat16's unit roundoff


@pytest.mark.parametrize("tensors", [1, 2])
def test_quantized_means_are_within_their_bound_and_send_their_bits(runs, tensors):
    every = runs["every rank's means"]
    inputs = [torch.cat(_inputs(r)[:tensors]) for r in range(4)]
    exact = sum(inputs) / 4
    numel = exact.numel()  # 1024 (no padding), or 1032 (padded to 1040 for bf16, to 1280 for int8)
    plain, _ = every[0][None, tensors]
    torch.testing.assert_close(torch.cat(plain), exact, rtol=1e-12, atol=0)
    for quantize, pad, element in (("bf16", 4, 2), ("int8", 256, 1 + 4 / 64)):
        got, sent = every[0][quantize, tensors]
        got = torch.cat(got)
        for r in range(1, 4):  # every rank holds the same values
            assert torch.equal(torch.cat(every[r][quantize, tensors][0]), got)
            assert every[r][quantize, tensors][1] == sent
        padded = -(-numel // pad) * pad
        assert sent == 2 * 3 / 4 * padded * element  # an all-to-all and an all-gather, (N-1)/N each
        if quantize == "bf16":
            bound = (2 * U + U * U) * sum(x.abs() for x in inputs) / 4
        else:  # each element's block of 64 (in the padded buffer), its largest magnitude on each rank
            tops = [torch.nn.functional.pad(x, (0, padded - numel)).reshape(-1, 64).abs().amax(1)
                    .repeat_interleave(64)[:numel] for x in inputs]
            bound = (1 + 1 / 508) * (1 + 2.0 ** -23) / 127 * sum(tops) / 4
        err = (got - exact).abs()
        assert bool((err <= bound * (1 + 1e-9)).all()), float((err - bound).max())
        assert float(err.max()) > 0  # it did round
    _, plain_sent = every[0][None, 1]
    assert every[0]["bf16", 1][1] == plain_sent / 4  # float64 -> bf16: a quarter of the bytes


def test_a_quantization_that_cannot_run_raises():
    half = [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError) as e:
        OuterLoop(half, PLAIN_OUTER, Comm(None, CommStats()), 2, streaming=Streaming(quantize="bf16"))
    assert str(e.value) == ("DiLoCo quantize='bf16' cannot shrink torch.bfloat16 tensors (16 bits an element); "
                            "use quantize=None or a narrower encoding")
    with pytest.raises(ValueError) as e:
        start_mean(Comm(None, CommStats()), [torch.zeros(4, dtype=torch.int64)], "q", "int8")
    assert str(e.value) == "quantize='int8' cannot quantize torch.int64 tensors (floating point only)"


# ---- bad input, refused before anything starts ---------------------------------------------------------
def test_bad_input_is_refused_before_start():
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.DiLoCo(replicas=3), 4, accelerator="cpu")
    assert str(e.value) == ("DiLoCo replicas=3 must divide the devices (4): each replica is a block of "
                            "devices / replicas consecutive ranks")
    with pytest.raises(ValueError) as e:
        sw.DiLoCo(sync_every=0)
    assert str(e.value) == "DiLoCo sync_every=0: must be an integer >= 1 (the inner steps between two syncs)"
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.DiLoCo(replicas=2), 4, accelerator="cpu", progress=False).fit(
            model(), dataset(), LOSS, SGD, batch_size=6, max_steps=1)
    assert str(e.value) == ("batch_size=6 is not divisible by data-parallel size 4 x accumulate_grad_batches 1 = 4; "
                            "the global batch must split evenly (try batch_size=4)")


def test_bad_streaming_settings_are_refused_before_start():
    for kwargs, message in [
        ({"fragments": 0}, ("DiLoCo fragments=0: must be an integer >= 1 (the pieces of the model synced at their "
                            "own offsets)")),
        ({"sync_every": 10, "fragments": 3}, ("DiLoCo sync_every=10 must be divisible by fragments=3: fragment p "
                                              "syncs after inner step (p + 1) x sync_every / fragments of every "
                                              "cycle")),
        ({"sync_every": 8, "fragments": 2, "delay": 4}, ("DiLoCo delay=4 must be an integer in [0, sync_every / "
                                                         "fragments = 4): a fragment's sync lands before the next "
                                                         "fragment's starts, so at most one is in flight")),
        ({"alpha": 1.5}, ("DiLoCo alpha=1.5 must be a number in [0, 1] (the local weights' share after a "
                          "fragment's sync)")),
        ({"quantize": "fp8"}, "DiLoCo quantize='fp8' must be None, 'bf16' or 'int8'"),
    ]:
        with pytest.raises(ValueError) as e:
            sw.DiLoCo(**{"sync_every": 4, **kwargs})
        assert str(e.value) == message
