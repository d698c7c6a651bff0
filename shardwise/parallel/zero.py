"""ZeRO stages 1 and 2: optimizer states (and gradients) sharded over data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20), section 5: with ``N`` data-parallel ranks,

* stage 1 (P_os) keeps the full parameters and gradients on every rank but only
  ``1/N`` of the optimizer states; each rank updates its ``1/N`` of the
  parameters and the updated pieces are all-gathered;
* stage 2 (P_os+g) also keeps only ``1/N`` of the gradients: they are
  reduce-scattered in buckets while backward runs, and the full gradient of a
  bucket is freed as soon as it has been sent.

Both move ``2 x (N-1)/N x Psi`` bytes per rank and step (section 7.2: a
reduce-scatter of the gradients plus an all-gather of the parameters), the same
as plain data parallelism's all-reduce.

The optimizer is never re-implemented: the user's factory builds a real
``torch.optim`` optimizer over *shard parameters*, views of this rank's piece
of each full parameter (see :mod:`shardwise.parallel.sharding` for the layout),
so its update rule runs unchanged on the piece, and writes straight into the
full parameter before the all-gather spreads it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.parallel.ddp import GradSync, bucket_params, check_same_parameters
from shardwise.parallel.sharding import (FlatLayout, Waitable, all_gather, broadcast_inplace,
                                         pick_collectives, reduce_scatter, sharded_dtensor)
from shardwise.layout import RunLayout
from shardwise.strategy import OptimizerFactory, Strategy, unwrap
from shardwise.topology import Topology


class ShardedOptimizer(torch.optim.Optimizer):
    """A real torch optimizer over shard parameters, with the communication its step needs around it.

    ``param_groups`` and ``state`` are the inner optimizer's own (so learning-rate
    schedulers work); ``.optimizer`` is the inner optimizer. ``owner`` is the
    wrapped model, which knows how to finish the gradients before the update
    (:meth:`before_step`), spread the updated parameters after it
    (:meth:`after_step`) and drop gradients (:meth:`zero_grad`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: Any) -> None:
        # The base __init__ would build param_groups of its own; we share the inner optimizer's instead.
        self.optimizer = optimizer
        self.owner = owner
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.owner.before_step()
        self.optimizer.step()
        self.owner.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.owner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (torch layout); see ``checkpoint_state`` for the global one."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("a sharded optimizer's parameters are fixed by the model it was set up with")

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer!r})"


class _Bucket:
    """Parameters reduced and gathered together, with their shard layout and in-flight buffers."""

    def __init__(self, index: int, params: list[nn.Parameter], world: int, rank: int,
                 offload: torch.device | None = None) -> None:
        self.index = index
        self.params = params
        self.layout = FlatLayout([p.numel() for p in params], world)
        self.rank = rank
        # This rank's padded piece of each parameter, for the optimizer. Where
        # the piece is whole it is a view of the full parameter (no memory of
        # its own, and the update lands in place); only a piece cut short by
        # the end of a parameter (numel not divisible by N) is a small padded
        # copy. Either way the optimizer's states have ceil(numel/N) elements.
        self.locals = self.layout.local_numels(rank)
        self.copies: list[nn.Parameter] = []
        self.shards: list[nn.Parameter] = []
        # ZeRO-Offload: the optimizer steps a master row of this rank's pieces on the offload device.
        self.host: torch.Tensor | None = None
        if offload is not None:
            p0 = params[0]
            self.host = torch.zeros(self.layout.shard_numel, dtype=p0.dtype, device=offload)
            self.layout.shard_from_full([p.detach() for p in params], rank, self.host)
            self.shards = [nn.Parameter(v) for v in self.layout.padded_views(self.host)]
            self.versions = self.param_versions()
        for p, c, k in zip(params if offload is None else [], self.layout.chunks, self.locals):
            flat = p.detach().view(-1)
            if k == c:
                self.shards.append(nn.Parameter(flat[rank * c:rank * c + c]))
            else:
                piece = torch.zeros(c, dtype=p.dtype, device=p.device)
                piece[:k].copy_(flat[rank * c:rank * c + k])
                self.shards.append(nn.Parameter(piece))
                self.copies.append(self.shards[-1])
        self.grad_shard: torch.Tensor | None = None
        self.pending = len(params)
        self.launched = False

    def param_versions(self) -> list[int]:
        """The full parameters' in-place version counters: a change means someone wrote them."""
        return [p._version for p in self.params]

    @torch.no_grad()
    def refresh_host(self) -> None:
        """Re-read the offloaded master row if the full parameters were written since (e.g. a checkpoint load)."""
        if self.host is not None and self.param_versions() != self.versions:
            self.layout.shard_from_full([p.detach() for p in self.params], self.rank, self.host)
            self.versions = self.param_versions()


class ZeROModule(GradSync, nn.Module):
    """Wrap ``module`` for ZeRO stage 1 or 2 over ``comm``'s data-parallel group.

    Parameters are bucketed in reverse registration order (backward produces
    their gradients roughly in that order), as in :mod:`shardwise.parallel.ddp`.
    Both stages start a bucket's reduce-scatter from a post-accumulate-grad
    hook as soon as all its gradients exist, so the communication overlaps the
    rest of backward, and keep at most one bucket in flight while packing the
    next. Stage 2 then frees the full gradients (so the full gradients of at
    most two buckets exist at any time); stage 1 keeps them, and its reduced
    pieces are *replaced* (not added to) by each reduction, since they are
    reduced from the full, already accumulated gradients. When no backward
    reduced them (every backward ran under ``no_sync``), stage 1 reduces at
    the optimizer step (or the clip) instead.
    """

    def __init__(self, module: nn.Module, comm: Comm, stage: int = 2, bucket_cap_mb: float = 4.0,
                 collectives: str = "auto", offload_device: torch.device | str | None = None) -> None:
        super().__init__()
        self.how = pick_collectives(collectives, comm)
        self.offload = torch.device(offload_device) if offload_device is not None else None
        if stage not in (1, 2):
            raise ValueError(f"ZeROModule implements stages 1 and 2, got stage={stage}")
        self.module = module
        self.comm = comm
        self.stage = stage
        self._sync = True
        check_same_parameters(module, comm)
        broadcast_inplace(module, comm, name="zero_broadcast")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            if not p.is_contiguous():
                raise ValueError(f"parameter '{n}' is not contiguous; ZeRO shards flattened parameters")
        self.names = {p: n for n, p in named}
        self.buckets = [_Bucket(i, ps, comm.size, comm.rank, self.offload)
                        for i, ps in enumerate(bucket_params([p for _, p in reversed(named)], bucket_cap_mb))]
        self._where = {p: b for b in self.buckets for p in b.params}
        shard_of = {p: s for b in self.buckets for p, s in zip(b.params, b.shards)}
        # Model order, so that a factory that builds parameter groups by position sees the model's order.
        self.shard_params: list[nn.Parameter] = [shard_of[p] for _, p in named]
        self.shard_names = {shard_of[p]: n for n, p in named}
        self._reduced = False
        self._armed = False
        self._next = 0
        self._queued = False
        self._inflight: tuple[_Bucket, torch.Tensor, torch.Tensor, Waitable | None] | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]

    # ---- public --------------------------------------------------------
    # no_sync() (GradSync): the full gradients accumulate locally, nothing is reduce-scattered.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync and torch.is_grad_enabled():
            self._reset()
            # Only a backward that follows a forward through this wrapper reduces in
            # its hooks (their bucket counts were just reset); any other gradient
            # (e.g. pipeline chunks run directly, composition) is reduced at the step.
            self._armed = True
        return self.module(*args, **kwargs)

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient pieces (one flat padded buffer per bucket)."""
        return [b.grad_shard for b in self.buckets if b.grad_shard is not None]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Full parameters and gradients, the reduced pieces, and (offloaded) the host rows."""
        full = list(self.module.parameters())
        # The padded copies of pieces cut short by a parameter's end are parameter memory too.
        params = full + [c for b in self.buckets for c in b.copies]
        grads = [p.grad for p in full if p.grad is not None]
        if self.offload is None:
            return {"params": params, "grads": grads + self.shard_grads()}
        # Offloaded: the master rows, gradient shards and optimizer states are host memory.
        return {"params": params, "grads": grads, "host_params": [b.host for b in self.buckets if b.host is not None],
                "host_grads": self.shard_grads()}

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(reduced gradient piece, the parameter it belongs to) for every piece this rank holds."""
        return [(s.grad, p) for b in self.buckets for p, s in zip(b.params, b.shards) if s.grad is not None]

    # ---- called by ShardedOptimizer ------------------------------------
    def before_step(self) -> None:
        """Make sure the shard gradients hold the reduced (averaged) gradient."""
        self._refresh_copies()
        if self.stage == 1 and not self._reduced:
            for b in self.buckets:
                self._launch(b)
            self._drain()
            self._reduced = True

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every rank's updated pieces into the full parameters (one bucket in flight)."""
        n = self.comm.size
        prev: tuple[_Bucket, torch.Tensor, torch.Tensor | None, Waitable | None] | None = None
        for b in self.buckets:
            p0 = b.params[0]
            name = f"zero_all_gather.b{b.index}"
            if b.host is not None:
                # Offloaded: the updated master row comes back to the device, then travels.
                send = b.host.to(p0.device)
                if b.layout.identity:
                    h = all_gather(self.comm, p0.data.view(-1), send, name, self.how)
                    recv = None
                else:
                    recv = torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                    h = all_gather(self.comm, recv, send, name, self.how)
            elif b.layout.identity:
                # The optimizer updated this rank's slot of the parameter in place: gather
                # the other slots around it, with no send or receive buffer and no copy.
                send = b.shards[0].detach()
                h = all_gather(self.comm, p0.data.view(-1), send, name, self.how)
                recv = None
            else:
                # The optimizer's pieces, padding included, are what every rank sends.
                send = torch.empty(b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                for dst, piece in zip(b.layout.padded_views(send), b.shards):
                    dst.copy_(piece.detach())
                recv = torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                h = all_gather(self.comm, recv, send, name, self.how)
            if prev is not None:
                self._unpack(prev)
            prev = (b, send, recv, h)
        if prev is not None:
            self._unpack(prev)
        if self.stage == 1:
            # Stage 1's reduced pieces live only for the step: the full gradients are what it keeps.
            for b in self.buckets:
                self._set_shard_grads(b, None)
        for b in self.buckets:
            if b.host is not None:
                b.versions = b.param_versions()  # our own write: the master row is already this
        self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
            if set_to_none:
                self._set_shard_grads(b, None)
            elif b.grad_shard is not None:
                b.grad_shard.zero_()
        self._reduced = False

    # ---- internals -----------------------------------------------------
    @torch.no_grad()
    def _refresh_copies(self) -> None:
        """Re-read the padded copies from the full parameters, which are the truth (e.g. after a checkpoint load)."""
        r = self.comm.rank
        for b in self.buckets:
            if b.host is not None:
                b.refresh_host()
                continue
            for p, s, c, k in zip(b.params, b.shards, b.layout.chunks, b.locals):
                if k < c and k:
                    s[:k].copy_(p.detach().view(-1)[r * c:r * c + k])

    def _unpack(self, item: tuple[_Bucket, torch.Tensor, torch.Tensor | None, Waitable | None]) -> None:
        b, _send, recv, h = item
        if h is not None:
            h.wait()
        if recv is not None:
            b.layout.unpack(recv, [p.data for p in b.params])

    def _set_shard_grads(self, b: _Bucket, buf: torch.Tensor | None) -> None:
        b.grad_shard = buf
        views = b.layout.padded_views(buf) if buf is not None else [None] * len(b.shards)
        for s, v in zip(b.shards, views):
            s.grad = v

    def _reset(self) -> None:
        self._next = 0
        self._queued = False
        for b in self.buckets:
            b.pending = len(b.params)
            b.launched = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync or (self.stage == 1 and not self._armed):
            # Stage 1's full gradients changed after any earlier reduction: reduce again at the step.
            self._reduced = False
            return
        b = self._where[p]  # type: ignore[index]
        self._finish_at_backward_end()
        b.pending -= 1
        # Buckets always start in index order, so every rank issues the same collectives.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        """Pack a bucket's full gradients rank-major and start their reduce-scatter (one in flight)."""
        n, p0 = self.comm.size, b.params[0]
        g0 = p0.grad
        if b.layout.identity and g0 is not None and g0.is_contiguous():
            staging = g0.view(-1)  # already rank-major: reduce-scatter it in place of a packed copy
        else:
            staging = b.layout.pack([p.grad for p in b.params],
                                    torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device))
        if self.stage == 2:
            for p in b.params:
                p.grad = None  # the point of stage 2: the full gradient is gone once sent
        out = torch.empty(b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
        h = reduce_scatter(self.comm, out, staging, f"zero_reduce_scatter.b{b.index}", self.how)
        b.launched = True
        self._drain()
        self._inflight = (b, staging, out, h)

    def _drain(self) -> None:
        """Wait for the bucket in flight and add its (averaged) piece to the shard gradient."""
        if self._inflight is None:
            return
        b, _staging, out, h = self._inflight
        self._inflight = None
        if h is not None:
            h.wait()
        # Sum then divide: the mean over ranks without ReduceOp.AVG, which gloo lacks.
        out.div_(self.comm.size)
        if self.offload is not None:
            out = out.to(self.offload)  # ZeRO-Offload: the gradient shard goes where the optimizer runs
        if b.grad_shard is None or self.stage == 1:
            self._set_shard_grads(b, out)
        else:
            b.grad_shard.add_(out)

    def _finish(self) -> None:
        # Buckets whose parameters got no gradient this step still take part
        # (as zeros), in index order, so that no rank waits for a collective
        # another rank never starts.
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        self._drain()
        self._queued = False
        self._reduced = True
        self._armed = False


OFFLOADS = ("none", "optimizer", "all")


def check_offload(offload: str, strategy: str, stage: int) -> None:
    """Reject an unknown offload, or one this stage cannot do, when the strategy object is made."""
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if offload == "all" and stage < 3:
        raise ValueError(f"offload='all' moves the parameter shards to the host too, but strategy {strategy!r} "
                         "keeps full parameters on every device; use offload='optimizer' with it, or "
                         "'zero3'/'fsdp'/'hsdp' for offload='all'")


def _check_not_meta(model: nn.Module, name: str) -> None:
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"strategy {name!r} keeps full parameters on every rank, so it cannot set up a model "
                         "on the meta device; use 'zero3' or 'fsdp', which materialise it shard by shard")


def zero_clip_grad_norm(grads: Sequence[torch.Tensor], max_norm: float, comm: Comm, name: str,
                        device: torch.device | None = None) -> torch.Tensor:
    """Clip sharded gradients by the norm of the whole (global) gradient.

    Each rank holds disjoint pieces (padding is zero), so the squared norms add
    up over ``comm``'s group: one all-reduce of a scalar, on ``device`` (the
    communication device; offloaded gradients live elsewhere).
    """
    from shardwise.parallel.sharding import clip_global_norm

    here = grads[0].device if grads else (device or torch.device("cpu"))
    return clip_global_norm(grads, grads, max_norm, [(comm, name)], device or here)


@dataclass
class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer states sharded; full parameters and gradients on every rank.

    Gradients are reduce-scattered in buckets while backward runs (overlapping
    it, as DDP's all-reduce does) and every rank keeps its full local
    gradients as well. Under ``no_sync`` nothing is sent and the last
    micro-batch's backward reduces the accumulated gradients; if every
    backward ran under ``no_sync`` the reduction happens at the optimizer step
    (or at gradient clipping, which needs it first).

    Args:
        bucket_cap_mb: parameters are reduced and gathered in buckets of about this size.
        collectives: ``"native"`` (the backend's reduce-scatter and all-gather),
            ``"p2p"`` (pairwise isend/irecv exchange, same bytes) or ``"auto"``
            (p2p on gloo, whose reduce-scatter is slow; native otherwise).
        offload: ``"optimizer"`` keeps this rank's master pieces, gradient
            pieces and optimizer states on ``offload_device`` and runs the
            update there (ZeRO-Offload, Ren et al. 2021); ``"none"`` (default)
            keeps everything on the training device. ``"all"`` needs sharded
            parameters (``ZeRO3``/``FSDP``/``HSDP``) and is an error here.
        offload_device: where offloaded state lives (default ``"cpu"``).
    """

    bucket_cap_mb: float = 4.0
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_offload(self.offload, self.name, self.stage)

    def describe(self, devices: int) -> RunLayout:
        return replace(super().describe(devices), zero=self.stage, offload=self.offload)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        from shardwise.parallelize import DataParallelOptions, wrap_module

        _check_not_meta(model, self.name)
        opts = DataParallelOptions(zero=self.stage, bucket_cap_mb=self.bucket_cap_mb, collectives=self.collectives,
                                   offload=self.offload, offload_device=self.offload_device)
        wrapped = wrap_module(model.to(topo.device), topo, opts)
        return wrapped, ShardedOptimizer(optimizer_fn(wrapped.shard_params), wrapped)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        zm: ZeROModule = model  # type: ignore[assignment]
        zm.before_step()
        return zero_clip_grad_norm(zm.shard_grads(), max_norm, zm.comm, "zero_clip", device=topo.device)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                         topo: Topology) -> dict[str, Any]:
        """Parameters and buffers replicated (plain views); optimizer states as ``Shard(0)`` DTensors."""
        zm: ZeROModule = model  # type: ignore[assignment]
        inner = unwrap(model)
        mesh = topo.mesh["dp"] if topo.mesh is not None else None  # type: ignore[index]
        from torch.distributed.tensor import Shard

        out: dict[str, Any] = {}
        for n, p in inner.named_parameters():
            out[f"model.{n}"] = p.detach().view(-1)
        for b in zm.buckets:
            for p, s, k in zip(b.params, b.shards, b.locals):
                n = zm.names[p]
                for key, v in optimizer.state.get(s, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"optim.{n}.{key}"] = v if v.dim() == 0 else \
                            sharded_dtensor(v.view(-1)[:k], p.numel(), mesh, [Shard(0)])
        for n, buf in inner.named_buffers():
            out[f"model.{n}"] = buf.view(-1)
        return out


@dataclass
class ZeRO2(ZeRO1):
    """ZeRO stage 2: optimizer states and gradients sharded.

    Buckets are reduce-scattered while backward runs (overlapping it) and each
    rank keeps only its piece of the gradient. Under ``no_sync`` the full
    gradients accumulate locally and the last micro-batch's backward sends
    them, so accumulation costs no extra communication (it does hold the full
    gradients during the accumulation, as FSDP2 does).
    """

    name: ClassVar[str] = "zero2"
    stage: ClassVar[int] = 2
