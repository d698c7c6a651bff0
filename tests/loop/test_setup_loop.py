"""Hand-written loops on `sw.setup`: the full state dict, global clipping, checkpoints
across layouts, data and metrics, from plain python and under `shardwise run`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_same_run, once_per_run
from loop_script import MAX_NORM, reference, train

import shardwise as sw
from shardwise import launch
from shardwise.precision import default_dtype_name

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


class Run:
    def __init__(self, state, losses):
        self.state_dict, self.losses = state, losses


def same(ref, state, losses):
    assert_same_run(Run(ref[0], ref[1]), Run(state, losses))


@pytest.fixture(scope="module")
def single():
    return reference(STEPS)


def _rank(rank, device, strategy, steps, out, start_dir, save_dir, losses_out):
    losses = train(strategy, steps, out, start_dir, save_dir)
    if rank == 0:
        torch.save(losses, losses_out)


def spawn_loop(tmp_path, strategy, steps=STEPS, start_dir=None, save_dir=None, nprocs=2):
    out, losses = str(tmp_path / f"{strategy}.pt"), str(tmp_path / f"{strategy}.losses")
    launch.spawn(_rank, nprocs, args=(strategy, steps, out, start_dir, save_dir, losses))
    return torch.load(out, weights_only=True), torch.load(losses, weights_only=True)


# Each strategy's loop equal to one device, and its full state dict, is tests/test_loop_idioms.py's table.


TORCH_ROWS = ["ddp", "zero1", "fsdp", "tp", "pp"]


def _torch_rows(rank, device, folder):
    """The loop under torch's engines (DDP, ZeroRedundancyOptimizer, FSDP2, parallelize_module, pipelining), one
    launch; then a save under torch's FSDP2 resumed by our tp."""
    runs = {}
    for strategy in TORCH_ROWS:
        runs[strategy] = train(strategy, STEPS, os.path.join(folder, f"{strategy}.pt"), engine="torch")
    ck = os.path.join(folder, "ck")
    train("fsdp", 2, save_dir=ck, engine="torch")
    runs["fsdp torch -> tp"] = train("tp", STEPS, os.path.join(folder, "fsdp torch -> tp.pt"), start_dir=ck)
    if rank == 0:
        torch.save(runs, os.path.join(folder, "losses.pt"))


def test_the_loop_under_torch_s_engines_equals_single_and_resumes_under_ours(tmp_path, single):
    launch.spawn(_torch_rows, 2, args=(str(tmp_path),))
    runs = torch.load(tmp_path / "losses.pt", weights_only=True)
    assert list(runs) == [*TORCH_ROWS, "fsdp torch -> tp"]
    for name, losses in runs.items():
        state = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        resumed = name.endswith("-> tp")
        same((single[0], single[1][2:] if resumed else single[1]), state, losses)


def test_save_and_load_resume_the_loop_under_another_layout(tmp_path):
    ck = str(tmp_path / "ck")
    spawn_loop(tmp_path, "zero3", steps=3, save_dir=ck)
    state, losses = spawn_loop(tmp_path, "tp", steps=6, start_dir=ck)
    ref_state, ref_losses = reference(6)
    same((ref_state, ref_losses[3:]), state, losses)


def shardwise_run(runs):
    """One `shardwise run --nproc 2` of the loop script doing ``runs`` in turn, in the same ranks (a new group
    each, as a script with several loops would): each ``(strategy, steps, out, *flags)``."""
    argv: list[str] = []
    for strategy, steps, out, *flags in runs:
        argv += [*(["++"] if argv else []), "--strategy", strategy, "--steps", str(steps), "--out", str(out),
                 *map(str, flags), "--dtype", default_dtype_name()]
    return subprocess.run([sys.executable, "-m", "shardwise", "run", "--nproc", "2", "tests/loop_script.py", *argv],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/tests"}, capture_output=True,
                          text=True, timeout=300)


def close_to(state, ref):
    assert set(state) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6 + 1e-5 * float(v.abs().max()), msg=k)


# Each strategy's loop equal to one device is tests/loop/test_loop_idioms.py's table; here the launcher's path: a
# strategy whose ranks once aborted at exit (zero2), and one whose ranks hold different stages (pp).
UNDER_RUN = ["zero2", "pp"]


@pytest.fixture(scope="module")
def under_shardwise_run(tmp_path_factory):
    """One `shardwise run` launch runs the loop under every strategy of UNDER_RUN in turn, then 3 steps under
    fsdp that save and a resume of them under pp to step 6: the launcher's and the ranks' start-up are paid
    once. Each case reads its own output file, so a failure reads as the case it happened in."""
    return once_per_run("setup-loop-under-run", tmp_path_factory, lambda: _launch(tmp_path_factory))


def _launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("under_run")
    ck = folder / "ck"
    r = shardwise_run([(",".join(UNDER_RUN), STEPS, folder / "{strategy}.pt"),
                       ("fsdp", 3, folder / "resume-saved.pt", "--save-dir", ck),
                       ("pp", 6, folder / "resume-loaded.pt", "--start-dir", ck)])
    return folder, r


def written(under_shardwise_run, name):
    """The state rank 0 wrote for one case; fails with the launch's exit code and errors if it never came."""
    folder, r = under_shardwise_run
    assert "terminate called" not in r.stderr  # the abort at exit once seen under zero2
    path = folder / name
    assert path.exists(), f"{name} was not written (exit code {r.returncode}):\n{r.stderr[-3000:]}"
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(360)
@pytest.mark.fresh_processes
@pytest.mark.parametrize("strategy", UNDER_RUN)
def test_under_shardwise_run_the_loop_exits_0_and_equals_single(under_shardwise_run, single, strategy):
    close_to(written(under_shardwise_run, f"{strategy}.pt"), single[0])


@pytest.mark.timeout(360)
@pytest.mark.fresh_processes
def test_under_shardwise_run_save_and_load_resume_under_another_layout(under_shardwise_run):
    written(under_shardwise_run, "resume-saved.pt")
    close_to(written(under_shardwise_run, "resume-loaded.pt"), reference(6)[0])
    r = under_shardwise_run[1]
    assert r.returncode == 0, r.stderr[-3000:]  # the last run: the launch as a whole ended well


PLAIN = """import torch, torch.distributed as dist
import shardwise as sw
from loop_script import train, reference
losses = train("ddp", 3)
ref = reference(3)[1]
print(dist.is_initialized(), dist.get_world_size(), all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref)))
"""


@pytest.mark.fresh_processes
def test_sw_init_from_plain_python_is_a_group_of_one():
    r = subprocess.run([sys.executable, "-c", PLAIN], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/tests"}, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True 1 True"


def _clip_refused(rank, device):
    from shardwise.workloads import digits

    work = digits()
    model, opt = sw.setup(work.make_model(), torch.optim.SGD.__call__ and __import__("functools").partial(
        torch.optim.SGD, lr=0.1), strategy="fsdp", accelerator="cpu")
    x, y = work.train[0]
    work.loss_fn(model(x.unsqueeze(0)), y.unsqueeze(0)).backward()
    first = list(model.parameters())[:1]
    try:
        torch.nn.utils.clip_grad_norm_(first, MAX_NORM)
    except RuntimeError as e:
        assert str(e).startswith("torch.nn.utils.clip_grad_norm_ on some parameters of a model from sw.setup"), e
        assert str(e).endswith("use sw.clip_grad_norm_(model, max_norm)"), e
    else:
        raise AssertionError("a partial clip of a sharded model was not refused")


def test_torch_clip_on_part_of_a_sharded_model_is_refused_with_the_fix():
    launch.spawn(_clip_refused, 2)


def _data_and_metrics(rank, device, out):
    from torch.utils.data import TensorDataset

    sw.init(accelerator="cpu")
    data = TensorDataset(torch.arange(16.0))
    loader = sw.prepare_dataloader(data, batch_size=8, shuffle=False)
    mine = [b[0].tolist() for b in loader]
    everyone = sw.gather(torch.tensor(mine))  # (ranks, steps, local batch)
    mean = sw.all_reduce_mean(torch.tensor([float(rank)]))
    if rank == 0:
        torch.save({"batches": everyone, "mean": mean}, out)


def test_prepare_dataloader_splits_each_global_batch_and_gather_sees_every_rank(tmp_path):
    out = str(tmp_path / "d.pt")
    launch.spawn(_data_and_metrics, 2, args=(out,))
    got = torch.load(out, weights_only=True)
    # Step s: the global batch 8s..8s+7, rank r holding its positions r, r+2, ...
    assert got["batches"].tolist() == [[[0, 2, 4, 6], [8, 10, 12, 14]], [[1, 3, 5, 7], [9, 11, 13, 15]]]
    assert got["mean"].tolist() == [0.5]


def test_setup_refuses_a_parameter_server():
    with pytest.raises(ValueError, match=r"^strategy 'ps' cannot run in a hand-written loop: its server ranks hold "
                                         r"no model replica"):
        sw.setup(torch.nn.Linear(2, 2), torch.optim.SGD, strategy="ps")


def test_a_built_optimizer_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"^optimizer_fn must be a factory that builds the optimizer from parameters "
                                        r"\(each rank builds its own, over the parameters it holds\), e\.g\. "):
        sw.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="single")
