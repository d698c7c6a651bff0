"""Shared test helpers: every distributed test runs real gloo processes on CPU.

Ranks run on a session-wide :class:`shardwise.pool.WorkerPool`: the same
processes serve every test (each test still gets a fresh store and process
group), so torch and transformers are imported once per rank, not once per
test. A test that needs a clean interpreter in every rank is marked
``@pytest.mark.fresh_processes`` and gets ``launch.spawn``'s fresh processes;
``SHARDWISE_TEST_POOL=0`` turns the pool off for the whole run.
"""
from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise import launch
from shardwise.ft import supervise
from shardwise.loggers import sqlite_uri
from shardwise.pool import PRELOAD, KeptRanks, WorkerPool

# Tests run ranks as processes on a small machine: one thread each keeps them
# from fighting over cores (the library divides cores itself; this only makes
# the single-process reference runs cheap too).
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# "The same maths" is claimed in float64 (the ``float64`` marker): float32 rounding, amplified by Adam on
# weights whose gradient is near zero, moved single elements past 1e-5 on some CPUs and not on others, so
# the CPU's summation order decided those tests. In float64 the same runs differ by about 1e-13 relative
# (measured), so a tolerance of 1e-9 cannot be crossed by rounding yet
# catches any real difference (a dropped micro-batch or an unreduced bucket moves weights by 1e-3 or more).
FLOAT64_RTOL, FLOAT64_ATOL = 1e-9, 1e-12


def assert_same_run(ref, run, rtol: float | None = None, atol: float | None = None) -> None:
    """Losses of every step equal within rtol; every final weight within rtol of its tensor's scale.

    Weights are compared with an absolute tolerance of ``rtol * max|w|`` per
    tensor (see shardwise.commands.verify.compare for why element-wise relative error
    is meaningless for near-zero weights under Adam). The default tolerance
    follows the reference's dtype: 1e-5 in float32, ``FLOAT64_RTOL`` in float64.
    """
    wide = any(t.dtype == torch.float64 for t in ref.state_dict.values())
    rtol = rtol if rtol is not None else (FLOAT64_RTOL if wide else 1e-5)
    atol = atol if atol is not None else (FLOAT64_ATOL if wide else 1e-6)
    assert len(ref.losses) == len(run.losses)
    _report(ref, run, rtol, atol)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    assert set(ref.state_dict) == set(run.state_dict)
    for k, a in ref.state_dict.items():
        b = run.state_dict[k]
        scale = float(a.abs().max()) if a.numel() and a.is_floating_point() else 0.0
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol + rtol * scale, msg=lambda m: f"{k}: {m}")


# ---- ours beside torch's: one rank function trains both on the same batches, the test compares the weights ---
def train_beside_torch(rank: int, steps: int, classes: int, path: str, ours: tuple, theirs: tuple) -> None:
    """Train ``ours`` and ``theirs``, each ``(model as called, its optimizer, the plain module inside)``, on the
    same seeded batches of this rank (8 rows of 16 features, ``classes`` targets, cross-entropy); rank 0 saves
    both plain modules' weights to ``path`` for :func:`assert_beside_torch`."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, classes, (8,), generator=g)
        for model, opt, _ in (ours, theirs):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        torch.save({"ours": ours[2].state_dict(), "torch": theirs[2].state_dict()}, path)


def assert_beside_torch(path: str) -> None:
    """The weights :func:`train_beside_torch` saved: ours equal torch's to float32 rounding."""
    w = torch.load(path)
    for k in w["torch"]:
        torch.testing.assert_close(w["ours"][k], w["torch"][k], rtol=1e-5, atol=1e-6)


# Under ``make test``'s two workers (pytest-xdist hands out tests in collection order) the last tests decide when
# the run ends: the modules that take longest (``make test-budget`` names them) run first, so that the end is made
# of short tests that even the workers out. Their own order, and every other module's, is unchanged.
SLOW_FIRST = (
    "tests/parallel/pp/test_zero_bubble.py",
    "tests/system/test_elastic.py",
    "tests/checkpoint/test_checkpoint_layouts.py",
    "tests/system/test_examples_everywhere.py",
    "tests/system/test_fail_fast.py",
    "tests/parallel/cp/test_context_parallel.py",
    "tests/parallel/ps/test_ps.py",
    "tests/comm/test_faults.py",
    "tests/parallel/test_compile.py",
    "tests/loop/test_setup_loop.py",
    "tests/fit/test_main_guard.py",
    "tests/parallel/test_expert_parallel.py",
    "tests/strategies/torch_engine/test_torch_engine_pp_compose.py",
    "tests/strategies/torch_engine/test_torch_engine.py",
    "tests/strategies/test_diloco.py",
    "tests/loop/test_loop_state.py",
    "tests/loop/test_loop_idioms.py",
)


def pytest_collection_modifyitems(items):
    first = {module: i for i, module in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(SLOW_FIRST)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Tests marked ``float64`` build their models and data in double: the default dtype is float64 from
    before their fixtures (module-scoped references included) until after their teardown, and the ranks
    they start get it too (the pool and launch.spawn pass the caller's). A test of a module marked
    ``float64`` whose claim is about float32 itself (byte counts, dtype names in a message) is marked
    ``float32``; the marker closest to the test wins."""
    closest = next((m.name for m in item.iter_markers() if m.name in ("float64", "float32")), "float32")
    torch.set_default_dtype(torch.float64 if closest == "float64" else torch.float32)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    torch.set_default_dtype(torch.float32)


def _report(ref, run, rtol: float, atol: float) -> None:
    """With SHARDWISE_TEST_DIFFS=path, append the run's largest loss and weight differences, in units of
    the tolerance assert_same_run applies, to that file: how its tolerances were measured."""
    path = os.environ.get("SHARDWISE_TEST_DIFFS")
    if not path:
        return
    loss = max((abs(a - b) / (atol + rtol * abs(a)) for a, b in zip(ref.losses, run.losses)), default=0.0)
    weight = max((float((run.state_dict[k].to(a.dtype) - a).abs().max()) / (atol + rtol * float(a.abs().max()))
                  for k, a in ref.state_dict.items() if a.is_floating_point() and a.numel()), default=0.0)
    dtype = next((str(a.dtype) for a in ref.state_dict.values() if a.is_floating_point()), "-")
    with open(path, "a") as f:
        f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {dtype} rtol={rtol:g} "
                f"loss={loss:.3g} weight={weight:.3g}\n")


@pytest.fixture
def same_run():
    return assert_same_run


class Spawned(Exception):
    """Raised instead of starting worker processes under the ``no_spawn`` fixture."""


@pytest.fixture
def no_spawn(monkeypatch):
    """Make starting worker processes an error, for checks that must fire before any process starts.

    Yields the exception class, so a test can expect the spawn attempt itself.
    """
    def spawn(*args, **kwargs):
        raise Spawned("processes were started")
    monkeypatch.setattr(launch, "spawn", spawn)
    return Spawned


# The pool's fork server also imports the Hugging Face models the tests build (1.8 s per interpreter): every
# worker that replaces one retired by a failing job would otherwise import them again at its first HF test.
HF_MODULES = ("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
              "transformers.models.bert.modeling_bert")


@pytest.fixture(scope="session")
def worker_pool():
    with WorkerPool(8, preload=PRELOAD + HF_MODULES) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _ranks_from_the_pool(request, monkeypatch):
    """Route every ``launch.spawn`` of this test to the session's pool, and start a fault-tolerant run's ranks from
    the pool's fork server (new processes that do not import torch again), unless marked ``fresh_processes``.
    A Trainer's kept ranks (shardwise.pool.KeptRanks) start through ``launch.spawn`` too, so each test's calls run
    where that test sends them (tests/fit/test_kept_ranks.py runs the kept ranks themselves, in a script)."""
    monkeypatch.setattr(KeptRanks, "spawn", lambda self, *args, **kwargs: launch.spawn(*args, **kwargs))
    if request.node.get_closest_marker("fresh_processes") or os.environ.get("SHARDWISE_TEST_POOL") == "0":
        return
    pool = request.getfixturevalue("worker_pool")
    monkeypatch.setattr(launch, "spawn", pool.spawn)
    monkeypatch.setattr(supervise, "rank_context", lambda: pool.context)


# ---- once per pytest run, whatever the number of xdist workers ---------------------------------------------
def once_per_run(name: str, tmp_path_factory: Any, make: Callable[[], Any]) -> Any:
    """``make()``'s value, computed by the first xdist worker that asks and read back (pickled) by the others.

    A session or module fixture runs once in each worker that runs one of its tests, and ``--dist load`` hands a
    module's tests to both workers: without this, a fixture that launches ranks for half a minute ran twice.
    The workers share the parent of their base temporary folders; the lock makes the second wait for the first
    (on a machine whose cores the first already fills, waiting costs nothing)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    path = tmp_path_factory.getbasetemp().parent / f"once-{name}.pickle"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value


def mlflow_db(tmp_path_factory: Any, folder: Any) -> str:
    """The tracking URI of a new, empty MLflow database in ``folder``: a copy of one made once per pytest run.
    Creating MLflow's schema takes 1.6 s on a quiet machine and up to 11 s under the suite's load; copying the
    file takes milliseconds."""
    def make() -> str:
        from mlflow.tracking import MlflowClient

        template = str(tmp_path_factory.mktemp("mlflow-template") / "mlflow.db")
        MlflowClient(sqlite_uri(template)).search_experiments()  # creates the schema
        return template
    path = os.path.join(folder, "mlflow.db")
    shutil.copyfile(once_per_run("mlflow-template", tmp_path_factory, make), path)
    return sqlite_uri(path)


# ---- one `shardwise run --nproc 2` for the tests that only need a script to run under torchrun -----------------
# tests/scripts/each_strategy.py runs each script in turn in the same two ranks (a new group each, as a script with
# several trainings would), so the launcher's and the ranks' start-up (torch, a few seconds of CPU per process) is
# paid once for all of them. (script, strategy or "-" for no --strategy flag, its flags); "{out}" is the launch's
# output folder. A script that fails the job on purpose (tests/system/test_fail_fast.py) or needs restarts
# (tests/system/test_elastic.py) launches alone.
UNDER_RUN = (("examples/digits.py", "ddp", ("--steps", "6", "--out", "{out}/losses.json")),
             ("examples/setup_loop.py", "ddp", ("--epochs", "2")),
             ("examples/configured.py", "-", ("--config", "examples/configured.yaml", "--trainer.strategy", "zero3",
                                              "--fit.max_steps", "6", "--trainer.checkpoint_dir", "{out}/configured",
                                              "--out", "{out}/configured.json")),
             ("tests/scripts/fit_auto.py", "-", ()),
             ("tests/scripts/listening_probe.py", "-", ()))


@pytest.fixture(scope="session")
def under_run(tmp_path_factory):
    """``(CompletedProcess, output folder)`` of the shared launch of :data:`UNDER_RUN`, once per pytest run."""
    return once_per_run("under_run", tmp_path_factory, lambda: _launch_under_run(tmp_path_factory))


def _launch_under_run(tmp_path_factory):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("under_run")
    argv: list[str] = []
    for script, strategy, flags in UNDER_RUN:
        argv += [*(["++"] if argv else []), script, strategy, "--", *(f.format(out=out) for f in flags)]
    r = subprocess.run([sys.executable, "-m", "shardwise", "run", "--nproc", "2", "tests/scripts/each_strategy.py",
                        *argv], cwd=root, env={**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=400)
    return r, out


def section(r, script: str) -> str:
    """What rank 0 printed while ``script`` ran in :func:`under_run`; fails naming it if it did not finish."""
    strategy = next(s for name, s, _ in UNDER_RUN if name == script)
    begin, end = f"each_strategy: {script} {strategy} starts", f"each_strategy: {script} {strategy} ok"
    assert begin in r.stdout and end in r.stdout, (
        f"{script} did not finish under shardwise run (exit code {r.returncode}):\n" + r.stdout[-2000:]
        + r.stderr[-3000:])
    return r.stdout.split(begin, 1)[1].split(end, 1)[0]
