"""FSDP units: which modules become units, and one unit's sharded row and gathered parameters.

The machinery under :class:`shardwise.parallel.dp.fsdp_module.FSDPModule`: the wrap
policy (:func:`unit_modules`), a unit's parameter layout and collectives
(:class:`_Unit`, :class:`_Group`) and the move of a meta parameter onto a
real device (:func:`_to_device`). One role: it knows nothing of the
wrapper's hooks (``fsdp_module.py``) or of the strategies (``strategies/dp/fsdp.py``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.comm.streams import SideStream, pinned_like
from shardwise.parallel.dp.ddp import drop_grad
from shardwise.parallel.dp.sharding import (
    FlatLayout,
    Waitable,
    all_gather,
    local_numel,
    reduce_scatter,
)

WrapPolicy = Any  # "auto" | int | set/tuple/list of module classes | Callable[[str, nn.Module], bool]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


# ---- which modules become units ------------------------------------------
def unit_modules(root: nn.Module, wrap: WrapPolicy) -> list[nn.Module]:
    """The modules that become units under ``wrap`` (the root is always one, listed last).

    * ``"auto"``: every child of an ``nn.Sequential`` or ``nn.ModuleList`` that has
      parameters (transformer blocks, the layers of an MLP); if there is none,
      every direct child with parameters;
    * an ``int``: size-based, bottom-up: a module becomes a unit when the
      parameters not already in a unit below it number at least ``wrap``;
    * module classes (a set, tuple or list): every module of those classes;
    * a callable ``(qualified_name, module) -> bool``.

    Containers without a forward (``ModuleList``, ``ModuleDict``) never are units:
    their hooks would never run.
    """
    named = [(n, m) for n, m in root.named_modules() if m is not root and not isinstance(m, _CONTAINERS)]

    def has_params(m: nn.Module) -> bool:
        return any(p.requires_grad for p in m.parameters())

    if wrap == "auto":
        picked = [c for m in root.modules() if isinstance(m, (nn.Sequential, nn.ModuleList))
                  for c in m.children() if has_params(c) and not isinstance(c, _CONTAINERS)]
        if not picked:
            picked = [c for c in root.children() if has_params(c) and not isinstance(c, _CONTAINERS)]
        seen: set[int] = set()
        units = [m for m in picked if not (id(m) in seen or seen.add(id(m)))]  # type: ignore[func-returns-value]
    elif isinstance(wrap, bool):
        raise TypeError("wrap must be 'auto', an int, module classes or a callable, not a bool")
    elif isinstance(wrap, int):
        units = []
        left: dict[int, int] = {}

        def visit(m: nn.Module) -> int:
            n = sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
            n += sum(visit(c) for c in m.children())
            if m is not root and not isinstance(m, _CONTAINERS) and n >= wrap:
                units.append(m)
                n = 0
            left[id(m)] = n
            return n
        visit(root)
    elif isinstance(wrap, (set, frozenset, tuple, list)):
        classes = tuple(wrap)
        units = [m for _, m in named if isinstance(m, classes)]
    elif callable(wrap):
        units = [m for n, m in named if wrap(n, m)]
    else:
        raise TypeError(f"unknown wrap policy {wrap!r}; use 'auto', an int, module classes or a callable")
    return [m for m in units if m is not root] + [root]


# ---- one unit ---------------------------------------------------------------
# Parameters at least this big travel in collectives of their own, straight
# into and out of their own storage; smaller ones share one collective per
# unit through a packed buffer (one copy in, one copy out).
DIRECT_BYTES = 1 << 20


class _Group:
    """Parameters of a unit that travel in one collective, and where their pieces sit in the unit's row."""

    def __init__(self, members: list[int], numels: list[int], world: int, start: int) -> None:
        self.members = members
        self.layout = FlatLayout(numels, world)
        self.start = start
        self.end = start + self.layout.shard_numel
        self.direct = len(members) == 1


class _Unit:
    """One FSDP unit: its parameters' layout, this rank's shard row, and their gathered state."""

    def __init__(self, index: int, fqn: str, params: list[tuple[str, nn.Parameter]], comm: Comm,
                 how: str = "native") -> None:
        self.index = index
        self.how = how  # "native" or "p2p" collectives (see sharding.pick_collectives)
        self.fqn = fqn
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"unit '{fqn or '<root>'}' mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "every parameter of a unit must share one dtype (wrap its modules separately)")
        self.dtype = self.params[0].dtype
        self.comm = comm
        n = comm.size
        big = [i for i, p in enumerate(self.params) if p.numel() * p.element_size() >= DIRECT_BYTES]
        small = [i for i in range(len(self.params)) if i not in big]
        self.groups: list[_Group] = []
        start = 0
        for members in ([small] if small else []) + [[i] for i in big]:
            g = _Group(members, [self.params[i].numel() for i in members], n, start)
            self.groups.append(g)
            start = g.end
        self.row_numel = start
        self.chunk = [0] * len(self.params)   # padded piece of each parameter
        self.offset = [0] * len(self.params)  # where it starts in the row
        for g in self.groups:
            for j, i in enumerate(g.members):
                self.chunk[i] = g.layout.chunks[j]
                self.offset[i] = g.start + g.layout.offsets[j]
        self.device = torch.device("cpu")
        self.shard = torch.empty(0)
        self.padded: list[torch.Tensor] = []
        self.shard_params: list[nn.Parameter] = []
        self.grad_shard: torch.Tensor | None = None
        self.cleared: set[int] = set()  # parameters whose gradient a loop cleared since the last reduction landed
        # ZeRO-Offload: the optimizer's row lives here (None: it is ``shard`` itself).
        self.host: torch.Tensor | None = None
        self.host_version = -1
        self.offload_all = False
        self._src: torch.Tensor | None = None
        self.state = "sharded"  # "sharded" | "gathering" | "unsharded"
        self._side = SideStream(self.device)  # the all-gather stream: inert until allocate() puts us on CUDA
        self._gather: list[tuple[_Group, torch.Tensor | None, Waitable | None]] = []
        self.pending = 0
        self.backward_started = False
        self.got_grad = False

    def padded_views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded piece in a row (the shard, or the gradient shard), as views."""
        return [row[off:off + c] for off, c in zip(self.offset, self.chunk)]

    def allocate(self, device: torch.device) -> None:
        """The shard row and each parameter's (empty) padded full storage on ``device``."""
        self.device = device
        self._side = SideStream.shared(device, "fsdp.all_gather")
        self.shard = torch.zeros(self.row_numel, dtype=self.dtype, device=device)
        # The optimizer steps padded pieces (states of ceil(numel/N) elements on
        # every rank); the padding holds zeros with zero gradients, which every
        # element-wise optimizer leaves at zero, and is never read back anyway.
        self.shard_params = [nn.Parameter(v) for v in self.padded_views(self.shard)]
        self.padded = [torch.empty(self.comm.size * c, dtype=self.dtype, device=device) for c in self.chunk]
        for buf in self.padded:
            buf.untyped_storage().resize_(0)

    def take_shard(self, i: int, full: torch.Tensor) -> None:
        """Copy this rank's piece of parameter ``i`` (a full tensor) into the shard row."""
        r, c, off = self.comm.rank, self.chunk[i], self.offset[i]
        k = local_numel(self.params[i].numel(), self.comm.size, r)
        if k:
            self.shard[off:off + k].copy_(full.reshape(-1)[r * c:r * c + k])

    def point_to_padded(self, i: int) -> None:
        """Make parameter ``i`` a view of its padded storage (then freed): the full tensor is released."""
        p, buf = self.params[i], self.padded[i]
        storage = buf.untyped_storage()
        # A view can only be made of a storage big enough for it: allocate, view, free.
        storage.resize_(buf.numel() * buf.element_size())
        view = buf[:p.numel()].view(p.shape)
        if p.device.type == "meta":  # off the meta device first (see _to_device), with no memory of its own
            marks = dict(p.__dict__)  # (swap_tensors swaps the Python attributes too: an expert's spec)
            torch.utils.swap_tensors(p, nn.Parameter(buf.new_empty(0), requires_grad=p.requires_grad))
            p.__dict__.update(marks)
        # ``.data =``, not a swap: the parameter keeps its own version counter, which the gathers into the
        # padded storage must not advance (autograd checks it in backward).
        p.data = view
        storage.resize_(0)

    def offload_to(self, device: torch.device, everything: bool) -> None:
        """Move the optimizer's row to ``device``; ``everything``: keep no shard on the training device."""
        # Pinned when the shard lives on CUDA, so the copies to and from it can be non_blocking.
        self.host = pinned_like(self.shard, device, self.device)
        self.shard_params = [nn.Parameter(v) for v in self.padded_views(self.host)]
        self.host_version = self.host._version
        self.offload_all = everything
        if everything:
            self.shard = torch.empty(0, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def source(self) -> torch.Tensor:
        """This rank's up-to-date shard row on the training device, ready to be sent."""
        if self.host is None:
            return self.shard
        # CUDA from a pinned row: asynchronous copies, issued on the all-gather stream by start_gather.
        # Safe: the host row is only written again by the optimizer, after the backward's blocking
        # gradient copy to the host, which follows (through the compute stream) this copy.
        nb = self.device.type == "cuda"
        if self.offload_all:
            return self.host.to(self.device, non_blocking=nb)  # a temporary copy, freed after the gather
        # The row's version counter moves whenever the optimizer steps it or a
        # checkpoint loads into it: only then does the device copy need refreshing.
        if self.host._version != self.host_version:
            self.shard.copy_(self.host, non_blocking=nb)
            self.host_version = self.host._version
        return self.shard

    # ---- gather / free -----------------------------------------------------
    def start_gather(self) -> None:
        """Start the all-gathers of this unit's parameters (no-op when gathered or in flight)."""
        if self.state != "sharded":
            return
        n = self.comm.size
        for buf, c in zip(self.padded, self.chunk):
            if buf.untyped_storage().nbytes() == 0:
                buf.untyped_storage().resize_(n * c * buf.element_size())
        # A lone parameter's rank-major buffer *is* its padded storage: gather straight into it.
        # (Every output is allocated here, on the compute stream that will read it.)
        outs = [self.padded[g.members[0]] if g.direct else torch.empty(
            n * g.layout.shard_numel, dtype=self.dtype, device=self.device) for g in self.groups]
        # CUDA: the offloaded row's copy and the collectives are issued from the all-gather stream, so a
        # prefetch's copies do not queue between the compute kernels (no-op context on CPU).
        with self._side.enter(*self.padded, *outs):
            self._src = src = self.source()
            for g, out in zip(self.groups, outs):
                h = all_gather(self.comm, out, src[g.start:g.end], f"fsdp_all_gather.u{self.index}", self.how)
                self._gather.append((g, None if g.direct else out, h))
        self.state = "gathering"

    def unshard(self) -> None:
        """Full parameters available (waits for a prefetch in flight)."""
        if self.state == "unsharded":
            return
        if self.state == "sharded":
            self.start_gather()
        pending, self._gather = self._gather, []
        for g, buf, h in pending:
            if h is not None:
                h.wait()
            self._side.join()  # CUDA: the compute stream also waits for the all-gather stream's copies
            if buf is not None:
                with torch.no_grad():
                    g.layout.unpack_padded(buf, [self.padded[i] for i in g.members])
        self._src = None
        self.state = "unsharded"

    def reshard(self) -> None:
        """Free the full parameters (their storage shrinks to zero bytes)."""
        if self.state == "gathering":
            self.unshard()  # never free memory a collective is still writing into
        if self.state == "unsharded":
            for buf in self.padded:
                buf.untyped_storage().resize_(0)
            self.state = "sharded"

    @torch.no_grad()
    def start_reduce(self) -> tuple[torch.Tensor, list[Any]]:
        """Reduce-scatter the full gradients into a new gradient row; returns (row, in-flight work)."""
        n = self.comm.size
        out = torch.empty(self.row_numel, dtype=self.dtype, device=self.device)
        work: list[Any] = []
        for g in self.groups:
            grads = [self.params[i].grad for i in g.members]
            g0 = grads[0]
            if g.layout.identity and g0 is not None and g0.is_contiguous():
                staging = g0.view(-1)  # already rank-major: no packed copy
            else:
                staging = g.layout.pack(grads, torch.empty(n * g.layout.shard_numel, dtype=self.dtype,
                                                           device=self.device))
            h = reduce_scatter(self.comm, out[g.start:g.end], staging, f"fsdp_reduce_scatter.u{self.index}",
                               self.how)
            work.append((staging, h))  # the input must outlive the collective
        for p in self.params:
            drop_grad(p)
        return out, work

    def gather_full(self, keep: bool = True) -> list[torch.Tensor]:
        """Every parameter's full tensor, newly allocated (a blocking collective); ``keep=False``: none (this rank
        takes part in the all-gathers, each group's buffer freed before the next)."""
        fulls = [torch.empty(p.shape, dtype=p.dtype, device=self.device) for p in self.params] if keep else []
        src = self.source()
        for g in self.groups:
            buf = torch.empty(self.comm.size * g.layout.shard_numel, dtype=self.dtype, device=self.device)
            self.comm.all_gather(buf, src[g.start:g.end], name=f"fsdp_state_dict.u{self.index}")
            if keep:
                g.layout.unpack(buf, [fulls[i] for i in g.members])
        return fulls

    def set_grad_shard(self, buf: torch.Tensor | None) -> None:
        self.grad_shard = buf
        views = self.padded_views(buf) if buf is not None else [None] * len(self.params)
        for s, v in zip(self.shard_params, views):
            s.grad = v


def _to_device(p: nn.Parameter, device: torch.device) -> None:
    """Give ``p`` uninitialised memory on ``device``, keeping the Parameter object (hooks and names refer to it).

    ``p.data = ...`` cannot move a meta tensor to a real device (autograd
    rejects the change of tensor type), so a meta parameter swaps its whole
    contents with a fresh parameter instead.
    """
    fresh = torch.empty(p.shape, dtype=p.dtype, device=device)
    if p.device.type == "meta":
        torch.utils.swap_tensors(p, nn.Parameter(fresh, requires_grad=p.requires_grad))
    else:
        p.data = fresh
