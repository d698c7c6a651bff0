"""The parameter server as a strategy (``strategy="ps"``): server ranks hold the parameters, workers train.

The roles (servers, workers, the staleness gate) are the mechanism in
:mod:`shardwise.parallel.ps.roles` and :mod:`shardwise.parallel.ps.module`; this
strategy lays them out on the dp group (servers first; only workers read
data), and saves and loads the servers' shards in the layout-free checkpoint.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.checkpoint.held import Held, named_state
from shardwise.comm.topology import Topology
from shardwise.dims import DP
from shardwise.layout import RunLayout
from shardwise.parallel.accounting import with_optimizer_states
from shardwise.parallel.dp.ddp import check_same_parameters
from shardwise.parallel.ps.module import PSModule
from shardwise.parallel.ps.roles import _Layout, _PushOptimizer, _Server, _Worker
from shardwise.step import LossFn, OptimizerFactory, StepRun, unwrap
from shardwise.strategies.base import HasServers

MODES = ("sync", "async")


@dataclass
class ParameterServer(HasServers):
    """Parameter server (``strategy="ps"``): ``servers`` server ranks plus ``devices - servers`` workers.

    Args:
        servers: server ranks; the parameters are split evenly over them.
        mode: ``"sync"`` (equal to single-device training) or ``"async"`` (Downpour-style).
        max_staleness: async only; the most updates another worker may apply between a
            worker's pull and its push (``None``: unbounded, ``0``: one update at a time).
    """

    servers: int = 1
    mode: str = "sync"
    max_staleness: int | None = None
    name: ClassVar[str] = "ps"

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers={self.servers}: a parameter server needs at least one server rank")
        if self.mode not in MODES:
            raise ValueError(f"unknown parameter-server mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.max_staleness is not None:
            if self.mode != "async":
                raise ValueError("max_staleness bounds asynchronous updates; use mode='async' with it")
            if self.max_staleness < 0:
                raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def layout(self, devices: int) -> RunLayout:
        # Servers and workers form the dp group; only the workers read data (RunLayout.batch_shards).
        if devices < self.servers + 1:
            raise ValueError(f"the parameter server with servers={self.servers} needs at least "
                             f"{self.servers + 1} devices (the servers plus one worker), got devices={devices}")
        return RunLayout(self.name, dp=devices, servers=self.servers)

    def is_server(self, topo: Topology) -> bool:
        return topo.coord(DP) < self.servers

    def owns_loss(self, topo: Topology) -> bool:
        return not self.is_server(topo)

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        # Servers read no data: -1 makes any attempt to give them a shard fail loudly.
        workers = topo.size(DP) - self.servers
        return workers, (topo.coord(DP) - self.servers if not self.is_server(topo) else -1)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        comm = topo.comm(DP)
        if comm.size < self.servers + 1:
            raise ValueError(f"the parameter server with servers={self.servers} needs at least "
                             f"{self.servers + 1} ranks, the group has {comm.size}")
        model = model.to(topo.device)
        check_same_parameters(model, comm)
        layout = _Layout(model, self.servers)
        if self.is_server(topo):
            s = topo.coord(DP)
            lo, hi = layout.ranges[s]
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1) for p in layout.params])
                shard = nn.Parameter(flat[lo:hi].clone())
            del flat
            # The server needs names and shapes only; the weights it serves live in the shard.
            model.to("meta")  # (this unties tied weights: the layout keeps one meta tensor per parameter, by name)
            on_meta = dict(model.named_parameters(remove_duplicate=False))
            layout.params = [on_meta[n] for n in layout.first_names]
            opt = optimizer_fn([shard])
            role: _Worker | _Server = _Server(comm, layout, s, self.servers, shard, self.mode, self.max_staleness)
            return PSModule(model, role), opt
        worker = _Worker(comm, layout, self.servers, self.mode)
        return PSModule(model, worker), _PushOptimizer(layout.params, worker)

    def param_names(self, model: nn.Module) -> dict[int, str]:
        """A server's one flat range spans many parameters: it takes the group of its first one (the checks
        before start refuse groups with different settings for this strategy, see ``splits_parameters``)."""
        role = model.role
        return {id(role.shard): role.layout.first_names[0]} if isinstance(role, _Server) else {}

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        role = model.role
        role.pull()  # type: ignore[operator,union-attr]  # fresh weights first; the push happens in optimizer.step()
        return super().train_step(model, micro_batches, loss_fn, topo, run)

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology, steps: int) -> list[float]:
        role: _Server = model.role  # type: ignore[assignment]
        if self.mode == "sync":
            return role.run_sync(optimizer, steps)
        return role.run_async(optimizer, steps)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        """Async: clip this worker's gradient, which is exactly the update applied.

        Sync: the update is the average over workers, which only the servers
        see; the bound travels with the push and the servers clip by the
        global norm. Returns this worker's local gradient norm.
        """
        role: _Worker = model.role  # type: ignore[assignment]
        params = role.layout.params
        if self.mode == "async":
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        role.clip = float(max_norm)
        grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.cat(grads)) if grads else torch.zeros((), device=topo.device)

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The servers' final weights, on every rank (each server broadcasts its shard).

        Buffers and frozen parameters are not served; they come from the first
        worker.
        """
        wrapper: PSModule = model  # type: ignore[assignment]
        comm, layout = topo.comm(DP), wrapper.role.layout
        dev = topo.device
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=dev)
        for s, (lo, hi) in enumerate(layout.ranges):
            if isinstance(wrapper.role, _Server) and wrapper.role.index == s:
                flat[lo:hi].copy_(wrapper.role.shard.detach())
            comm.broadcast(flat[lo:hi], src=s, name="ps.final")
        inner = unwrap(wrapper)
        out: dict[str, torch.Tensor] = {}
        for k, v in inner.state_dict().items():
            if k in layout.names:
                i = layout.names[k]
                off = layout.offsets[i]
                out[k] = flat[off:off + v.numel()].view(v.shape).cpu().clone()
            else:
                t = v.detach().to(dev) if v.device.type != "meta" else torch.empty(v.shape, dtype=v.dtype, device=dev)
                t = t.contiguous()
                comm.broadcast(t, src=self.servers, name="ps.final")
                out[k] = t.cpu().clone()
        return out

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """What this rank holds of the layout-free checkpoint (:mod:`shardwise.checkpoint.pieces`).

        A server: for every parameter its range ``[lo, hi)`` overlaps, the run of
        that parameter (flattened) it holds, as a 1-D view of its shard, and the
        same run of each optimizer state (0-dim states such as Adam's ``step``
        whole, under every parameter it touches). The first worker (rank
        ``servers``): the buffers and frozen parameters, whole (the servers do not
        serve them). Other workers hold nothing: their trainable weights are the
        servers' (pulled at every step), their optimizer keeps no state.
        """
        role = model.role
        if isinstance(role, _Server):
            return _server_held(role, optimizer)
        if topo.coord(DP) != self.servers:
            return []
        trainable = {id(p) for p in role.layout.params}  # type: ignore[union-attr]
        return [Held(f"model.{name}", t.detach()) for name, t in named_state(unwrap(model)) if id(t) not in trainable]

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        role = model.role
        if isinstance(role, _Server):
            return with_optimizer_states({"params": [role.shard], "grads": [role.shard.grad]}, optimizer)  # type: ignore[list-item]
        params = role.layout.params  # type: ignore[union-attr]
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": []}  # type: ignore[dict-item,union-attr]

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        """Servers: the staleness of every update they applied, and which worker pushed it."""
        role = model.role
        if isinstance(role, _Server):
            return {"role": "server", "staleness": list(role.staleness), "applied_by": list(role.applied_by)}
        return {"role": "worker"}


def _server_held(role: _Server, optimizer: torch.optim.Optimizer) -> list[Held]:
    """A server's pieces: per parameter of its range, the run of it and of each optimizer state (live views)."""
    shard = role.shard.detach()
    states = [(k, v) for k, v in optimizer.state.get(role.shard, {}).items() if isinstance(v, torch.Tensor)]
    for k, v in states:
        if v.dim() > 0 and v.shape != shard.shape:
            raise ValueError(f"the parameter server cannot checkpoint the optimizer state {k!r} of shape "
                             f"{list(v.shape)}: a server's states must be scalars or element-wise (the shape of its "
                             f"shard, {list(shard.shape)}), as with SGD, Adam and AdamW")
    out: list[Held] = []
    for i, a, b, n in role.layout.pieces(role.index):
        name = role.layout.first_names[i]
        out.append(Held(f"model.{name}", shard[b:b + n], a))
        for k, v in states:
            out.append(Held(f"optim.{name}.{k}", v, 0) if v.dim() == 0 else Held(f"optim.{name}.{k}", v[b:b + n], a))
    return out
