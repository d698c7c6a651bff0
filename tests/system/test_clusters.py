"""srun and mpirun form one job, as torchrun does: detection, SLURM host lists and ports, `shardwise run`'s
arguments inside an allocation, and real two-process jobs described only by SLURM's or Open MPI's variables."""
from __future__ import annotations

import json
import os
import random
import runpy
import socket
import subprocess
import sys
import time

import pytest
import torch

from shardwise import cluster, launch
from shardwise.cli import torchrun_args
from shardwise.cluster import (
    ClusterEnv,
    ClusterError,
    detect,
    expand_hostlist,
    slurm_port,
)

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What srun sets in each task of `srun -N2 --ntasks-per-node=4 python train.py` (task 5: node 1, local 1).
SRUN = {"SLURM_JOB_ID": "123456", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"}


# ---- SLURM host lists and ports ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("n1,n2", ["n1", "n2"]),
    ("localhost", ["localhost"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("node[08-10]", ["node08", "node09", "node10"]),  # the padding of the first bound, across a digit more
    ("c[1-2]-r[01-02]", ["c1-r01", "c1-r02", "c2-r01", "c2-r02"]),
    ("x[7]", ["x7"]),
    (" a[1-2] , b ", ["a1", "a2", "b"]),
])
def test_slurm_host_lists_expand_in_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "node[[1]]", ""])
def test_malformed_host_lists_are_refused(text):
    with pytest.raises(ClusterError):
        expand_hostlist(text)


def test_slurm_task_counts_expand():
    assert cluster.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert cluster.expand_counts("8") == [8]


def test_the_slurm_port_is_the_documented_formula():
    for job in (0, 1, 19999, 20000, 123456, 98765432):
        assert slurm_port(job) == 10000 + job % 20000
        assert slurm_port(str(job)) == slurm_port(job)  # every task reads the id as text: the same port
    assert slurm_port("123456") == 13456
    assert all(10000 <= slurm_port(j) < 30000 for j in range(0, 200000, 997))
    assert slurm_port("abc") == slurm_port("abc")  # not a number: still the same on every task
    assert slurm_port(None) == 29500


# ---- detection --------------------------------------------------------------------------------------------

def test_srun_task_is_detected():
    assert detect(SRUN) == ClusterEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="gpu07",
                                      master_port=13456, source="slurm")


def test_the_step_wins_over_the_job_and_exports_win_over_both():
    env = {**SRUN, "SLURM_STEP_NODELIST": "gpu08", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8",
           "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    job = detect(env)
    assert (job.world_size, job.master_addr, job.local_world_size) == (4, "gpu08", 4)
    job = detect({**env, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "40000"})
    assert (job.master_addr, job.master_port) == ("10.0.0.9", 40000)


def test_uneven_slurm_nodes_give_each_node_its_count():
    env = {**SRUN, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1",
           "SLURM_PROCID": "3", "SLURM_LOCALID": "0"}
    assert detect(env).local_world_size == 1
    assert detect({**env, "SLURM_NODEID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "2"}).local_world_size == 3


def test_torchrun_variables_win():
    # `shardwise run` inside an srun step: its workers inherit the step's variables, torchrun's describe them.
    env = {**SRUN, "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "gpu07", "MASTER_PORT": "29400", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert detect(env) == ClusterEnv(rank=11, world_size=16, local_rank=3, local_world_size=8, master_addr="gpu07",
                                     master_port=29400, source="torchrun")
    # Incomplete torchrun variables are no job, as before, and no scheduler's variables fill them in.
    assert detect({**SRUN, "RANK": "0", "WORLD_SIZE": "2"}) is None


def test_a_world_of_one_is_not_a_job():
    one = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert detect(one) is None  # `srun -n1 python train.py`: trains (and spawns its ranks) as a plain python
    mpi_one = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    # mpirun -n 1 inside a batch script: the innermost launcher decides, not the srun step around it.
    assert detect({**SRUN, **mpi_one}) is None
    assert detect({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}).world_size == 1


def test_the_batch_script_itself_is_not_rank_0():
    # sbatch's own shell has SLURM_PROCID=0 and the allocation's task count, but no srun step: it is one process.
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "8(x2)"}
    assert detect(batch) is None
    note = cluster.allocation_note(batch)
    assert note is not None and "not started by srun" in note and "srun python script.py" in note
    assert cluster.allocation_note(SRUN) is None
    assert cluster.allocation_note({}) is None
    assert cluster.allocation_note({**batch, "OMPI_COMM_WORLD_SIZE": "1"}) is None  # mpirun -n 1 in the script
    env = dict(batch)
    with pytest.warns(UserWarning, match="not started by srun"):
        assert launch.adopt_cluster_env(env) is None
    assert env == batch  # nothing exported: fit spawns its ranks on this node, as from a plain python


def test_mpi_wins_over_the_slurm_step_around_it():
    env = {**SRUN, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert detect(env) == ClusterEnv(rank=3, world_size=4, local_rank=3, local_world_size=4,
                                     master_addr="127.0.0.1", master_port=29500, source="openmpi")


def test_mpich_and_intel_mpi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "31000"}
    assert detect(env) == ClusterEnv(rank=1, world_size=2, local_rank=1, local_world_size=2,
                                     master_addr="127.0.0.1", master_port=31000, source="mpich")


def test_srun_with_pmi2_is_read_from_slurm():
    # `srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE without the local pair; srun's own variables have it.
    assert detect({**SRUN, "PMI_RANK": "5", "PMI_SIZE": "8"}).source == "slurm"


def test_mpi_on_several_nodes_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    with pytest.raises(ClusterError) as e:
        detect(env)
    assert str(e.value) == (
        "Open MPI's mpirun started 16 processes on more than one node (8 on this one), and MPI's variables do not "
        "say which host rank 0 is on: export MASTER_ADDR (the host of rank 0, e.g. `$(hostname)` of the first "
        "node) and MASTER_PORT (a free port there) to every process, e.g. `mpirun -x MASTER_ADDR=$(hostname) "
        "-x MASTER_PORT=29500 ...` (Open MPI) or `mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 "
        "...` (MPICH, Intel MPI)")
    job = detect({**env, "MASTER_ADDR": "node01", "MASTER_PORT": "29600"})
    assert (job.master_addr, job.master_port, job.local_world_size) == ("node01", 29600, 8)


def test_adopting_exports_torchrun_variables_once():
    env = dict(SRUN)
    job = launch.adopt_cluster_env(env)
    assert job is not None and job.source == "slurm"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "SHARDWISE_CLUSTER")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "13456", "SHARDWISE_CLUSTER": "slurm"}
    before = dict(env)
    assert launch.adopt_cluster_env(env) == job  # read back from the exported variables, the source kept
    assert env == before
    assert cluster.join_hint(env) == ("shardwise: this process is rank 5 of 8 of the job slurm's variables "
                                      "describe, rank 0's store at gpu07:13456: every rank must be started and "
                                      "reach that address (docs/clusters.md)")
    assert cluster.join_hint(SRUN) is None
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch.adopt_cluster_env(torchrun)
    assert torchrun == {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}


# ---- `shardwise run` inside an allocation ------------------------------------------------------------------

AGENT = {**SRUN, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}  # `srun --ntasks-per-node=1 shardwise run ...` on node 1 of 2


def test_run_on_several_nodes_of_an_allocation_meets_on_the_first():
    args, private = torchrun_args(["--nproc", "8", "train.py", "--lr", "1"], AGENT)
    assert not private
    # No --node-rank: the c10d rendezvous numbers nodes as they arrive (torchrun warns it ignores one).
    assert args == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:13456",
                    "--rdzv-id", "slurm-123456", "--rdzv-conf", "is_host=false",
                    "--nproc-per-node", "8", "train.py", "--lr", "1"]
    first, _ = torchrun_args(["--nproc=8", "train.py"], {**AGENT, "SLURM_PROCID": "0", "SLURM_NODEID": "0"})
    assert first[:2] == ["--nnodes", "2"] and first[-4:-2] == ["--rdzv-conf", "is_host=true"]
    exported, _ = torchrun_args(["train.py"], {**AGENT, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"})
    assert exported[exported.index("--rdzv-endpoint") + 1] == "10.1.2.3:29400"


@pytest.mark.parametrize("given", [["--nnodes", "2"], ["--nnodes=2"], ["--rdzv-endpoint", "h:1"],
                                   ["--rdzv_endpoint=h:1"], ["--master-addr", "h"], ["--node-rank", "1"]])
def test_run_keeps_the_users_rendezvous(given):
    argv = [*given, "--nproc", "2", "train.py"]
    assert torchrun_args(argv, AGENT) == ([*given, "--nproc-per-node", "2", "train.py"], False)


def test_run_on_one_node_stays_standalone():
    one = {**AGENT, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "gpu07"}
    assert torchrun_args(["--nproc", "8", "train.py"], one) == (["--nproc-per-node", "8", "train.py"], True)
    assert torchrun_args(["--standalone", "--nproc", "2", "t.py"], AGENT) == (["--nproc-per-node", "2", "t.py"], True)
    assert torchrun_args(["--nproc", "2", "t.py"], {}) == (["--nproc-per-node", "2", "t.py"], True)
    # The batch script itself (no srun step): one node, as before; _run says why on stderr.
    batch = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}
    assert torchrun_args(["--nproc", "2", "t.py"], batch) == (["--nproc-per-node", "2", "t.py"], True)


# ---- real jobs: two processes described only by a scheduler's variables ------------------------------------

SCRIPT = '''
import functools, json, os, sys

from shardwise.launch import die_with_parent

die_with_parent()  # a killed test leaves no rank behind

import torch
import torch.distributed as dist

import shardwise as sw


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g, dtype=torch.float64),
                                          torch.randn(32, 1, generator=g, dtype=torch.float64))
    return model, data


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


SGD = functools.partial(torch.optim.SGD, lr=0.1)
STEPS, BATCH = 3, 8


class Where(sw.Callback):
    """What each rank saw inside fit: the group, and its own share of each step's loss."""

    def __init__(self):
        self.world, self.rank, self.local = None, None, []

    def on_step_end(self, info):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.local.append(float(info.loss))


def fit():
    model, data = make()
    where = Where()
    result = sw.Trainer("ddp", accelerator="cpu", progress=False, callbacks=[where]).fit(
        model, data, loss_fn, SGD, batch_size=BATCH, max_steps=STEPS)
    return {"world": where.world, "rank": where.rank, "losses": result.losses, "local": where.local}


def loop():
    sw.init(accelerator="cpu")
    model, data = make()
    model, opt = sw.setup(model, SGD, strategy="ddp", accelerator="cpu")
    loader = sw.prepare_dataloader(data, batch_size=BATCH, model=model, shuffle=False)
    losses, batches = [], iter(loader)
    for _ in range(STEPS):
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(sw.all_reduce_mean(loss.detach(), model)))
    out = {"world": dist.get_world_size(), "rank": dist.get_rank(), "losses": losses, "local": []}
    dist.barrier()
    dist.destroy_process_group()
    return out


def listen():
    """Rank 0 lists the listening sockets of both ranks once the group's connections are up."""
    sw.init(accelerator="cpu")
    t = torch.ones(1)
    dist.all_reduce(t)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    sockets = []
    if dist.get_rank() == 0:
        sys.path[:0] = sys.argv[2].split(os.pathsep)
        from test_listening import listening

        sockets = listening([int(p) for p in pids])
    dist.barrier()
    dist.destroy_process_group()
    return {"world": int(t), "rank": int(os.environ["RANK"]), "losses": [], "local": [], "sockets": sockets}


if __name__ == "__main__":
    # Several modes, comma-separated, run in turn in this process (a new group each, as a script with several
    # trainings), each from the environment the scheduler gave: none sees what joining the last one exported.
    # MODE@LAUNCHER runs MODE from another launcher's whole environment for this task instead, read from the
    # JSON file that JOB_ENV_LAUNCHER names (one pair of processes then stands for two launchers' jobs).
    given = dict(os.environ)
    for mode in sys.argv[1].split(","):
        name, _, other = mode.partition("@")
        env = given
        if other:
            with open(given[f"JOB_ENV_{other.upper()}"]) as f:
                env = json.load(f)
        os.environ.clear()
        os.environ.update(env)
        out = {"fit": fit, "loop": loop, "listen": listen}[name]()
        out["source"] = os.environ.get("SHARDWISE_CLUSTER")
        print(f"RESULT {mode} " + json.dumps(out), flush=True)
'''

# Every variable some launcher sets: the children get none of the test process's, only the ones given.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_", "SHARDWISE_CLUSTER")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    return {**env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **extra}


def _free_port_in(lo: int, hi: int) -> int:
    """A port of [lo, hi) nothing listens on now (a bind on every interface succeeds)."""
    for port in random.Random(os.getpid()).sample(range(lo, hi), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def _results(ranks: list[tuple[int | None, str]], mode: str, exited: bool = True) -> list[dict]:
    """Each rank's result of ``mode`` from its log; fails with the log of a rank that has none (or, ``exited``,
    that did not exit 0)."""
    out = []
    for i, (code, text) in enumerate(ranks):
        if exited:
            assert code == 0, f"rank {i} exited {code}:\n{text[-4000:]}"
        line = next((line for line in text.splitlines() if line.startswith(f"RESULT {mode} ")), None)
        assert line is not None, f"rank {i} has no result for {mode} (exit code {code}):\n{text[-4000:]}"
        out.append(json.loads(line[len(f"RESULT {mode} "):]))
    return out


def _start_ranks(tmp_path, modes: str, envs: list[dict[str, str]], timeout: float = 100,
                 args=()) -> list[tuple[int | None, str]]:
    """Start one process per environment on the script, wait for all, kill them all on any failure: each rank's
    exit code and log."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    procs, logs = [], []
    try:
        for i, env in enumerate(envs):
            log = open(tmp_path / f"rank{i}.log", "w")  # files, not pipes: a chatty rank cannot block on a full pipe
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(script), modes, *args], cwd=str(tmp_path), env=env,
                                          stdout=log, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
    return [(p.returncode, (tmp_path / f"rank{i}.log").read_text()) for i, p in enumerate(procs)]


def _reference(tmp_path) -> list[float]:
    """The same training on one device, in this process."""
    import shardwise as sw

    script = tmp_path / "reference.py"
    script.write_text(SCRIPT)
    mod = runpy.run_path(str(script))  # not as __main__: only the definitions
    model, data = mod["make"]()
    return sw.Trainer("single", 1, accelerator="cpu", progress=False).fit(
        model, data, mod["loss_fn"], mod["SGD"], batch_size=mod["BATCH"], max_steps=mod["STEPS"]).losses


def _slurm_task(rank: int, job_id: int) -> dict[str, str]:
    """What `srun -n 2 python job.py` sets in task ``rank`` on a one-node allocation named 127.0.0.1."""
    return _clean_env(SLURM_JOB_ID=str(job_id), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                      SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
                      SLURM_STEP_NODELIST="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="1")


def _slurm_job_id() -> int:
    # The port formula inverted: a job id whose derived port is free here now.
    port = _free_port_in(cluster.SLURM_PORT_BASE, cluster.SLURM_PORT_BASE + cluster.SLURM_PORT_SPAN)
    job_id = 3 * cluster.SLURM_PORT_SPAN + port - cluster.SLURM_PORT_BASE
    assert slurm_port(job_id) == port
    return job_id


def _assert_one_job(results, reference, source):
    for r, out in enumerate(results):
        assert (out["world"], out["rank"], out["source"]) == (2, r, source)
    assert results[0]["losses"] == results[1]["losses"]
    torch.testing.assert_close(torch.tensor(results[0]["losses"], dtype=torch.float64),
                               torch.tensor(reference, dtype=torch.float64), rtol=1e-10, atol=1e-12)


# The three srun jobs and the mpirun job share one pair of processes: fit, then fit again from only what
# `mpirun -np 2` sets (Open MPI's variables, none of SLURM's), then the hand-written loop, then the listening
# sockets, each joining a group of its own from its launcher's variables (the script sets them afresh for each
# mode). The processes' start-up (torch) is paid once; each test reads its own mode's result.
SRUN_MODES = "fit,fit@openmpi,loop,listen"


def _mpirun_task(rank: int, port: int) -> dict[str, str]:
    """What `mpirun -np 2 python job.py` (Open MPI) sets in process ``rank`` on one node, with the port given."""
    return _clean_env(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                      OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT=str(port))


@pytest.fixture(scope="module")
def srun_job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("srun")
    job_id, port = _slurm_job_id(), _free_port_in(30000, 32000)
    envs = []
    for r in (0, 1):
        (folder / f"openmpi-{r}.json").write_text(json.dumps(_mpirun_task(r, port)))
        envs.append({**_slurm_task(r, job_id), "JOB_ENV_OPENMPI": str(folder / f"openmpi-{r}.json")})
    return folder, _start_ranks(folder, SRUN_MODES, envs, timeout=100,
                                args=(os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                    os.path.join(ROOT, "tests")]),))


@pytest.mark.fresh_processes
def test_srun_tasks_form_one_job(srun_job, tmp_path):
    results = _results(srun_job[1], "fit", exited=False)
    _assert_one_job(results, _reference(tmp_path), "slurm")
    # Each rank trained on its half of every batch (a lone run would see the whole batch, the global loss).
    assert results[0]["local"] != results[1]["local"]


@pytest.mark.fresh_processes
def test_mpirun_processes_form_one_job(srun_job, tmp_path):
    results = _results(srun_job[1], "fit@openmpi", exited=False)
    _assert_one_job(results, _reference(tmp_path), "openmpi")
    assert results[0]["local"] != results[1]["local"]


@pytest.mark.fresh_processes
def test_a_hand_written_loop_joins_the_srun_job(srun_job):
    folder, ranks = srun_job
    results = _results(ranks, "loop", exited=False)
    mod = runpy.run_path(str(folder / "job.py"))
    model, data = mod["make"]()
    opt = mod["SGD"](model.parameters())
    reference = []
    for step in range(mod["STEPS"]):  # a plain loop on the whole batch, in order
        x, y = data[step * mod["BATCH"]:(step + 1) * mod["BATCH"]]
        loss = mod["loss_fn"](model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(float(loss.detach()))
    _assert_one_job(results, reference, "slurm")


@pytest.mark.fresh_processes
def test_an_srun_job_on_one_node_listens_on_loopback_only(srun_job):
    from test_listening import LOOPBACK

    results = _results(srun_job[1], "listen")  # the job's last mode: both tasks also exited 0
    assert [r["world"] for r in results] == [2, 2]
    sockets = results[0]["sockets"]
    assert sockets, "rank 0 hosts the job's store: at least that listens"
    assert [s for s in sockets if s[1] not in LOOPBACK] == []
