"""The keys of the fault-tolerance protocol in the launcher's store: written here once, read by both sides.

The launcher (:mod:`shardwise.ft.supervise`) is the only writer of the
membership: ``members/<epoch>`` lists the live replica groups of each epoch,
written when a group dies (epoch 0: every group). Ranks (:mod:`shardwise.ft.quorum`)
write their heartbeats, their vote on each step's reduction, and, after a
commit, the step's sample shards for the ledger.
"""
from __future__ import annotations

import json

PREFIX = "shardwise/ft/"


def members(epoch: int) -> str:
    return f"{PREFIX}members/{epoch}"


def reduction_group(epoch: int, place: int) -> str:
    """The prefix under which epoch ``epoch``'s reduction group of the ranks at ``place`` in their replica group
    meets (gloo's address exchange)."""
    return f"{PREFIX}q{epoch}/{place}/"


def replica_group(group: int) -> str:
    """The prefix under which replica group ``group``'s own process group meets (a group of several ranks)."""
    return f"{PREFIX}group{group}/"


def vote(step: int, epoch: int, rank: int) -> str:
    return f"{PREFIX}vote/{step}/{epoch}/{rank}"


def heartbeat(rank: int) -> str:
    return f"{PREFIX}beat/{rank}"


def left(group: int) -> str:
    """Why group ``group`` left: the launcher's words (``rank 1 killed by signal SIGKILL``)."""
    return f"{PREFIX}left/{group}"


def committed(step: int) -> str:
    """The sample shards of committed step ``step``, by group (the ledger's line, written by every member)."""
    return f"{PREFIX}commit/{step}"


def encode(groups: list[int]) -> str:
    return json.dumps(groups)


def decode(raw: bytes) -> list[int]:
    return [int(g) for g in json.loads(raw)]
