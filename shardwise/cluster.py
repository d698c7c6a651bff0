"""Which job this process belongs to, read from the variables its launcher set.

torchrun (and ``shardwise run``, and Kubernetes' PyTorchJob) describe a job
with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE``. SLURM's ``srun`` and the MPI launchers (``mpirun`` of
Open MPI, ``mpiexec`` of MPICH and Intel MPI) describe the same things with
variables of their own. :func:`detect` reads whichever is there and returns one
:class:`ClusterEnv`; :func:`adopt` (``shardwise.launch.adopt_cluster_env``)
exports it as torchrun's variables, so that every reader of those keeps working.

Which launcher wins when several left variables behind: the one that started
this process, which is the innermost. torchrun's variables first (``shardwise
run`` inside an ``srun`` step: its workers inherit the step's SLURM variables,
but torchrun's describe the workers). Then MPI's (``mpirun`` inside a SLURM
batch script: its processes inherit the batch step's SLURM variables, which
describe the batch step, not them). SLURM's last. A scheduler's world of one
process is not a job: such a process trains as from a plain ``python``.

Nothing is started here and torch is not imported (``shardwise run`` builds its arguments from this module).
"""
from __future__ import annotations

import socket
import warnings
import zlib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

#: The port an MPI job's rank 0 listens on when MASTER_PORT is not exported: torchrun's own default.
MPI_DEFAULT_PORT = 29500

# MASTER_PORT of a SLURM job that does not export one: SLURM_PORT_BASE + job id % SLURM_PORT_SPAN. Every task
# of the job reads the same job id, so every task computes the same port without talking to the others. The
# range, 10000-29999, is unprivileged and below Linux's ephemeral ports (32768 and up), where the kernel picks
# the local ports of outgoing connections, so a busy node's clients do not sit on it by chance.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000

#: What ``ClusterEnv.source`` can be.
SOURCES = ("torchrun", "slurm", "openmpi", "mpich")

# Set by adopt next to torchrun's variables: which launcher they were read from.
ADOPTED_FROM = "SHARDWISE_CLUSTER"


class ClusterError(ValueError):
    """The launcher's variables describe a job, but not enough of it to join (the message says what to export)."""


@dataclass(frozen=True)
class ClusterEnv:
    """One process's place in a job, whichever launcher described it. ``source`` names the launcher:
    ``"torchrun"``, ``"slurm"``, ``"openmpi"`` or ``"mpich"`` (MPICH, Intel MPI and other PMI launchers)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str

    def torchrun_variables(self) -> dict[str, str]:
        """The same job in torchrun's variables, the ones every part of shardwise reads."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def detect(env: Mapping[str, str]) -> ClusterEnv | None:
    """The job ``env`` (a process environment) describes, or None when this process is not part of one.

    Raises :class:`ClusterError` when a launcher's variables are there but the
    job cannot be joined from them (an MPI job on several nodes without
    MASTER_ADDR, a malformed SLURM node list).
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        # torchrun's own variables, complete or not, are the launcher's word: a scheduler's variables beside
        # them were inherited from an outer level. Incomplete ones (no MASTER_ADDR) are not a job, as before.
        return _torchrun(env)
    for read in (_openmpi, _mpich, _slurm):
        job = read(env)
        if job is not None:
            # A scheduler's world of one is a single process: it trains (and spawns ranks) as a plain `python`.
            return job if job.world_size > 1 else None
    return None


def adopt(env: MutableMapping[str, str]) -> ClusterEnv | None:
    """The job ``env`` describes (:func:`detect`), written into ``env`` in torchrun's variables when another
    launcher described it: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
    SHARDWISE_CLUSTER (the launcher's name). Idempotent; torchrun's own variables are left as they are.
    What decides between joining a job and spawning ranks reads torchrun's variables: now it sees the job.
    """
    job = detect(env)
    if job is None:
        note = allocation_note(env)
        if note is not None:
            # Shown once per process (the warnings registry of the one line that calls adopt).
            warnings.warn(f"shardwise: {note}", stacklevel=3)
        return None
    if job.source == "torchrun" or ADOPTED_FROM in env:
        return job
    env.update(job.torchrun_variables())
    env[ADOPTED_FROM] = job.source
    if meets_on_loopback(env):
        # gloo's own connections stay on loopback too: by default it listens on the address the host name
        # resolves to, reachable from outside, though every rank is here.
        lo = loopback_interface()
        if lo is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", lo)
    return job


def meets_on_loopback(env: Mapping[str, str]) -> bool:
    """True for a job :func:`adopt` wrote whose ranks are all on this node and meet at a 127.x address."""
    return (ADOPTED_FROM in env and env.get("MASTER_ADDR", "").startswith("127.")
            and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"))


def join_hint(env: Mapping[str, str]) -> str | None:
    """For an error while joining a job :func:`adopt` wrote: which job this process took itself to be in."""
    if ADOPTED_FROM not in env:
        return None
    return (f"shardwise: this process is rank {env['RANK']} of {env['WORLD_SIZE']} of the job {env[ADOPTED_FROM]}'s "
            f"variables describe, rank 0's store at {env['MASTER_ADDR']}:{env['MASTER_PORT']}: every rank must be "
            "started and reach that address (docs/clusters.md)")


def _torchrun(env: Mapping[str, str]) -> ClusterEnv | None:
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    world = _int(env, "WORLD_SIZE")
    source = env.get(ADOPTED_FROM, "torchrun")
    return ClusterEnv(rank=_int(env, "RANK"), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                      local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")), master_addr=env["MASTER_ADDR"],
                      master_port=int(env.get("MASTER_PORT", MPI_DEFAULT_PORT)),
                      source=source if source in SOURCES else "torchrun")


def _openmpi(env: Mapping[str, str]) -> ClusterEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    # mpirun always sets the local pair; LOCAL_* (exported by hand) stand in where a wrapper dropped them.
    local_rank = _first_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
    local_world = _first_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
    return _mpi_job(env, "openmpi", "Open MPI's mpirun", rank, world, local_rank, local_world)


def _mpich(env: Mapping[str, str]) -> ClusterEnv | None:
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    # Hydra (MPICH, Intel MPI) sets MPI_LOCALRANKID/MPI_LOCALNRANKS; Cray's PALS sets PMI_LOCAL_RANK/_SIZE.
    local_rank = _first_int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "LOCAL_RANK")
    local_world = _first_int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "LOCAL_WORLD_SIZE")
    if local_rank is None and "SLURM_PROCID" in env and env.get("SLURM_PROCID") == env["PMI_RANK"]:
        # `srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE but no local pair; srun's own variables describe the same
        # processes (the ranks agree) and do say where each one is.
        return None
    return _mpi_job(env, "mpich", "the MPI launcher (PMI_RANK)", rank, world, local_rank, local_world)


def _mpi_job(env: Mapping[str, str], source: str, launcher: str, rank: int, world: int, local_rank: int | None,
             local_world: int | None) -> ClusterEnv:
    if local_rank is None or local_world is None:
        if world == 1:
            local_rank, local_world = 0, 1
        else:
            raise ClusterError(f"{launcher} started {world} processes but did not say which of them share this "
                               "node (no local rank and size in the environment): export LOCAL_RANK and "
                               "LOCAL_WORLD_SIZE to every process, and MASTER_ADDR and MASTER_PORT")
    addr = env.get("MASTER_ADDR")
    if not addr:
        if local_world != world and world > 1:
            raise ClusterError(mpi_master_message(launcher, world, local_world))
        # Every rank is on this node: rank 0's store is reachable on loopback, and listens there only.
        addr = "127.0.0.1"
    return ClusterEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                      master_addr=addr, master_port=_port(env, MPI_DEFAULT_PORT), source=source)


def mpi_master_message(launcher: str, world: int, local_world: int) -> str:
    """Why an MPI job on several nodes cannot be joined without MASTER_ADDR, and what to export."""
    return (f"{launcher} started {world} processes on more than one node ({local_world} on this one), and "
            "MPI's variables do not say which host rank 0 is on: export MASTER_ADDR (the host of rank 0, e.g. "
            "`$(hostname)` of the first node) and MASTER_PORT (a free port there) to every process, e.g. "
            "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...` (Open MPI) or "
            "`mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 ...` (MPICH, Intel MPI)")


def _slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    step = slurm_step(env)
    if step is None:
        return None
    rank, world = _int(env, "SLURM_PROCID"), step.tasks
    local_rank = _first_int(env, "SLURM_LOCALID")
    if local_rank is None and len(step.hosts) == 1:
        local_rank = rank  # one node: every task is local, in rank order
    if local_rank is None:
        raise ClusterError("srun started this process without SLURM_LOCALID: cannot tell which of this node's "
                           "tasks it is; export LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE and MASTER_ADDR")
    return ClusterEnv(rank=rank, world_size=world, local_rank=local_rank,
                      local_world_size=_slurm_local_world(env, step, local_rank),
                      master_addr=env.get("MASTER_ADDR") or step.hosts[0],
                      master_port=_port(env, slurm_port(step.job_id)), source="slurm")


@dataclass(frozen=True)
class SlurmStep:
    """An ``srun`` step seen from one of its tasks: how many tasks, on which hosts (in SLURM's order)."""

    tasks: int
    hosts: tuple[str, ...]
    job_id: str


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The srun step this process is a task of, or None outside one.

    srun marks its tasks with SLURM_STEP_NUM_TASKS (and the other SLURM_STEP_*
    variables). The batch script itself has SLURM_PROCID=0 and the allocation's
    SLURM_NTASKS but no step: taken for rank 0, it would wait until the timeout
    for tasks that are never started. It is one process of the allocation.
    """
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        if "MASTER_ADDR" not in env:
            raise ClusterError("srun started this process but SLURM_STEP_NODELIST (and SLURM_JOB_NODELIST) is "
                               "not set: cannot tell which host rank 0 is on; export MASTER_ADDR")
        hosts: tuple[str, ...] = (env["MASTER_ADDR"],)
    else:
        hosts = tuple(expand_hostlist(nodelist))
    return SlurmStep(tasks=_int(env, "SLURM_STEP_NUM_TASKS"), hosts=hosts,
                     job_id=env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "")


def allocation_note(env: Mapping[str, str]) -> str | None:
    """What to tell a process that is inside a SLURM allocation of several tasks but not in an srun step."""
    if "SLURM_JOB_ID" not in env or any(k in env for k in ("SLURM_STEP_NUM_TASKS", "RANK", "OMPI_COMM_WORLD_SIZE",
                                                           "PMI_SIZE")):
        return None  # a job's process, or one some other launcher started
    tasks = _first_int(env, "SLURM_NTASKS") or 1
    nodes = _first_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    if tasks <= 1 and nodes <= 1:
        return None
    return (f"this process runs inside a SLURM allocation of {tasks} task(s) on {nodes} node(s) but was not "
            "started by srun (it is the batch script, or salloc's shell), so it is one process on one node and "
            "trains alone; start it on every task with `srun python script.py` (or one `srun "
            "--ntasks-per-node=1 shardwise run --nproc N script.py` per node)")


def _slurm_local_world(env: Mapping[str, str], step: SlurmStep, local_rank: int) -> int:
    """Tasks of this step on this node: SLURM's per-node counts when there, else the nodes' even share."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if key in env:
            counts = expand_counts(env[key])
            node = _first_int(env, "SLURM_NODEID")
            if node is not None and node < len(counts):
                return counts[node]
            if len(set(counts)) == 1:
                return counts[0]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    if len(step.hosts) == 1:
        return step.tasks
    # Unknown layout: an even share, at least enough to hold this task's local rank.
    return max(local_rank + 1, -(-step.tasks // len(step.hosts)))


def slurm_port(job_id: str | int | None) -> int:
    """MASTER_PORT of a SLURM job that exports none: ``10000 + job_id % 20000`` (10000-29999).

    Deterministic, so every task of the job computes the same port alone; two
    jobs sharing a node collide only when their ids differ by a multiple of
    20000. A job id that is not a number (none should be) is hashed with CRC-32.
    """
    if job_id is None or str(job_id).strip() == "":
        return MPI_DEFAULT_PORT
    text = str(job_id).strip()
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return SLURM_PORT_BASE + number % SLURM_PORT_SPAN


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: ``"node[01-03,07],gpu-a[1-2]"`` gives node01,
    node02, node03, node07, gpu-a1, gpu-a2. Zero padding is kept (``[08-10]`` gives 08, 09, 10); several
    bracket groups in one name expand to every combination, the first group outermost."""
    hosts: list[str] = []
    for name in _split_top_level(text.strip()):
        hosts.extend(_expand_name(name, text))
    if not hosts:
        raise ClusterError(f"empty SLURM host list {text!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets (those inside separate ranges of one name)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ClusterError(f"nested brackets in SLURM host list {text!r}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ClusterError(f"unbalanced ']' in SLURM host list {text!r}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ClusterError(f"unbalanced '[' in SLURM host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str, whole: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    head, ranges, tail = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    rest = _expand_name(tail, whole) if tail else [""]
    return [head + index + r for index in _expand_ranges(ranges, whole) for r in rest]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    """``"01-03,7"`` as ``["01", "02", "03", "7"]``: each range keeps the width of its first bound."""
    out: list[str] = []
    for part in ranges.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ClusterError(f"bad range {part!r} in SLURM host list {whole!r}")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ClusterError(f"descending range {part!r} in SLURM host list {whole!r}")
        out.extend(str(i).zfill(len(lo)) for i in range(first, last + 1))
    return out


def expand_counts(text: str) -> list[int]:
    """SLURM's per-node task counts, ``"2(x3),1"``, as ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        part = part.strip()
        value, _, times = part.partition("(x")
        try:
            counts.extend([int(value)] * (int(times.rstrip(")")) if times else 1))
        except ValueError:
            raise ClusterError(f"bad task count {part!r} in SLURM's {text!r}") from None
    return counts


# Flags of `shardwise run` that say how the nodes meet: given any, the user chose, and nothing is added.
RENDEZVOUS_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master", "--standalone")


def gives_rendezvous(args: Sequence[str]) -> bool:
    """True when ``shardwise run``'s arguments already say how the nodes meet (or that there is one node)."""
    return any(a.startswith(RENDEZVOUS_FLAGS) for a in args)


def allocation_run_args(env: Mapping[str, str]) -> list[str]:
    """torchrun's rendezvous flags for the ``shardwise run`` of one task of a SLURM step, or ``[]``.

    Used inside an allocation when srun started ``shardwise run`` on several
    tasks (normally one per node: ``srun --ntasks-per-node=1 shardwise run
    --nproc 8 train.py``). Each task is one torchrun agent: ``--nnodes`` is
    the step's task count (the nodes, one task per node), and the agents
    meet in a c10d rendezvous that task 0 (SLURM_PROCID) hosts on the step's
    first host (MASTER_ADDR when exported) at MASTER_PORT, else at the job's
    derived port (:func:`slurm_port`). No ``--node-rank``: c10d numbers the
    nodes as they arrive, and torchrun warns that it ignores one. One task,
    or no step: ``[]`` (one node).
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return []  # already a worker of some launcher: not an agent of the step
    step = slurm_step(env)
    if step is None or step.tasks <= 1:
        return []
    rank = _int(env, "SLURM_PROCID")
    host = env.get("MASTER_ADDR") or step.hosts[0]
    port = _port(env, slurm_port(step.job_id))
    return ["--nnodes", str(step.tasks), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", f"slurm-{step.job_id or 'job'}",
            # Task 0 hosts the rendezvous: said outright, not left to torch's matching of host names (SLURM's
            # node names need not be what the machine calls itself).
            "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}"]


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), if there is one."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


def loopback_listener(port: int) -> int:
    """A socket listening on 127.0.0.1:``port``, handed over as a file descriptor (the caller owns it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A job that just ended here on the same port (the previous run of the script) may have left connections
    # in TIME_WAIT, which would refuse the bind for a minute.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _port(env: Mapping[str, str], default: int) -> int:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else default


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ClusterError(f"{key}={env[key]!r} is not a whole number") from None


def _first_int(env: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        if env.get(key, "") != "":
            return _int(env, key)
    return None
