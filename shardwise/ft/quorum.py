"""A rank's side of the quorum: who is live, the reduction among them, the commit vote, and the heartbeat.

The launcher hosts the store and alone decides membership (it sees a process
die, and kills one that stops beating): each membership is an epoch, and
each epoch's reduction group is a gloo group of its own, built from the
store under the epoch's prefix. It needs no ``init_process_group`` over the
job, which would wait for the dead rank.

A step is applied only when every member of the epoch completed its
reduction: each member votes ``ok`` or ``fail`` in the store, and a member
that died without voting counts as ``fail``. Votes are written once and a
dead member writes no more, so every survivor reaches the same decision.
"""
from __future__ import annotations

import datetime as _dt
import threading
import time

import torch
import torch.distributed as dist

from shardwise.ft import keys
from shardwise.ft.options import HEARTBEAT_S

# How long a member whose reduction completed waits for the other votes in one request before it looks, vote by
# vote, for a member that died meanwhile: the others completed the same reduction, so their votes follow at once.
VOTE_WAIT_S = 1.0


class QuorumLost(RuntimeError):
    """No new membership came after a failed reduction: the failure was not a replica group's death."""


class Quorum:
    """This rank's view of the live replica groups (``members``, in ``epoch``) and its reduction among them."""

    def __init__(self, store: dist.Store, group: int, timeout: _dt.timedelta, place: int = 0,
                 group_size: int = 1) -> None:
        # place: this rank's index inside its group. The reduction among groups is one per place: rank i of each
        # live group (its shard of the state, when the group shards it) sums with rank i of the others.
        self.store, self.group, self.timeout = store, group, timeout
        self.place, self.group_size = place, group_size
        self.epoch = 0
        self.members = keys.decode(store.get(keys.members(0)))
        self._pg: dist.ProcessGroup | None = None
        self._pg_epoch = -1

    def _process_group(self) -> dist.ProcessGroup:
        """The epoch's reduction group, built on first use (every member builds it: gloo's address exchange)."""
        if self._pg_epoch != self.epoch:
            self._pg = None  # the previous epoch's sockets go first
            prefixed = dist.PrefixStore(keys.reduction_group(self.epoch, self.place), self.store)
            self._pg = dist.ProcessGroupGloo(prefixed, self.members.index(self.group), len(self.members),  # type: ignore[assignment]
                                             self.timeout)
            self._pg_epoch = self.epoch
        assert self._pg is not None
        return self._pg

    def all_reduce(self, flat: list[torch.Tensor]) -> bool:
        """Sum each tensor of ``flat`` over the live groups, in place. False when a member failed meanwhile
        (gloo's "Connection closed by peer", or its timeout): the sums are then not to be used."""
        if len(self.members) == 1:
            return True
        try:
            pg = self._process_group()  # (its address exchange fails too when a member died meanwhile)
            for t in flat:
                pg.allreduce([t]).wait()
            return True
        except RuntimeError:  # gloo's errors (DistError and its kinds are RuntimeErrors): a peer went away
            self._drop()
            return False

    def _drop(self) -> None:
        """Close this epoch's reduction group now. A peer waiting in the failed reduction for data from this rank
        (not from the dead one) would otherwise wait for gloo's whole timeout: seen on torch 2.13 with 4 ranks,
        one waited 60 s; once every survivor closes its sockets, every pending peer fails within a second."""
        if self._pg is not None and hasattr(self._pg, "abort"):
            self._pg.abort()
        self._pg, self._pg_epoch = None, -1

    def agree(self, step: int, done: bool) -> bool:
        """The commit vote of ``step``: True when every rank of every member of this epoch completed the
        reduction."""
        mine = self.group * self.group_size + self.place
        self.store.set(keys.vote(step, self.epoch, mine), b"ok" if done else b"fail")  # type: ignore[arg-type]
        voters = [g * self.group_size + i for g in self.members for i in range(self.group_size)]
        names = [keys.vote(step, self.epoch, r) for r in voters]
        votes = self._votes_now(names) if done else None
        if votes is None and not self._wait_votes(voters, names):
            return False  # a member died before voting: it counts as a failed reduction
        return all(v == b"ok" for v in (votes or self.store.multi_get(names)))

    def _votes_now(self, names: list[str]) -> list[bytes] | None:
        """Every vote, read in one request that the store answers once the last one is in; None when one is
        still missing after :data:`VOTE_WAIT_S` (a member may have died after its reduction: see
        :meth:`_wait_votes`). Only after a completed reduction, when the other members are voting too."""
        self.store.set_timeout(_dt.timedelta(seconds=VOTE_WAIT_S))
        try:
            return self.store.multi_get(names)
        except dist.DistStoreError:
            return None
        finally:
            self.store.set_timeout(self.timeout)

    def _wait_votes(self, voters: list[int], names: list[str]) -> bool:
        """Wait until every vote is in (True), or every missing voter's group is gone (False)."""
        pause = 1e-4
        while not self.store.check(names):
            missing = {r // self.group_size for r, n in zip(voters, names) if not self.store.check([n])}
            if missing and missing <= self.gone():
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return True

    def gone(self) -> set[int]:
        """Members of this epoch that the launcher's newest membership no longer lists."""
        epoch = self.epoch
        while self.store.check([keys.members(epoch + 1)]):
            epoch += 1
        return set(self.members) - set(keys.decode(self.store.get(keys.members(epoch)))) if epoch > self.epoch \
            else set()

    def advance(self) -> list[int]:
        """After a failed step: wait for the launcher's next membership, move to its newest, and return the
        groups that left. Raises :class:`QuorumLost` when none comes within the collective timeout."""
        try:
            self.store.wait([keys.members(self.epoch + 1)], self.timeout)
        except dist.DistStoreError as e:
            raise QuorumLost(f"a reduction among replica groups {self.members} failed, but no group left within "
                             f"{self.timeout.total_seconds():g} s: the failure was not a replica's death") from e
        before = self.members
        while self.store.check([keys.members(self.epoch + 1)]):
            self.epoch += 1
        self.members = keys.decode(self.store.get(keys.members(self.epoch)))
        if self.group not in self.members:
            raise QuorumLost(f"replica group {self.group} was declared dead by the launcher")
        return [g for g in before if g not in self.members]

    def why_left(self, group: int) -> str:
        return self.store.get(keys.left(group)).decode()


class Heartbeat:
    """Tells the launcher every :data:`HEARTBEAT_S` that this rank is alive, from a thread with its own store
    connection (so a step blocked in a collective still beats; a stopped or hung process does not)."""

    def __init__(self, host: str, port: int, rank: int, timeout: _dt.timedelta) -> None:
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._key = keys.heartbeat(rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardwise-ft-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except RuntimeError:  # the launcher is gone: this process ends with it (launch.die_with_parent)
                return
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
