"""Fault tolerance: a dead replica group changes the run's time, not its model.

``options`` (what is asked, what a layout can survive), ``keys`` (the store's
keys, both sides), ``quorum`` (a rank's side: membership, reduction, vote,
heartbeat), ``shards`` (the global batch's fixed sample shards and who
computes which), ``replica`` (one group's step), ``supervise`` (the launcher's
side). See docs/concepts/fault-tolerance.md.
"""
