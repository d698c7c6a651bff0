"""Where every rank is, so that a stuck collective becomes a diagnosis instead of a hang.

Each rank records every operation it issues through :class:`~shardwise.comm.Comm`
(step, per-group sequence number, operation, name, group, tensor sizes) in
memory. A daemon thread publishes the recent history to the c10d store (the
rendezvous key-value store every process group already has) when it changes,
twice a second, so the hot path pays no network round trip.

When a wait exceeds the timeout, the waiting rank reads every rank's record
from the store and names the rank(s) that never arrived at its operation and
what each of them is doing instead. In debug mode every rank also publishes the
signature of each collective *before* issuing it and checks that every member
of the group issues the same one, naming the first rank that differs.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import threading
import time
import weakref
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from shardwise.torch_private import c10d_default_store

HISTORY = 16  # operations kept per group in the published record


@dataclass
class Record:
    rank: int
    step: int
    seq: int
    op: str
    name: str
    group: str
    ranks: list[int]
    sizes: list[list[int]]
    started: float = field(default_factory=time.time)
    done: bool = False
    # True while the rank blocks in this operation's wait(). A send posted
    # asynchronously stays "not done" until someone waits on it, even when the
    # peer has long received it, so the oldest pending record is not always
    # where the rank is stuck; the one it waits in is.
    waiting: bool = False

    def describe(self) -> str:
        return f"{self.op} '{self.name}' (seq {self.seq} on group {self.group}, step {self.step})"


class CollectiveTimeout(RuntimeError):
    """A collective or point-to-point operation did not finish within the timeout."""


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different collectives at the same position (debug mode)."""


def default_store() -> Any:
    """The job's rendezvous store (under c10d's prefixes), or None without a process group.

    We unwrap c10d's PrefixStores so that our keys live at a known place in the
    job's store: the spawning parent (which hosts that store) can then read
    every rank's record even after ranks died.
    """
    if not dist.is_initialized():
        return None
    store = c10d_default_store()
    if store is None:  # pragma: no cover - private API moved
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def diag_store(store: Any) -> Any:
    """Our namespace in a job store, one per torchrun restart attempt (the store outlives attempts)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardwise/diag/{attempt}/", store)


def _stop_thread(stop: threading.Event, thread: threading.Thread | None) -> None:
    stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=10)


class Diagnostics:
    """Per-process recorder of issued communication; see the module docstring."""

    def __init__(self, rank: int, store: Any = None, debug: bool = False, heartbeat_s: float = 0.5) -> None:
        self.rank = rank
        self.debug = debug
        self.step = -1
        self._store = diag_store(store) if store is not None else None
        self._seq: dict[str, int] = defaultdict(int)
        self._history: dict[str, deque[Record]] = defaultdict(lambda: deque(maxlen=HISTORY))
        self._lock = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                                            name="shardwise-diagnostics")
            self._thread.start()
        # Stopped and joined at the latest when the interpreter exits: a daemon thread caught inside the store's
        # C++ call while Python finalizes is ended by pthread_exit, whose unwinding through pybind11's GIL guard
        # aborts the process ("terminate called without an active exception", exit -6). A topology nobody
        # closes (sw.setup's, in a hand-written loop) used to hit that now and then at exit.
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop, self._thread)

    # ---- recording ----------------------------------------------------
    def begin(self, op: str, name: str, group: str, ranks: list[int], sizes: list[list[int]]) -> Record:
        with self._lock:
            self._seq[group] += 1
            rec = Record(self.rank, self.step, self._seq[group], op, name, group, ranks, sizes)
            self._history[group].append(rec)
            self._dirty = True
        if self.debug and op not in ("send", "recv") and self._store is not None and len(ranks) > 1:
            self._check_same(rec)
        return rec

    def wait_on(self, rec: Record) -> None:
        rec.waiting = True
        self._dirty = True

    def end(self, rec: Record) -> None:
        rec.done = True
        rec.waiting = False
        self._dirty = True

    def close(self) -> None:
        self._finalizer()  # stop and join the heartbeat first: publish() below must not race it
        # The last position, now: a rank that fails before its first heartbeat (0.5 s) would
        # otherwise read "no record" in the job's diagnosis.
        try:
            self.publish()
        except Exception:  # noqa: BLE001 - the store may be gone with the job; the diagnosis says "no record"
            pass

    # ---- publishing ---------------------------------------------------
    def _snapshot(self) -> str:
        with self._lock:
            hist = {g: [asdict(r) for r in h] for g, h in self._history.items()}
        return json.dumps({"rank": self.rank, "step": self.step, "time": time.time(), "history": hist})

    def publish(self) -> None:
        if self._store is not None:
            self._dirty = False
            self._store.set(f"rank/{self.rank}", self._snapshot())

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self._dirty:
                try:
                    self.publish()
                except Exception:  # the store went away: the job is ending
                    return

    # ---- debug-mode check -----------------------------------------------
    def _check_same(self, rec: Record) -> None:
        sig = {"op": rec.op, "name": rec.name, "sizes": rec.sizes, "step": rec.step}
        assert self._store is not None
        self._store.set(f"dbg/{rec.group}/{rec.seq}/{self.rank}", json.dumps(sig))
        keys = [f"dbg/{rec.group}/{rec.seq}/{r}" for r in rec.ranks]
        try:
            self._store.wait(keys, _dt.timedelta(seconds=60))
        except Exception as e:
            raise CollectiveTimeout(f"debug check: not every rank of group {rec.group} {rec.ranks} reached "
                                    f"{rec.describe()} within 60 s\n" + self.explain(rec)) from e
        for r in rec.ranks:
            theirs = json.loads(self._store.get(keys[rec.ranks.index(r)]))
            if theirs != sig:
                raise CollectiveMismatch(
                    f"collective mismatch at seq {rec.seq} on group {rec.group}: rank {self.rank} issues "
                    f"{_sig(sig)} but rank {r} issues {_sig(theirs)}")

    # ---- explaining a timeout -------------------------------------------
    def explain(self, rec: Record) -> str:
        """Where every rank is, and for each stuck operation which rank(s) never arrived at it."""
        if self._store is None:
            return "  (no rendezvous store: the other ranks' positions are unknown)"
        try:
            self.publish()
        except Exception:
            pass
        world = dist.get_world_size() if dist.is_initialized() else max(rec.ranks) + 1
        return explain_job(self._store, world)


def explain_job(store: Any, world: int, wait_s: float = 2.0) -> str:
    """Read every rank's published record from ``store`` (our namespace) and explain."""
    infos: dict[int, dict[str, list[Record]] | None] = {}
    for r in range(world):
        try:
            store.wait([f"rank/{r}"], _dt.timedelta(seconds=wait_s))
            raw = json.loads(store.get(f"rank/{r}"))
            infos[r] = {g: [Record(**x) for x in h] for g, h in raw["history"].items()}
        except Exception:
            infos[r] = None
    lines, verdicts = [], []
    for r, info in infos.items():
        if info is None:
            lines.append(f"  rank {r}: no record (it died before it published its position)")
            continue
        pending = [h for hist in info.values() for h in hist if not h.done]
        if not pending:
            last = max((h for hist in info.values() for h in hist), key=lambda h: h.started, default=None)
            lines.append(f"  rank {r}: not in any communication" +
                         (f" (last finished: {last.describe()})" if last else ""))
            continue
        blocked = [h for h in pending if h.waiting]
        stuck = min(blocked or pending, key=lambda h: h.started)
        lines.append(f"  rank {r}: waiting in {stuck.describe()} for {time.time() - stuck.started:.1f} s")
        verdicts.append(_who_is_missing(stuck, infos))
    # Ranks stuck on the two sides of one divergence reach the same verdict: say it once.
    unique = list(dict.fromkeys(v for v in verdicts if v))
    return "where every rank is:\n" + "\n".join(lines) + "\n" + "\n".join(unique)


def _who_is_missing(stuck: Record, infos: dict[int, dict[str, list[Record]] | None]) -> str:
    """The ranks of ``stuck``'s group that did not issue the same operation at the same position."""
    if stuck.op in ("send", "recv"):
        peer = next(r for r in stuck.ranks if r != stuck.rank)
        other = infos.get(peer)
        want = "recv" if stuck.op == "send" else "send"
        matched = other is not None and any(
            h.op == want and h.name == stuck.name and h.step == stuck.step and not h.done and stuck.rank in h.ranks
            for hist in other.values() for h in hist)
        return "" if matched else (f"rank(s) [{peer}] never arrived at the matching {want} of "
                                   f"{stuck.op} '{stuck.name}' (step {stuck.step}; rank {stuck.rank} is waiting)")
    missing, instead = [], []
    for r in stuck.ranks:
        info = infos.get(r)
        if r == stuck.rank or info is None:
            missing += [] if r == stuck.rank else [r]
            continue
        hist = info.get(stuck.group, [])
        same = [h for h in hist if h.seq == stuck.seq]
        if not same:
            if not hist or max(h.seq for h in hist) < stuck.seq:
                missing.append(r)
        elif (same[0].op, same[0].name, same[0].step) != (stuck.op, stuck.name, stuck.step):
            missing.append(r)
            instead.append(f"    at that position rank {r} issued {same[0].describe()}")
    if not missing:
        return f"every rank arrived at {stuck.describe()}; the backend itself is stuck or slow"
    if instead:
        culprit = _who_diverged(stuck, infos)
        if culprit is not None:
            return culprit
    return (f"rank(s) {missing} never arrived at {stuck.op} '{stuck.name}' (seq {stuck.seq} on group "
            f"{stuck.group}, step {stuck.step}), which rank {stuck.rank} is waiting in"
            + ("\n" + "\n".join(instead) if instead else ""))


def _deviation(hist: list[Record], at: Record) -> tuple[Record, Record] | None:
    """(what this rank issued, what its previous step issued there) if step ``at.step`` breaks the pattern.

    Training steps repeat one sequence of collectives, so a rank whose
    operations in this step are not a prefix of its previous step's is the one
    that skipped or reordered one. None when it follows the pattern or no
    earlier step is in the (bounded) history.
    """
    earlier = [h for h in hist if h.step < at.step]
    if not earlier:
        return None
    prev_step = max(h.step for h in earlier)
    before = sorted((h for h in hist if h.step == prev_step), key=lambda h: h.seq)
    now = sorted((h for h in hist if h.step == at.step and h.seq <= at.seq), key=lambda h: h.seq)
    if len(hist) >= HISTORY and before[0].seq == min(h.seq for h in hist):
        return None  # the history may have dropped the start of the previous step: no reliable pattern
    for got, want in zip(now, before):
        if (got.op, got.name) != (want.op, want.name):
            return got, want
    return None


def _who_diverged(stuck: Record, infos: dict[int, dict[str, list[Record]] | None]) -> str | None:
    """When ranks disagree at one position, name the rank(s) that broke their own step pattern."""
    culprits: dict[int, tuple[Record, Record]] = {}
    faithful: list[int] = []
    for r in stuck.ranks:
        info = infos.get(r)
        if info is None:
            return None
        hist = info.get(stuck.group, [])
        mine = [h for h in hist if h.seq == stuck.seq]
        if not mine:
            return None
        dev = _deviation(hist, mine[0])
        if dev is None:
            faithful.append(r)
        else:
            culprits[r] = dev
    if not culprits or not faithful:
        return None
    expected = next(h for h in (infos[faithful[0]] or {}).get(stuck.group, []) if h.seq == stuck.seq)
    lines = [f"rank(s) {sorted(culprits)} never arrived at {expected.op} '{expected.name}' (seq {stuck.seq} on group "
             f"{stuck.group}, step {stuck.step}), which rank(s) {faithful} are waiting in: they skipped or "
             f"reordered a collective"]
    for r, (got, want) in sorted(culprits.items()):
        lines.append(f"    rank {r} issued {got.op} '{got.name}' at seq {got.seq} where its previous step "
                     f"issued {want.op} '{want.name}'")
    return "\n".join(lines)


def _sig(s: dict[str, Any]) -> str:
    return f"{s['op']} '{s['name']}' with sizes {s['sizes']} at step {s['step']}"
