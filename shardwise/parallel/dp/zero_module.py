"""The ZeRO-1/2 wrapper: :class:`ZeROModule` and its gradient buckets (:class:`_Bucket`).

What a model wrapped for ZeRO stage 1 or 2 is (the stages are described in
:mod:`shardwise.parallel.dp.zero`): its parameters in buckets, each bucket with
this rank's shard parameters (views of the full parameters where possible)
and, under ZeRO-Offload, a master row on the offload device; the hooks that
reduce-scatter a bucket's gradients while backward runs; and the all-gather
of the updated pieces after the optimizer step.

The wrapper is this module's one role: the
:class:`~shardwise.parallel.dp.zero.ShardedOptimizer` shared with FSDP and the
offload and clipping helpers are in ``zero.py``; the strategies (``ZeRO1``,
``ZeRO2``) in :mod:`shardwise.strategies.dp.zero`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from shardwise.comm import Comm
from shardwise.parallel.dp.buckets import ZERO_BUCKET_MB
from shardwise.parallel.dp.ddp import (
    GradSync,
    bucket_params,
    by_group,
    check_same_parameters,
    drop_grad,
    forget_piece,
    group_of,
)
from shardwise.parallel.dp.sharding import (
    FlatLayout,
    Waitable,
    all_gather,
    broadcast_inplace,
    pick_collectives,
    reduce_scatter,
    shard_parts,
)


class _Bucket:
    """Parameters reduced and gathered together, with their shard layout and in-flight buffers."""

    def __init__(self, index: int, params: list[nn.Parameter], comm: Comm,
                 offload: torch.device | None = None) -> None:
        self.index = index
        self.params = params
        self.comm = comm  # the group these parameters are sharded over (the experts' own for expert-parallel ones)
        world, rank = comm.size, comm.rank
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
            # Pinned when the parameters are on CUDA, so the copy back to the device can be non_blocking.
            self.host = torch.zeros(self.layout.shard_numel, dtype=p0.dtype, device=offload,
                                    pin_memory=torch.device(offload).type == "cpu" and p0.device.type == "cuda")
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
        self.cleared: set[int] = set()  # parameters whose gradient a loop cleared since the last reduction landed
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
    their gradients roughly in that order), as in :mod:`shardwise.parallel.dp.ddp`.
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

    def __init__(self, module: nn.Module, comm: Comm, stage: int = 2, bucket_cap_mb: float = ZERO_BUCKET_MB,
                 collectives: str = "auto", offload_device: torch.device | str | None = None,
                 expert_comm: Comm | None = None) -> None:
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
        for group, tensors in by_group(list(module.parameters()) + list(module.buffers()), comm, expert_comm):
            broadcast_inplace(tensors, group, name="zero_broadcast")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            if not p.is_contiguous():
                raise ValueError(f"parameter '{n}' is not contiguous; ZeRO shards flattened parameters")
        self.names = {p: n for n, p in named}
        # Expert-parallel parameters are sharded and reduced over their own group (expert_comm), and divided
        # by the same dp size as the rest (see parallel/ep.py).
        self.buckets = [_Bucket(i, ps, group_of(ps[0], comm, expert_comm), self.offload)
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
        self._hooks = self._hook_grads(p for _, p in named)

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

    def shard_sources(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each shard parameter the optimizer steps -> the model's parameter it is a piece of."""
        return {s: p for b in self.buckets for p, s in zip(b.params, b.shards)}

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
            return {"params": params, "grads": grads + self.shard_grads()}  # type: ignore[dict-item]
        # Offloaded: the master rows, gradient shards and optimizer states are host memory.
        return {
            "params": params,  # type: ignore[dict-item]
            "grads": grads,
            "host_params": [b.host for b in self.buckets if b.host is not None],
            "host_grads": self.shard_grads(),
        }

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, list[tuple[str, int, Tensor]]]:
        """This rank's optimizer-state pieces of each parameter (the parameters themselves are whole here)."""
        return {p: shard_parts(s, b.rank * c, k, optimizer, with_param=False)
                for b in self.buckets for p, s, c, k in zip(b.params, b.shards, b.layout.chunks, b.locals)}

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
        prev: tuple[_Bucket, torch.Tensor, torch.Tensor | None, Waitable | None] | None = None
        for b in self.buckets:
            p0, n = b.params[0], b.comm.size
            name = f"zero_all_gather.b{b.index}"
            if b.host is not None:
                # Offloaded: the updated master row comes back to the device, then travels.
                # (CUDA, pinned row: asynchronous; the row is next written after the blocking gradient copy.)
                send = b.host.to(p0.device, non_blocking=p0.device.type == "cuda")
                if b.layout.identity:
                    h = all_gather(b.comm, p0.data.view(-1), send, name, self.how)
                    recv = None
                else:
                    recv = torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                    h = all_gather(b.comm, recv, send, name, self.how)
            elif b.layout.identity:
                # The optimizer updated this rank's slot of the parameter in place: gather
                # the other slots around it, with no send or receive buffer and no copy.
                send = b.shards[0].detach()
                h = all_gather(b.comm, p0.data.view(-1), send, name, self.how)
                recv = None
            else:
                # The optimizer's pieces, padding included, are what every rank sends.
                send = torch.empty(b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                for dst, piece in zip(b.layout.padded_views(send), b.shards):
                    dst.copy_(piece.detach())
                recv = torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
                h = all_gather(b.comm, recv, send, name, self.how)
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

    def forget_grad(self, p: nn.Parameter) -> None:
        b = self._where.get(p)
        if self.stage == 2 and b is not None and b.grad_shard is not None:
            forget_piece(b.params, b.shards, b.cleared, p, lambda: self._set_shard_grads(b, None))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.cleared.clear()
            for p in b.params:
                if p.grad is not None:
                    if set_to_none:
                        drop_grad(p)
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
        for b in self.buckets:
            r = b.rank
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
        n, p0 = b.comm.size, b.params[0]
        g0 = p0.grad
        if b.layout.identity and g0 is not None and g0.is_contiguous():
            staging = g0.view(-1)  # already rank-major: reduce-scatter it in place of a packed copy
        else:
            staging = b.layout.pack([p.grad for p in b.params],
                                    torch.empty(n * b.layout.shard_numel, dtype=p0.dtype, device=p0.device))
        if self.stage == 2:
            for p in b.params:
                drop_grad(p)  # the point of stage 2: the full gradient is gone once sent
        out = torch.empty(b.layout.shard_numel, dtype=p0.dtype, device=p0.device)
        h = reduce_scatter(b.comm, out, staging, f"zero_reduce_scatter.b{b.index}", self.how)
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
        # Sum then divide: the mean over ranks without ReduceOp.AVG, which gloo lacks. Always by the whole dp
        # group's size: an expert bucket's sum over its edp ranks holds ep ranks' tokens each (parallel/ep.py).
        out.div_(self.comm.size)
        if self.offload is not None:
            out = out.to(self.offload)  # ZeRO-Offload: the gradient shard goes where the optimizer runs
        if b.grad_shard is None or self.stage == 1:
            self._set_shard_grads(b, out)
        else:
            b.grad_shard.add_(out)
        b.cleared.clear()

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
