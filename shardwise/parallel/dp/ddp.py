"""Distributed data parallel, written on our communication layer.

Every rank holds the whole model and a different slice of the batch.
Gradients are averaged over the data-parallel group so every replica takes
the same optimizer step (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", describe the bucketing and overlap
reproduced here):

* parameters are grouped into fixed-size buckets in reverse registration
  order, roughly the order in which backward produces their gradients;
* each parameter's ``.grad`` is made a view into its bucket's flat buffer, so
  autograd accumulates straight into the buffer and no copy-out is needed;
* when the last gradient of a bucket arrives its all-reduce is started
  asynchronously, overlapping the rest of backward; buckets are always
  launched in index order so every rank issues identical collectives;
* the end of backward (an autograd engine callback) waits for the buckets.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.comm import Comm, Handle
from shardwise.comm.streams import SideStream
from shardwise.data import leaves
from shardwise.parallel.dp.buckets import DDP_BUCKET_MB
from shardwise.parallel.ep import is_expert
from shardwise.torch_private import at_backward_end, in_backward

AllReduceFn = Callable[[torch.Tensor, Comm, str], Handle]


def native_allreduce(t: torch.Tensor, comm: Comm, name: str) -> Handle:
    handle = comm.all_reduce(t, name=name, async_op=True)
    assert handle is not None
    return handle


def check_same_parameters(module: nn.Module, comm: Comm) -> None:
    """Raise on every rank, naming the first difference, if replicas differ in names or shapes.

    Metadata is exchanged with one all-gather, so every rank sees every other
    rank's list and raises the same error: nobody is left waiting in a later
    collective.
    """
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    everyone = comm.all_gather_object(mine, name="ddp.check")
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == ref:
            continue
        for i in range(max(len(ref), len(theirs))):
            a = ref[i] if i < len(ref) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                def fmt(x: Any) -> str:
                    return "nothing" if x is None else f"'{x[0]}' with shape {list(x[1])} ({x[2]})"
                raise ValueError(
                    f"model parameters differ across ranks: parameter #{i} is {fmt(a)} on rank 0 "
                    f"but {fmt(b)} on rank {comm.global_rank(r)}; every rank must build the same model")


def broadcast_module(module: nn.Module, comm: Comm, name: str = "ddp.broadcast",
                     expert_comm: Comm | None = None) -> None:
    """Make rank 0's parameters and buffers everyone's (one flat broadcast per dtype and group); expert-parallel
    parameters only over ``expert_comm`` (the ranks holding the same experts)."""
    for group, tensors in by_group(list(module.parameters()) + list(module.buffers()), comm, expert_comm):
        through_flat(tensors, lambda flat: group.broadcast(flat, src=0, name=name))


def through_flat(tensors: list[torch.Tensor], op: Callable[[torch.Tensor], object]) -> None:
    """Run ``op`` in place on one flat copy of ``tensors`` per dtype, then copy it back into them: one collective
    per dtype instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            op(flat)
            for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(piece.view_as(t))


def group_of(t: torch.Tensor, comm: Comm, expert_comm: Comm | None) -> Comm:
    """The group that replicates ``t``: ``expert_comm`` for an expert-parallel parameter when there is one (see
    :mod:`shardwise.parallel.ep`), ``comm`` for everything else."""
    return expert_comm if expert_comm is not None and is_expert(t) else comm


def by_group(tensors: list[torch.Tensor], comm: Comm, expert_comm: Comm | None) -> list[tuple[Comm, list[Any]]]:
    """``tensors`` split into (the group that replicates them, those tensors), by :func:`group_of`."""
    if expert_comm is None:
        return [(comm, tensors)]
    return [(g, [t for t in tensors if group_of(t, comm, expert_comm) is g]) for g in (comm, expert_comm)]


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype,
                 comm: Comm) -> None:
        self.index = index
        self.params = params
        self.comm = comm  # the group that holds these parameters (the experts' own for expert-parallel ones)
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
        self.views: list[torch.Tensor] = []
        off = 0
        for p in params:
            self.views.append(self.buffer[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.pending = len(params)
        self.handle: Handle | None = None
        self.wire: torch.Tensor | None = None  # the narrower copy in flight when reduce_dtype is set


def bucket_params(params: list[nn.Parameter], cap_mb: float) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into buckets of one dtype, one group (expert-parallel or not) and at most
    ``cap_mb`` MiB each (a bigger parameter alone): the one bucketer of DDP and ZeRO-1/2 (one collective per
    bucket)."""
    cap = int(cap_mb * 1024 * 1024)
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if (out and out[-1] and size + p.numel() * p.element_size() <= cap and p.dtype == out[-1][0].dtype
                and is_expert(p) == is_expert(out[-1][0])):
            out[-1].append(p)
            size += p.numel() * p.element_size()
        else:
            out.append([p])
            size = p.numel() * p.element_size()
    return out


_TENSOR_GRAD = torch.Tensor.grad  # the C attribute the watched parameters' property reads and writes through


class WatchedParameter(nn.Parameter):
    """A full parameter of a sharded wrapper whose ``p.grad = None`` reaches the wrapper.

    Under ZeRO-2, ZeRO-3 and FSDP the optimizer steps this rank's reduced piece of each gradient, kept apart from
    the full parameter (whose own ``.grad`` is freed once sent). A loop that clears gradients with
    ``for p in model.parameters(): p.grad = None`` writes the full parameters only, so without this the pieces
    would carry into the next step. The wrapper is told (:meth:`GradSync.forget_grad`) when a user's loop clears a
    gradient; the wrapper's own clears, inside backward, are not a user's.
    """

    @property
    def grad(self) -> torch.Tensor | None:
        return _TENSOR_GRAD.__get__(self)  # type: ignore[no-any-return,union-attr]

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _TENSOR_GRAD.__set__(self, value)  # type: ignore[union-attr]
        owner = self.__dict__.get("_shardwise_owner")
        forget = owner() if owner is not None else None
        if value is None and forget is not None and not in_backward():
            forget(self)


def drop_grad(p: torch.Tensor) -> None:
    """``p.grad = None`` by a wrapper itself: not a loop's clear, so a watched parameter's wrapper is not told."""
    _TENSOR_GRAD.__set__(p, None)  # type: ignore[union-attr]


def watch_clears(params: Iterable[nn.Parameter], forget: Callable[[nn.Parameter], None]) -> None:
    """Make ``params`` (plain Parameters) tell ``forget`` when a loop sets their gradient to None (weakly held)."""
    ref = weakref.WeakMethod(forget)
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = WatchedParameter
        if type(p) is WatchedParameter:
            p.__dict__["_shardwise_owner"] = ref


def forget_piece(params: list[nn.Parameter], pieces: list[nn.Parameter], cleared: set[int], p: nn.Parameter,
                 drop_all: Callable[[], None]) -> None:
    """A loop cleared full parameter ``p``'s gradient: zero its reduced piece (``pieces[i].grad``, a view of its
    group's shard gradient); once every parameter of the group (a ZeRO bucket, an FSDP unit) is cleared since the
    last reduction landed, ``drop_all`` sets the whole shard gradient to None, as ``zero_grad()`` would."""
    i = next(i for i, q in enumerate(params) if q is p)  # by identity: == would compare values
    cleared.add(i)
    if len(cleared) == len(params):
        drop_all()
        cleared.clear()
    elif pieces[i].grad is not None:
        pieces[i].grad.zero_()  # type: ignore[union-attr]


class GradSync:
    """``no_sync()`` for a wrapper whose gradient hooks communicate only while ``self._sync`` is set.

    Shared by DDP, ZeRO-1/2 and FSDP: inside the block each micro-batch's
    gradients accumulate locally and nothing is sent; the backward after the
    block sends the accumulated sum once.
    """

    _sync: bool = True
    _queued: bool = False
    _in_parts: bool = False

    def _finish(self) -> None:
        raise NotImplementedError

    def _on_grad(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def forget_grad(self, p: nn.Parameter) -> None:
        """A loop cleared ``p.grad`` (``p.grad = None``) outside backward: drop what this wrapper keeps of it.
        Nothing for a wrapper whose optimizer steps the full gradients themselves (DDP, ZeRO-1)."""

    def watch_user_clears(self) -> None:
        """Route a loop's ``p.grad = None`` on the full parameters to :meth:`forget_grad` (``sw.setup``'s model)."""
        module = getattr(self, "module", None)
        if type(self).forget_grad is not GradSync.forget_grad and isinstance(module, nn.Module):
            watch_clears(module.parameters(), self.forget_grad)

    def _hook_grads(self, params: Iterable[torch.Tensor]) -> list[RemovableHandle]:
        """Call ``self._on_grad(p)`` after each of ``params``' gradients is accumulated, holding the wrapper
        only weakly. A post-accumulate hook lives in autograd's C++ node, where Python's collector cannot see
        it, so a strong one (parameter -> hook -> wrapper -> module -> parameter) is a cycle never freed: on an
        H200 each finished ddp, fsdp or zero2 fit left its model, buckets and optimizer states allocated
        (8 GB of CUDA memory after a GPT-2 small run)."""
        ref = weakref.WeakMethod(self._on_grad)

        def hook(p: torch.Tensor) -> None:
            on_grad = ref()
            if on_grad is not None:
                on_grad(p)
        return [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _finish_at_backward_end(self) -> None:
        """Run ``self._finish`` once when the current backward pass ends (the wrapper's end-of-backward work:
        launch what is left, wait, reset); ``_finish`` clears ``_queued``. Inside :meth:`backward_in_parts`
        the end is that block's end, not the first autograd pass's."""
        if not self._queued:
            self._queued = True
            if not self._in_parts:
                at_backward_end(self._finish)

    @contextlib.contextmanager
    def backward_in_parts(self) -> Iterator[None]:
        """Several autograd passes that make one backward: a split backward's W (one pass per group of
        parameters, :mod:`shardwise.parallel.pp.split_backward`) ends its chunk's backward only after the last
        pass, so the end-of-backward work (wait for every bucket, check that none is missing) runs once,
        here, instead of after the first pass."""
        self._in_parts = True
        try:
            yield
        finally:
            self._in_parts = False
        if self._queued:
            self._finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no gradient communication inside this block."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old


class DDPModule(GradSync, nn.Module):
    """Wrap ``module`` so that backward leaves gradients averaged over ``comm``'s group."""

    def __init__(self, module: nn.Module, comm: Comm, bucket_cap_mb: float = DDP_BUCKET_MB,
                 find_unused_parameters: bool = False, allreduce: AllReduceFn = native_allreduce,
                 reduce_dtype: torch.dtype | None = None, expert_comm: Comm | None = None) -> None:
        super().__init__()
        # Gradients can travel in a narrower dtype than they are kept in (bf16 halves
        # the bytes); they are averaged in that dtype and widened back afterwards.
        self.reduce_dtype = reduce_dtype
        self.module = module
        self.comm = comm
        self.find_unused_parameters = find_unused_parameters
        self.allreduce = allreduce
        self._sync = True
        check_same_parameters(module, comm)
        broadcast_module(module, comm, expert_comm=expert_comm)

        names = {p: n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        # Reverse order: the last layers' gradients are ready first in backward. Expert-parallel parameters
        # are summed over their own group (expert_comm) but divided by the same dp size: see parallel/ep.py.
        self.buckets = [_Bucket(i, ps, ps[0].device, ps[0].dtype, group_of(ps[0], comm, expert_comm))
                        for i, ps in enumerate(bucket_params(list(reversed(params)), bucket_cap_mb))]
        self._where: dict[nn.Parameter, tuple[_Bucket, torch.Tensor]] = {}
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                self._where[p] = (b, v)
        self._names = names
        self._next = 0
        self._queued = False
        self._global_unused: set[nn.Parameter] = set()
        self._hooks = self._hook_grads(params)
        # CUDA only (inert on CPU): buckets are divided, cast and reduced on a side stream (docs/gpu.md).
        self._side = SideStream(self.buckets[0].buffer.device if self.buckets else torch.device("cpu"))

    # ---- public ------------------------------------------------------
    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Parameters, and the flat buckets the gradients live in for the whole run (whatever .grad shows)."""
        return {"params": list(self.module.parameters()), "grads": [b.buffer for b in self.buckets]}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self._sync and torch.is_grad_enabled():
            self._reset()
            if self.find_unused_parameters:
                self._mark_unused(out)
        return out

    @property
    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    # ---- internals ---------------------------------------------------
    def _reset(self) -> None:
        self._next = 0
        self._queued = False
        self._global_unused = set()
        for b in self.buckets:
            b.pending = len(b.params)
            b.handle = None

    def _mark_unused(self, out: Any) -> None:
        """Find parameters this forward did not reach, and agree across ranks which nobody used.

        Known before backward starts, so a locally unused parameter is treated
        as a ready zero gradient (its bucket can still launch on time), and a
        parameter unused on every rank keeps ``grad=None`` exactly as on a
        single device.
        """
        reached: set[int] = set()
        stack = [t.grad_fn for t in leaves(out) if t.grad_fn is not None]
        seen: set[Any] = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                reached.add(id(var))
            stack.extend(f for f, _ in fn.next_functions)  # type: ignore[misc]
        ordered = list(self._where)
        used = torch.tensor([1 if id(p) in reached else 0 for p in ordered], dtype=torch.int32,
                            device=self.buckets[0].buffer.device if self.buckets else None)
        self.comm.all_reduce(used, name="ddp.unused")
        for p, u_local, u_global in zip(ordered, [id(p) in reached for p in ordered], used.tolist()):
            if u_local:
                continue
            b, view = self._where[p]
            view.zero_()
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # keep what earlier no_sync micro-steps accumulated
            b.pending -= 1
            if u_global == 0:
                self._global_unused.add(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b, view = self._where[p]  # type: ignore[index]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self._finish_at_backward_end()
        b.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        n = self.comm.size
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            # CUDA: on the side stream, after the compute stream's gradients (a no-op context on CPU).
            with self._side.enter(b.buffer):
                # Pre-divide, then sum: the average without relying on ReduceOp.AVG,
                # which gloo lacks (torch DDP divides the same way).
                b.buffer.div_(n)
                wire = b.buffer
                if self.reduce_dtype is not None and self.reduce_dtype != b.buffer.dtype:
                    wire = b.wire = b.buffer.to(self.reduce_dtype)
                b.handle = self.allreduce(wire, b.comm, f"ddp.bucket{b.index}")
            self._next += 1

    def _finish(self) -> None:
        if self._next < len(self.buckets):
            missing = [self._names[p] for b in self.buckets[self._next:] for p in b.params
                       if p.grad is None or p.grad.data_ptr() != self._where[p][1].data_ptr()]
            raise RuntimeError(
                "DDP: these parameters received no gradient in this step, so their bucket can never be "
                f"all-reduced: {missing[:8]}{' ...' if len(missing) > 8 else ''}. Pass "
                "find_unused_parameters=True (sw.DDP(find_unused_parameters=True)) if parts of the model "
                "are legitimately unused in some steps.")
        # CUDA: wait and widen on the side stream, then the compute stream waits for it before the
        # optimizer reads the buckets (and before the next backward writes them). No-ops on CPU.
        with self._side.enter():
            for b in self.buckets:
                if b.handle is not None:
                    b.handle.wait()
                if b.wire is not None:
                    b.buffer.copy_(b.wire)
                    b.wire = None
        self._side.join()
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p in self._global_unused:
                    p.grad = None
                elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self._queued = False
