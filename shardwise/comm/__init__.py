"""Collectives with names, byte accounting and timeouts (every strategy talks through here)."""
from shardwise.comm.collectives import Comm, CommStats, Handle

__all__ = ["Comm", "CommStats", "Handle"]
