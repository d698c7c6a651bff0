"""Collectives with names, byte accounting, timeouts and diagnostics (every strategy talks through here)."""
from shardwise.comm.collectives import Comm, CommStats, Handle
from shardwise.comm.diagnostics import (
    CollectiveMismatch,
    CollectiveTimeout,
    Diagnostics,
)

__all__ = ["CollectiveMismatch", "CollectiveTimeout", "Comm", "CommStats", "Diagnostics", "Handle"]
