"""Parameter server: server ranks own the weights and the optimizer, workers push gradients and pull weights.

Ranks ``0 .. servers-1`` are servers, the rest workers. The trainable
parameters, flattened into one vector, are cut into ``servers`` contiguous,
equal shards (Li et al. 2014, "Scaling Distributed Machine Learning with the
Parameter Server", OSDI: key ranges partitioned over server nodes), so no
single server carries all the traffic. A server keeps its shard as one flat
parameter and runs the user's optimizer on it; element-wise optimizers (SGD,
Adam, AdamW, ...) behave exactly as on the unflattened tensors.

Every worker step is ``pull`` (receive each server's shard, at the start of
the step) -> forward/backward on its slice of the global batch -> ``push``
(send each server its slice of the gradient, from ``optimizer.step()``). All of
it is point-to-point messages through :class:`~shardwise.comm.Comm`, so bytes
are exact. A push is one message: a 16-byte header (float64 step and
clipping bound) followed by the gradient bytes.

Synchronous mode waits for every worker's push, averages them (so a step is
the same optimisation as on one device), clips by the global norm (servers
exchange their shard norms), steps, and sends the new weights to everyone.

Asynchronous mode follows Downpour SGD (Dean et al. 2012, "Large Scale
Distributed Deep Networks", NIPS): every push is applied on its own, as soon
as it arrives, and the worker then pulls fresh weights; workers never wait for
each other. The *staleness* of an update is the number of other updates the
server applied between the worker's pull and its push. ``max_staleness`` bounds
it, in the spirit of Stale Synchronous Parallel (Ho et al. 2013, "More
Effective Distributed ML via a Stale Synchronous Parallel Parameter Server"):
a worker that would fall too far behind is made to wait (see
:class:`StalenessGate`). With several servers the first one decides the order
of applies and pulls and tells the others (16 bytes per decision), so a
version number means the same on every shard and the bound holds globally.

A worker that dies or hangs is reported by the server: every receive waits at
most the run's timeout and the error names the worker's rank.

Checkpoints (:meth:`ParameterServer.checkpoint_held`): a server writes its
range as the run of each parameter it overlaps and the same runs of its
optimizer states; the first worker writes the buffers and frozen parameters;
the trainer makes the servers serve in segments between the saves and join
each one (docs/classic.md, "Checkpoints under the parameter server").

This module holds the wrapper (:class:`PSModule`); the roles each rank runs
(worker, server, :class:`StalenessGate`) are :mod:`shardwise.parallel.ps.roles`,
and the strategy (``ParameterServer``) is :mod:`shardwise.strategies.ps`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.parallel.ps.roles import (
    APPLY,
    HEADER,
    PULL,
    StalenessGate,
    _Server,
    _Worker,
)

if TYPE_CHECKING:  # torch.distributed.checkpoint loads only when a checkpoint is made
    pass


# ---- the module and the strategy ------------------------------------------------------------
class PSModule(nn.Module):
    """The model as a rank of the parameter-server job sees it: the user's module plus its role."""

    def __init__(self, module: nn.Module, role: _Worker | _Server) -> None:
        super().__init__()
        self.module = module
        self.role = role

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.role, _Server):
            raise RuntimeError("a parameter-server rank holds no model replica to run forward on")
        return self.module(*args, **kwargs)


__all__ = ["PSModule", "StalenessGate", "HEADER", "APPLY", "PULL"]
