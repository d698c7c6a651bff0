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
from conftest import assert_same_run
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.data import as_source
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


def diloco(inner="ddp", replicas=2, sync_every=3, outer=None):
    return sw.DiLoCo(inner, replicas=replicas, sync_every=sync_every, outer_optimizer=outer)


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
}


def _fit(strategy, optimizer, steps, checkpoint_dir=None, **options):
    trainer = sw.Trainer(strategy, 4, accelerator="cpu", progress=False, checkpoint_dir=checkpoint_dir, **options)
    result = trainer.fit(model(), dataset(), LOSS, optimizer, batch_size=BATCH, max_steps=steps)
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
    for name, (strategy, optimizer, steps, options) in SCENARIOS.items():
        where = {"checkpoint_dir": os.path.join(tmp, "ckpt")} if name.startswith("resume") else {}
        if "log_every_n_steps" in options:
            where["metrics_path"] = os.path.join(tmp, "metrics.jsonl")
        runs[name] = _fit(strategy, optimizer, steps, **where, **options)
        if rank == 0:
            print(f"diloco scenario ok: {name}", flush=True)
    runs["sw.setup loop"] = _loop(rank)
    if rank == 0:
        torch.save({k: vars(v) for k, v in runs.items()}, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diloco")
    out = str(tmp / "runs.pt")
    launch.spawn(_rank, 4, args=(out, str(tmp)))
    runs = {k: Run(**v) for k, v in torch.load(out, weights_only=False).items()}
    runs["metrics"] = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return runs


# ---- the paper's algorithm, written out in one process (Douillard et al. 2023, Algorithm 1) ----------
def paper(replicas, sync_every, steps, data_ranks=1, inner=ADAMW, outer=None):
    """R replicas in a loop: each its own inner optimizer on its own samples (the shares of the job's
    data-parallel ranks r*D .. r*D + D - 1); every H steps θ.grad = mean_r(θ - θ_r), an outer step, restart."""
    global_model = model()
    local = [copy.deepcopy(global_model) for _ in range(replicas)]
    inners = [inner(m.parameters()) for m in local]
    outer_opt = (outer or functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))(
        global_model.parameters())
    source, shards = as_source(dataset()), replicas * data_ranks
    reads = [[source.train_batches(BATCH, shards, r * data_ranks + d, seed=0, start=0, stop=steps)
              for d in range(data_ranks)] for r in range(replicas)]
    losses, norms = [], []
    for step in range(steps):
        step_losses = []
        for r in range(replicas):
            parts = [b.batch(step, torch.device("cpu")) for b in reads[r]]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = LOSS(local[r](x), y)
            inners[r].zero_grad()
            loss.backward()
            inners[r].step()
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / replicas)
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for i, theta in enumerate(global_model.parameters()):
                    theta.grad = sum(theta - list(m.parameters())[i] for m in local) / replicas
                norms.append(float(torch.cat([t.grad.reshape(-1) for t in global_model.parameters()]).norm()))
            outer_opt.step()
            outer_opt.zero_grad()
            for m in local:
                m.load_state_dict(global_model.state_dict())
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


def test_inner_ddp_traffic_stays_inside_the_replica(runs):
    grads = sum(p.numel() * p.element_size() for p in model().parameters())
    for s in runs["diloco R=2 H=3 adamw"].stats:  # 2 replicas of 2 ranks, 7 steps, 2 syncs
        assert s["comm_by_name"]["diloco"] == 2 * grads  # ring all-reduce over 2: 2 (n-1)/n of the model
        start = grads if s["rank"] % 2 == 0 else 0  # the inner DDP's broadcast, sent by each replica's first rank
        assert s["comm_by_group"]["dp"] == start + 7 * grads  # then one all-reduce a step, inside the replica


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
