"""Per-parameter flat sharding shared by ZeRO-1/2/3, FSDP and HSDP.

Every parameter is flattened to 1-D and cut into ``N`` equal pieces of
``c = ceil(numel / N)`` elements, zero-padded at the end; rank ``r`` owns
elements ``[r*c, (r+1)*c)`` (FSDP2's per-parameter sharding, Zhao et al. 2023,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", and the
torch.distributed ``fully_shard`` redesign). Without the padding, rank ``r``
holds ``torch.chunk`` of the flattened parameter: the last ranks may hold fewer
elements, or none. That is exactly a ``Shard(0)`` DTensor of the flattened
parameter, which is how checkpoints see every sharded strategy.

Several parameters travel in one collective through a *rank-major* flat
buffer: ``N`` rows of ``S = sum(c_i)`` elements, row ``r`` holding rank ``r``'s
piece of every parameter one after the other. An all-gather of the ``S``-element
shards fills exactly this buffer, and a reduce-scatter of it leaves each rank its
row. :class:`FlatLayout` packs full tensors into that buffer and unpacks them out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, Handle


def chunk_numel(numel: int, n: int) -> int:
    """Padded piece size ``ceil(numel / n)`` of a parameter sharded over ``n`` ranks."""
    return -(-numel // n)


def local_numel(numel: int, n: int, rank: int) -> int:
    """Unpadded elements rank ``rank`` holds (``torch.chunk`` semantics: the last ranks may hold fewer or none)."""
    c = chunk_numel(numel, n)
    return max(0, min(c, numel - rank * c))


class FlatLayout:
    """Where each of a group of parameters lives in a rank-major flat buffer.

    ``chunks[i]`` is the padded piece of parameter ``i`` on every rank and
    ``offsets[i]`` its start inside a rank's row of ``shard_numel`` elements.
    """

    def __init__(self, numels: Sequence[int], world: int) -> None:
        self.numels = list(numels)
        self.world = world
        self.chunks = [chunk_numel(n, world) for n in self.numels]
        self.offsets: list[int] = []
        off = 0
        for c in self.chunks:
            self.offsets.append(off)
            off += c
        self.shard_numel = off
        # One parameter that splits evenly: its flat tensor already *is* the
        # rank-major buffer, so collectives can read and write it in place.
        self.identity = len(self.numels) == 1 and self.numels[0] == world * self.chunks[0]

    def __len__(self) -> int:
        return len(self.numels)

    def local_numels(self, rank: int) -> list[int]:
        return [local_numel(n, self.world, rank) for n in self.numels]

    # ---- full tensors <-> rank-major buffer ------------------------------
    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Write full tensors into ``out`` (``world * shard_numel``) rank-major; padding and ``None`` become 0."""
        grid = out.view(self.world, self.shard_numel)
        for t, numel, c, off in zip(tensors, self.numels, self.chunks, self.offsets):
            if c == 0:
                continue
            dst = grid[:, off:off + c]
            if t is None:
                dst.zero_()
                continue
            flat = t.reshape(-1)
            rows, rem = divmod(numel, c)
            if rows:
                dst[:rows].copy_(flat[:rows * c].view(rows, c))
            if rows < self.world:
                if rem:
                    dst[rows, :rem].copy_(flat[rows * c:])
                    dst[rows, rem:].zero_()
                    dst[rows + 1:].zero_()
                else:
                    dst[rows:].zero_()
        return out

    def unpack(self, src: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Copy a gathered rank-major buffer into full (unpadded, contiguous) tensors."""
        grid = src.view(self.world, self.shard_numel)
        for t, numel, c, off in zip(outs, self.numels, self.chunks, self.offsets):
            if c == 0:
                continue
            flat = t.view(-1)
            rows, rem = divmod(numel, c)
            if rows:
                flat[:rows * c].view(rows, c).copy_(grid[:rows, off:off + c])
            if rem:
                flat[rows * c:].copy_(grid[rows, off:off + rem])

    def unpack_padded(self, src: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Like :meth:`unpack` into padded flat tensors of ``world * chunks[i]`` elements: one copy kernel."""
        grid = src.view(self.world, self.shard_numel)
        torch.split_with_sizes_copy(grid, self.chunks, dim=1,
                                    out=[o.view(self.world, c) for o, c in zip(outs, self.chunks)])

    # ---- one rank's row ----------------------------------------------------
    def shard_from_full(self, tensors: Sequence[torch.Tensor], rank: int, out: torch.Tensor) -> torch.Tensor:
        """Write rank ``rank``'s pieces of full tensors into ``out`` (``shard_numel``), zero padding."""
        for t, numel, c, off in zip(tensors, self.numels, self.chunks, self.offsets):
            n = local_numel(numel, self.world, rank)
            piece = out[off:off + c]
            if n:
                piece[:n].copy_(t.reshape(-1)[rank * c:rank * c + n])
            if n < c:
                piece[n:].zero_()
        return out

    def padded_views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Views of each parameter's padded piece (``chunks[i]`` elements) inside a rank's row."""
        return [row[off:off + c] for off, c in zip(self.offsets, self.chunks)]


@torch.no_grad()
def broadcast_inplace(tensors: nn.Module | Sequence[torch.Tensor], comm: Comm, name: str) -> None:
    """Make rank 0's tensors (a module's parameters and buffers) everyone's, one tensor at a time, in place.

    Unlike one flat broadcast this needs no second copy of the model, which
    matters to strategies whose point is that a rank holds less than a model.
    """
    if isinstance(tensors, nn.Module):
        tensors = list(tensors.parameters()) + list(tensors.buffers())
    for t in tensors:
        if t.device.type == "meta":
            continue
        if t.is_contiguous():
            comm.broadcast(t.data, src=0, name=name)
        else:
            tmp = t.detach().contiguous()
            comm.broadcast(tmp, src=0, name=name)
            t.copy_(tmp)


# ---- reduce-scatter and all-gather, native or pairwise -------------------------
# gloo's reduce_scatter_tensor is slow: on the 2-core CPU container, a 16 MiB
# fp32 tensor over 2 ranks took 16.25 ms to reduce-scatter against 11.26 ms to
# all-reduce (`python -m shardwise.bench.zero collectives`). A *pairwise
# exchange* (every rank sends each peer the piece that peer owns, all in one
# round of isend/irecv, then sums what it received) moves exactly the ring
# algorithm's (N-1)/N of the tensor per rank and took 6.05 ms; the all-gather
# likewise (4.53 ms against gloo's 7.03 ms). Numbers and command in docs/zero.md.
# On NCCL the native collectives stay the better choice.
COLLECTIVES = ("auto", "native", "p2p")


def pick_collectives(choice: str, comm: Comm) -> str:
    """``"native"`` or ``"p2p"`` for ``choice`` on ``comm`` (``"auto"``: p2p on gloo, native elsewhere)."""
    if choice not in COLLECTIVES:
        raise ValueError(f"unknown collectives {choice!r}; use one of {', '.join(COLLECTIVES)}")
    if choice != "auto":
        return choice

    if comm.size == 1 or not dist.is_initialized():
        return "native"
    return "p2p" if str(dist.get_backend(comm.group)) == "gloo" else "native"


class Exchange:
    """Point-to-point operations in flight; :meth:`wait` waits for them, then runs ``finish`` once."""

    def __init__(self, handles: list[Handle], finish: Callable[[], None] | None = None,
                 keep: Sequence[torch.Tensor] = ()) -> None:
        self.handles = handles
        self.finish = finish
        self.keep = list(keep)  # buffers that must outlive the operations

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []
        if self.finish is not None:
            fn, self.finish = self.finish, None
            fn()
        self.keep = []


Waitable = Any  # a comm Handle or an Exchange: both have wait()


def reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor, name: str, how: str) -> Waitable | None:
    """Start summing ``full`` (``N x out.numel()``) over ranks into ``out`` (rank r's slice); wait on the result.

    ``how="p2p"``: pairwise exchange; the pieces are summed in rank order, so
    the result does not depend on which rank computes it.
    """
    if how != "p2p" or comm.size == 1:
        return comm.reduce_scatter(out, full, name=name, async_op=True)
    n, r, c = comm.size, comm.rank, out.numel()
    pieces = full.view(n, c)
    recv = torch.empty(n - 1, c, dtype=out.dtype, device=out.device)
    handles = []
    for k in range(1, n):
        # Rank r sends to r+k and receives from r-k: every pair meets, in the same order on both sides.
        dst, src = (r + k) % n, (r - k) % n
        handles.append(comm.isend(pieces[dst], dst, name))
        handles.append(comm.irecv(recv[k - 1], src, name))

    def finish() -> None:
        by_rank = {(r - k) % n: recv[k - 1] for k in range(1, n)}
        by_rank[r] = pieces[r]
        torch.add(by_rank[0], by_rank[1], out=out)
        for j in range(2, n):
            out.add_(by_rank[j])
    return Exchange(handles, finish, keep=(full, recv))


def all_gather(comm: Comm, out: torch.Tensor, shard: torch.Tensor, name: str, how: str) -> Waitable | None:
    """Start gathering every rank's ``shard`` into ``out`` (rank-major); ``shard`` may be ``out``'s own slot."""
    if how != "p2p" or comm.size == 1:
        return comm.all_gather(out, shard, name=name, async_op=True)
    n, r, c = comm.size, comm.rank, shard.numel()
    slots = out.view(n, c)
    if slots[r].data_ptr() != shard.data_ptr():
        slots[r].copy_(shard)
    handles = []
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        handles.append(comm.isend(shard, dst, name))
        handles.append(comm.irecv(slots[src], src, name))
    return Exchange(handles, keep=(shard,))


def shard_parts(shard: torch.Tensor, start: int, held: int, optimizer: torch.optim.Optimizer,
                with_param: bool) -> list[tuple[str, int, torch.Tensor]]:
    """A flat shard's entries for a layout-free checkpoint (``checkpoint_parts`` of ZeRO and FSDP wrappers).

    ``shard`` is this rank's padded piece of a flattened parameter, starting at
    element ``start``, of which ``held`` elements are real (the rest padding).
    Returns ``(what, start, view)``: the parameter itself (``"param"``, when
    the rank holds it only as this piece) and each optimizer state, views of
    live storage so that a load lands in place.
    """
    out = [("param", start, shard.detach().view(-1)[:held])] if with_param else []
    for key, v in optimizer.state.get(shard, {}).items():
        if isinstance(v, torch.Tensor):
            out.append((key, 0, v) if v.dim() == 0 else (key, start, v.view(-1)[:held]))
    return out


