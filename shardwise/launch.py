"""Starting and joining process groups: spawned workers, torchrun, or one process.

From a plain ``python script.py`` the trainer spawns its workers here. The
parent process hosts the rendezvous store on an OS-chosen loopback port, so
there is no free-port race and nothing listens beyond this machine. Under
torchrun (``shardwise run``), :func:`init` joins the group torchrun describes;
under ``srun`` or ``mpirun`` the job their variables describe
(:func:`adopt_cluster_env`, :mod:`shardwise.cluster`).
:class:`shardwise.pool.WorkerPool` runs the same jobs on processes kept alive
between them; both report failures through :func:`supervise`.
"""
from __future__ import annotations

import ast
import ctypes
import datetime as _dt
import inspect
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping, Sequence
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise import cluster
from shardwise.cluster import (  # loopback_interface: its former home was here
    ClusterEnv,
    loopback_interface,
)
from shardwise.comm.diagnostics import diag_store, explain_job
from shardwise.comm.topology import backend_for, pick_device, threads_per_rank
from shardwise.precision import default_dtype_name
from shardwise.torch_private import host_rendezvous_stores


def adopt_cluster_env(environ: MutableMapping[str, str] | None = None) -> ClusterEnv | None:
    """:func:`shardwise.cluster.adopt` on ``os.environ`` (or ``environ``): srun's or mpirun's job, exported in
    torchrun's variables, so that every reader of those (fit, sw.init, the checks) sees the job."""
    return cluster.adopt(os.environ if environ is None else environ)


def under_launcher() -> bool:
    """True when a launcher started this process as one rank of a job: torchrun (``shardwise run``), srun, mpirun.
    Another launcher's variables are adopted first, so that what reads torchrun's after this sees the same job."""
    adopt_cluster_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


under_torchrun = under_launcher  # its former name, from when torchrun's variables were the only ones read


def follower() -> bool:
    """True in every rank but rank 0 of a job already running: one a launcher started, or a process group this
    process has joined. Checks whose verdict every rank would reach alike run on rank 0 alone (see
    :func:`shardwise.fit.prestart.checks.validate`); the launcher ends the other ranks when rank 0 refuses the run."""
    if dist.is_initialized():
        return dist.get_rank() != 0
    return under_launcher() and os.environ["RANK"] != "0"


def init(accelerator: str = "auto", timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> torch.device:
    """Join the process group the launcher describes (idempotent); returns this rank's device."""
    joining = not dist.is_initialized() and under_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(accelerator, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if joining:
        try:
            dist.init_process_group(backend_for(device), store=_torchrun_store(timeout),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        except Exception as e:
            hint = cluster.join_hint(os.environ)  # which job srun's or mpirun's variables described
            if hint is not None and hasattr(e, "add_note"):
                e.add_note(hint)
            raise
    # Threads from the launcher's LOCAL_WORLD_SIZE; a group that runs without a launcher's variables (launch.spawn's
    # ranks, which set their own share, or a user's) keeps its threads: LOCAL_WORLD_SIZE's default of 1 would give
    # each rank every core (2 ranks on 2 cores ran the bench's ddp engine switch 4x slower).
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and under_launcher():
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return device


def _torchrun_store(timeout: _dt.timedelta) -> dist.Store:
    """The job store torchrun describes, under a prefix unique to this restart attempt.

    torchrun restarts every worker after a failure; gloo's address exchange
    must not see the previous attempt's keys. Seen on torch 2.13: with the
    plain ``env://`` initialisation the restarted workers read the dead
    attempt's gloo addresses ("connectFullMesh failed ... Connection
    refused"), so we namespace by run id and restart count ourselves.
    Without torchrun's agent (srun, mpirun) rank 0 hosts it: :func:`_hosted_store`.
    """
    env = os.environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    if not agent_store and env["RANK"] == "0":
        store = _hosted_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), timeout)
    else:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=int(env["WORLD_SIZE"]),
                              is_master=False, timeout=timeout, wait_for_workers=False)
    # Every rank joins a new group as often as the others (one per ``fit`` in the script), so a count of
    # this process's joins names the same group on every rank and keeps a second ``fit`` from reading the
    # first group's keys (it hung in the address exchange).
    _JOINS[0] += 1
    prefix = (f"shardwise/{env.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
              f"/group{_JOINS[0]}")
    return dist.PrefixStore(prefix, store)


_JOINS = [0]  # groups this process joined through _torchrun_store (see there)

# The store servers this process hosts as rank 0 of a job without torchrun's agent, by port: not a group's
# state, the server outlives the groups, as torchrun's agent store does. A finished group's store can stay
# referenced, so a second fit could not bind the port again ("address already in use", torch 2.13).
_HOSTED: dict[int, dist.TCPStore] = {}


def _hosted_store(addr: str, port: int, timeout: _dt.timedelta) -> dist.TCPStore:
    """The store this process hosts on ``port`` for its job's groups: started on the first join, then reused."""
    if port not in _HOSTED:
        # A job on one node meeting on loopback: the store listens there only (as spawned jobs' stores do), not
        # on every interface, which is what TCPStore binds given a host name.
        fd = cluster.loopback_listener(port) if cluster.meets_on_loopback(os.environ) else None
        listen: dict[str, Any] = {} if fd is None else {"master_listen_fd": fd}
        _HOSTED[port] = dist.TCPStore(addr, port, world_size=None, is_master=True, timeout=timeout,
                                      wait_for_workers=False, **listen)
    _HOSTED[port].set_timeout(timeout)
    return _HOSTED[port]


def start_method() -> str:
    """How rank processes start: ``"spawn"`` (fresh interpreters that re-import the main script) when the
    main program is a file; ``"fork"`` when it is not (a notebook, an interactive session, stdin,
    ``python -c``), since a fresh interpreter cannot re-import it and objects defined there reach the
    ranks only in a copy of this process. Fork is refused once CUDA is initialised here (a forked child
    cannot use CUDA) and where the platform has no fork."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    interactive = main is None or hasattr(sys, "ps1") or "ipykernel" in sys.modules
    if not interactive and path is not None and os.path.exists(path):
        return "spawn"
    where = "this interactive session" if interactive or path is None else f"{path!r}"
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError(f"starting rank processes needs the main program in a file the ranks can import (this "
                           f"one is {where}) on this platform: save the script to a file and run it, or launch with "
                           "`shardwise run --nproc N script.py`")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(f"the main program is {where}, so rank processes would be forked from this one, but CUDA "
                           "is already initialised here and a forked process cannot use it: start the ranks before "
                           "any CUDA call, save the script to a file, or launch with `shardwise run --nproc N`")
    return "fork"


def check_main_module() -> None:
    """Refuse, before starting any process, a main script the ranks cannot re-import safely.

    Rank processes are started with the "spawn" method: each imports the
    main script again (as ``__mp_main__``). Code that trains at the script's
    top level, outside ``if __name__ == "__main__":``, would then run again in
    every rank and try to start ranks of its own, which multiprocessing meets
    with a long error or a hang. A main without a file (a notebook, stdin,
    ``python -c``) is not re-imported: :func:`start_method` forks instead.
    """
    if start_method() == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return  # python -m package: multiprocessing does not re-import a package's __main__
    assert path is not None
    frames = [f for f in inspect.stack(0) if f.frame.f_globals is vars(main) and f.function == "<module>"]
    if not frames:
        return
    line = frames[-1].lineno
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError, ValueError):
        return

    def guarded(node: ast.AST) -> bool:
        test = ast.unparse(node.test) if isinstance(node, ast.If) else ""
        return "__name__" in test and "__main__" in test

    inside = any(guarded(n) and n.lineno <= line <= (n.end_lineno or n.lineno) for n in ast.walk(tree))  # type: ignore[attr-defined]
    if not inside:
        raise RuntimeError(f"{path}, line {line}, starts rank processes from the top level of the script: each rank "
                           "imports the script again (the 'spawn' start method) and would run this code too. Put "
                           "it under `if __name__ == \"__main__\":` (or launch with `shardwise run`)")


TOP_LEVEL = ("it must be defined at the top level of a module (a `def`, a class, or functools.partial of one), not a "
             "lambda or a function defined inside another")


def require_picklable(named: dict[str, Any], fix: str = TOP_LEVEL) -> None:
    """Spawned ranks receive these pickled: refuse the first that is not, naming it (``named``'s key) and ``fix``,
    instead of the bare PicklingError a rank would die of after start-up."""
    for what, obj in named.items():
        try:
            pickle.dumps(obj)
        except Exception as e:  # PicklingError, AttributeError ("Can't pickle local object"), TypeError
            raise TypeError(f"{what} cannot be sent to the rank processes ({type(e).__name__}: {e}): each rank is "
                            f"a fresh process that receives it pickled, so {fix}; or launch with `shardwise run`, "
                            "where every rank builds it itself") from None


def pickled_for_ranks(obj: Any, parts: Callable[[], dict[str, Any]]) -> bytes:
    """``obj`` in plain pickle for the rank processes (not multiprocessing's: torch's pickler would move the
    parameters into shared memory, and every rank would then step the same storage). When it cannot be pickled,
    the first of ``parts()`` that cannot is named with the fix (:func:`require_picklable`) instead of a bare
    PicklingError; the parts are pickled one by one only then, so a picklable job is pickled once."""
    try:
        return pickle.dumps(obj)
    except Exception:  # PicklingError, AttributeError ("Can't pickle local object"), TypeError
        require_picklable(parts())
        raise


def die_with_parent() -> None:
    """End this process when the process that started it dies, whatever killed it (SIGKILL included).

    Otherwise the ranks of a killed launcher would keep training, and keep
    writing checkpoints into the directory its relaunch resumes from. On Linux
    the kernel delivers SIGKILL on the parent's death (``PR_SET_PDEATHSIG``);
    elsewhere a daemon thread polls the parent id. Called first thing in every
    rank process that shardwise starts (fresh or pooled).
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watch", daemon=True).start()


def _worker(rank: int, fn: Callable[..., Any], world: int, port: int, accelerator: str,
            timeout_s: float, args: tuple[Any, ...], default_dtype: str = "float32") -> None:
    die_with_parent()
    # The caller's default dtype, as a forked rank has it (precision.default_dtype_name says why).
    torch.set_default_dtype(getattr(torch, default_dtype))
    if not run_rank(rank, fn, world, port, accelerator, timeout_s, args):
        raise SystemExit(1)


def run_rank(rank: int, fn: Callable[..., Any], world: int, port: int, accelerator: str,
             timeout_s: float, args: tuple[Any, ...]) -> bool:
    """One rank of a job: join the group the parent's store on ``port`` hosts, run ``fn``, leave the group.

    Returns False after recording the traceback in the store, where the
    parent reads every rank's error (a fresh process then exits 1; a pooled
    worker reports False and is replaced).
    """
    torch.set_num_threads(threads_per_rank(world))
    # Every rank is on this machine: gloo's connections between them listen on loopback only
    # (by default gloo listens on the address the host name resolves to, reachable from outside).
    lo = loopback_interface()
    if lo is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
    timeout = _dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False, timeout=timeout)
    try:
        device = pick_device(accelerator, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)
        fn(rank, device, *args)
        dist.barrier()  # only on success: on an error path peers may never arrive
        return True
    except BaseException:
        store.set(f"shardwise/error/{rank}", traceback.format_exc())
        return False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerFailed(RuntimeError):
    """A spawned rank raised or died; the message holds every rank's error and where each rank was."""


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), accelerator: str = "cpu",
          timeout: _dt.timedelta = _dt.timedelta(minutes=5), grace_s: float = 2.0) -> None:
    """Run ``fn(rank, device, *args)`` in ``nprocs`` fresh processes inside one process group.

    When a rank fails, the others get ``grace_s`` seconds to report their own
    errors, then are terminated, and :class:`WorkerFailed` is raised here with
    every rank's traceback and a diagnosis of where each rank was (see
    :mod:`shardwise.comm.diagnostics`), instead of a bare exit code.
    """
    check_main_module()
    store = job_store(timeout)
    ctx = mp.get_context(start_method())
    procs = [ctx.Process(target=_worker, name=f"shardwise-rank{r}",  # type: ignore[attr-defined]
                         args=(r, fn, nprocs, store.port, accelerator, timeout.total_seconds(), args,
                               default_dtype_name()))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        supervise(procs, store, grace_s, timeout.total_seconds())
    finally:
        stop_processes(procs)


def stop_processes(procs: Sequence[BaseProcess], wait_s: float = 5.0) -> None:
    """Terminate the processes still running (all at once, then wait), killing any that ignore it."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(wait_s)
        if p.exitcode is None:
            p.kill()
            p.join()


def job_store(timeout: _dt.timedelta) -> dist.TCPStore:
    """A fresh rendezvous store for one job, hosted here on an OS-chosen port of 127.0.0.1 only.

    torch's TCPStore binds its server to every interface whatever host name it
    is given, so anyone who can reach this machine could read and write the
    job's keys; it is handed a socket already listening on loopback instead.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())


def loopback_rendezvous(timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> tuple[dist.TCPStore, list[str]]:
    """torchrun arguments for a one-machine job whose every socket listens on loopback only.

    torchrun's ``--standalone`` hosts its rendezvous store, and its agent the
    store the workers meet in, on every interface. Here the rendezvous store
    is ours (:func:`job_store`, 127.0.0.1), the agent joins it as a client,
    advertises 127.0.0.1 to the workers, and hosts the workers' store on
    loopback too (torch's ``DynamicRendezvousHandler._create_tcp_store_server``
    is replaced for this process, which is the launcher:
    :func:`shardwise.torch_private.host_rendezvous_stores`); gloo is pointed at
    the loopback interface. Keep the returned store alive for the whole job.
    """
    store = job_store(timeout)
    host_rendezvous_stores(lambda: job_store(timeout))
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    return store, ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                   "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1"]


REPORT_WAIT_CAP_S = 60.0  # the longest supervise waits, after a silent death, for a survivor's report


class RankHandle(Protocol):
    """What :func:`supervise` watches: ``exitcode`` is None while the rank runs, 0 on success."""

    @property
    def exitcode(self) -> int | None: ...

    @property
    def sentinel(self) -> Any: ...  # what multiprocessing.connection.wait accepts


def supervise(ranks: Sequence[RankHandle], store: dist.TCPStore, grace_s: float,
              collective_timeout_s: float = 0.0) -> None:
    """Wait until every rank succeeds, or raise :class:`WorkerFailed` once one fails.

    Shared by fresh processes and the worker pool, so a failure reads the same
    from both: every rank's traceback from the store, how each silent death
    ended, and the diagnosis of where each rank was.

    After a failure the others get ``grace_s`` seconds to report. When no rank
    has reported yet (a rank died by a signal, as gloo's abort on a mismatched
    size does), the survivors get until their collective timeout on top: a rank
    waiting for the dead one reports only when its wait times out or its
    connection drops, and that report is the one that says what was missed.
    That extra wait is capped at :data:`REPORT_WAIT_CAP_S`, so a survivor busy
    outside any collective does not hold the failure for minutes.
    """
    try:
        while any(r.exitcode is None for r in ranks):
            if any(r.exitcode not in (None, 0) for r in ranks):
                break
            mp_connection.wait([r.sentinel for r in ranks if r.exitcode is None], timeout=0.05)
    except BaseException as e:
        # Interrupted while ranks run (a test's timeout, Ctrl-C): say where each rank was, from the
        # records their heartbeats keep publishing, before the caller stops them.
        if hasattr(e, "add_note"):
            e.add_note("--- " + explain_job(diag_store(store), len(ranks), wait_s=0.1))
        raise
    if all(r.exitcode == 0 for r in ranks):
        return
    start = time.monotonic()

    def reported() -> bool:
        return any(store.check([f"shardwise/error/{i}"]) for i in range(len(ranks)))

    while any(r.exitcode is None for r in ranks):
        waited = time.monotonic() - start
        if waited >= grace_s + min(collective_timeout_s, REPORT_WAIT_CAP_S) or (waited >= grace_s and reported()):
            break
        time.sleep(0.05)
    # Every rank that failed by now, not only the first seen: which one noticed first is a race.
    failed = [i for i, r in enumerate(ranks) if r.exitcode not in (None, 0)]
    parts: list[str] = []
    causes: list[tuple[str, str]] = []  # (one line, the whole error)
    for i, r in enumerate(ranks):
        key = f"shardwise/error/{i}"
        if store.check([key]):
            text = store.get(key).decode().rstrip()
            parts.append(f"--- rank {i} raised:\n{text}")
            causes.append((f"rank {i} raised {_error_line(text)}", text))
        elif r.exitcode not in (None, 0):
            causes.append((f"rank {i} died: {_exit_reason(r.exitcode)}", ""))
            parts.append(f"--- {causes[-1][0]}")
    diagnosis = explain_job(diag_store(store), len(ranks), wait_s=0.1)
    raise WorkerFailed(_headline(causes) + f"rank(s) {failed} failed\n" + "\n".join(parts) + "\n--- " + diagnosis)


# Errors a rank raises because a peer went away or stopped answering: consequences, not causes.
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "did not complete within",
                 "lost its connection to a peer")


def _error_line(text: str) -> str:
    """The ``Type: message`` line of a formatted traceback (the last line that starts one), not the last line
    of a multi-line message."""
    lines = text.splitlines()
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head and not line.startswith(" ") and head.replace(".", "").replace("_", "").isalnum() and ":" in line:
            return line
    return lines[-1] if lines else ""


def _headline(causes: list[tuple[str, str]]) -> str:
    """The first line of a failure: the likeliest cause, so it is not buried under every rank's traceback.

    A rank that lost its peer raises too, often first; the cause is the rank
    whose error (anywhere in its traceback) is not such a consequence, else the
    first error or death.
    """
    if not causes:
        return ""
    own = [line for line, text in causes if not any(s in text for s in _CONSEQUENCES)]
    return (own or [line for line, _ in causes])[0] + "\n"


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def result_dir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="shardwise-")
