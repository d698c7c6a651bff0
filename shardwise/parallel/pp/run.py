"""Pipeline parallelism, running a step: one optimizer step's forwards, backwards and messages.

:func:`pipeline_step` executes a schedule's actions (from
:mod:`shardwise.parallel.pp.schedules`, through :func:`execute`) on this rank's stage(s) of a
:class:`~shardwise.parallel.pp.build.PipelineModel`: :class:`_Runner`
receives a boundary's activations (their shape and dtype sent once, as a
small header: ``_DTYPES``, ``_META``), computes, and sends activations
forward and their gradients backward; :func:`resplit` cuts the local batch
into equal micro-batches and :func:`sync_ties` sums the gradients of weights
tied across stages.

It is separate from ``pipeline.py``, which partitions a model into stages:
that one builds the model, this one runs it (and imports it, never the reverse).
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardwise.comm import Comm, Handle
from shardwise.comm.topology import Topology
from shardwise.dims import PP
from shardwise.parallel.checkpointing import SavedActivations
from shardwise.parallel.pp.build import PipelineModel
from shardwise.parallel.pp.schedules import (
    ACT_TAG,
    GRAD_TAG,
    Action,
    Event,
    Recorder,
    check_message_order,
    forward_only,
    get_schedule,
    placement,
)
from shardwise.parallel.pp.split_backward import WeightGrad, backward_input
from shardwise.precision import widened
from shardwise.step import LossFn, TrainingStep, iter_chunks, set_aux_grad_scale

# ---- running a step ------------------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_META = 10  # header: ndim, dtype code, up to 8 dims


class Runner(Protocol):
    """What :func:`execute` drives: p2p around each compute, and the compute itself."""

    def recv_forward(self, a: Action) -> None: ...
    def forward(self, a: Action) -> None: ...
    def send_forward(self, a: Action) -> None: ...
    def recv_backward(self, a: Action) -> None: ...
    def backward(self, a: Action, last: bool) -> None: ...
    def backward_input(self, a: Action) -> None: ...
    def backward_weight(self, a: Action, last: bool) -> None: ...
    def send_backward(self, a: Action) -> None: ...
    def post_recv(self, a: Action) -> None: ...
    def in_flight(self) -> int: ...
    def saved_bytes(self) -> int: ...


def execute(actions: list[Action], runner: Runner, stage: int, recorder: Recorder | None = None) -> None:
    """Run ``actions`` in order; ``last`` marks the final backward of each chunk (gradient sync point).

    A whole B (:attr:`~shardwise.parallel.pp.schedules.Action.whole`) runs the plain backward, weights included, at
    its own place; the W after it computes nothing (its event, of no length, keeps the recorded order whole)."""
    split = any(a.kind == "W" for a in actions)
    for i, a in enumerate(actions):
        if a.whole and actions[i + 1:i + 2] != [Action("W", a.mb, a.chunk)]:
            raise ValueError(f"the whole backward {a!r} must be followed at once by its W (W{a.mb}.{a.chunk})")
    done = {(a.mb, a.chunk) for a in actions if a.whole}  # whole backwards: their W has nothing left to do
    # The action that last touches a chunk's weight gradients: where data-parallel wrappers reduce.
    last_b = {a.chunk: i for i, a in enumerate(actions) if a.kind == ("W" if split else "B")}
    # The next forward and the next backward after each action: their receives are posted while this one
    # computes, so a message arrives during the compute instead of after it (the runner may decline).
    ahead: list[list[Action]] = [[] for _ in actions]
    nxt: dict[str, Action] = {}
    for i in range(len(actions) - 1, -1, -1):
        ahead[i] = list(nxt.values())
        if actions[i].kind in ("F", "B"):
            nxt[actions[i].kind] = actions[i]
    for i, a in enumerate(actions):
        if a.kind == "F":
            runner.recv_forward(a)
            _post(runner, ahead[i])
            t0 = time.perf_counter()
            runner.forward(a)
            t1 = time.perf_counter()
            runner.send_forward(a)
        elif a.kind == "W":
            _post(runner, ahead[i])
            t0 = t1 = time.perf_counter()
            if (a.mb, a.chunk) not in done:
                runner.backward_weight(a, last=last_b[a.chunk] == i)
                t1 = time.perf_counter()
        else:
            runner.recv_backward(a)
            _post(runner, ahead[i])
            t0 = time.perf_counter()
            if split and not a.whole:
                runner.backward_input(a)
            else:  # a whole B does its W's work, the chunk's reduction too if that W is the chunk's last
                runner.backward(a, last=last_b[a.chunk] == (i + 1 if a.whole else i))
            t1 = time.perf_counter()
            runner.send_backward(a)
        _post(runner, ahead[i])  # a backward's receive needs its forward's output shape: known now if not before
        if recorder is not None:
            recorder.add(Event(stage, a.mb, a.kind, t0, t1, a.chunk, in_flight=runner.in_flight(),
                               saved_bytes=runner.saved_bytes(), whole=a.whole))


def _post(runner: Runner, upcoming: list[Action]) -> None:
    for b in upcoming:
        runner.post_recv(b)


class _Runner:
    """Receives, computes and sends for :func:`execute`."""

    def __init__(self, pm: PipelineModel, comm: Comm, mbs: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                 saved: SavedActivations | None,
                 forward_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                 loss_scale: float = 1.0, ahead: bool = False) -> None:
        self.pm, self.comm, self.mbs, self.loss_fn = pm, comm, mbs, loss_fn
        # Mixed precision: each stage's forward (and the loss) runs under the strategy's
        # autocast, like Strategy.train_step; fp16's loss scale multiplies the loss.
        self.forward_context = forward_context or contextlib.nullcontext
        self.loss_scale = loss_scale
        self.p, self.r, self.v = pm.stages, pm.rank, len(pm.chunks)
        self.place = pm.placement
        self.last = self.place.last
        # Per chunk, fixed for the step and asked for on every action: its virtual stage, and the ranks of the
        # stages before and after it (None at the pipeline's ends; this rank's own at the turn of a V).
        self.k = [self.place.virtual(self.r, c) for c in range(self.v)]
        self.prev = [self.place.rank_of(k - 1) if k > 0 else None for k in self.k]
        self.next = [self.place.rank_of(k + 1) if k < self.last else None for k in self.k]
        # Boundaries between two chunks of this rank (the turn of a V): what would be a message, by
        # ("act" | "grad", micro-batch, virtual stage of the activation's producer).
        self.handed: dict[tuple[str, int, int], torch.Tensor] = {}
        self.x: dict[tuple[int, int], Any] = {}
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.grad: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.sends: deque[Handle] = deque()
        # A split backward's W still to run, by (chunk, micro-batch).
        self.weights: dict[tuple[int, int], WeightGrad | _WholeBackward] = {}
        self.saved = saved
        # Receives posted ahead of their action (post_recv), by ("act" | "grad", chunk, micro-batch). Only where
        # each tag is its own ordered channel (gloo): posting a receive early then cannot overtake another message.
        self.ahead = ahead
        self.posted: dict[tuple[str, int, int], tuple[torch.Tensor, Handle]] = {}

    def _key(self, a: Action) -> Any:
        # Every rank of a replica reads the same batch, so the shape of the
        # micro-batch input is known everywhere: the activation shape behind a
        # boundary is sent once per distinct input shape and cached.
        x = self.mbs[a.mb][0]
        return (a.chunk, tuple(x.shape) if isinstance(x, torch.Tensor) else repr(type(x)))

    # -- forward
    def recv_forward(self, a: Action) -> None:
        k, key = self.k[a.chunk], (a.chunk, a.mb)
        if k == 0:
            self.x[key] = self.mbs[a.mb][0]
            return
        src, mk = self.prev[a.chunk], self._key(a)
        if src == self.r:
            buf = self.handed.pop(("act", a.mb, k - 1))
        else:
            if mk not in self.pm.meta_recv:  # the first message of a shape: its header first (never posted ahead)
                head = torch.empty(_META, dtype=torch.int64, device=self._device())
                self.comm.irecv(head, src, "pp.meta", ACT_TAG).wait()  # type: ignore[arg-type]
                n = int(head[0])
                self.pm.meta_recv[mk] = (tuple(int(d) for d in head[2:2 + n]), _DTYPES[int(head[1])])
            buf = self._take(a)
        self.x[key] = buf.requires_grad_() if buf.is_floating_point() else buf

    def forward(self, a: Action) -> None:
        key = (a.chunk, a.mb)
        ctx = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack) \
            if self.saved is not None else contextlib.nullcontext()
        with ctx, self.forward_context():
            last, y = self.k[a.chunk] == self.last, self.mbs[a.mb][1]
            if isinstance(self.loss_fn, TrainingStep):
                # One stage only (a pipeline refuses a training_step): the user's step calls the whole chunk.
                out = self.loss_fn(self.pm.chunks[a.chunk], y)
            else:
                out = self.pm(self.x[key], chunk=a.chunk)
                out = self.loss_fn(out, y) if last else out
            if last:
                self.losses.append(widened(out.detach()))
                out = widened(out) * (self.loss_scale / len(self.mbs))
        self.out[key] = out

    def send_forward(self, a: Action) -> None:
        k = self.k[a.chunk]
        if k == self.last:
            return
        out, dst, mk = self.out[(a.chunk, a.mb)], self.next[a.chunk], self._key(a)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"pipeline stage {k} returned a {type(out).__name__}; stages must pass one tensor")
        if dst == self.r:
            # Detached as a message would be: the next chunk's input is a leaf whose gradient B hands back.
            self.handed[("act", a.mb, k)] = out.detach()
            return
        if mk not in self.pm.meta_sent:
            if out.dim() > _META - 2:
                raise ValueError(f"activations with {out.dim()} dims cannot be sent (at most {_META - 2})")
            head = torch.zeros(_META, dtype=torch.int64, device=out.device)
            head[0], head[1] = out.dim(), _DTYPES.index(out.dtype)
            head[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
            self.sends.append(self.comm.isend(head, dst, "pp.meta", ACT_TAG))  # type: ignore[arg-type]
            self.pm.meta_sent.add(mk)
        self._sent(self.comm.isend(out.detach().contiguous(), dst, "pp.act", ACT_TAG))  # type: ignore[arg-type]

    # -- backward
    def recv_backward(self, a: Action) -> None:
        k, key = self.k[a.chunk], (a.chunk, a.mb)
        if k == self.last:
            return
        src = self.next[a.chunk]
        if src == self.r:
            self.grad[key] = self.handed.pop(("grad", a.mb, k))
            return
        self.grad[key] = self._take(a)

    def post_recv(self, a: Action) -> None:
        """Post the receive of a later action ``a`` ahead of it, where receives may be posted ahead (gloo)."""
        if self.ahead:
            self._post(a)

    def _take(self, a: Action) -> torch.Tensor:
        """The message action ``a`` needs from another rank, received (its receive posted now if not before)."""
        self._post(a)
        buf, h = self.posted.pop(("act" if a.kind == "F" else "grad", a.chunk, a.mb))
        h.wait()
        return buf

    def _post(self, a: Action) -> None:
        """Post the receive of ``a`` (F: its input, B: its output's gradient) if it is known what arrives: an
        activation's shape once its header came (every step after the first), a gradient's once the forward
        ran. A message from this rank itself (the turn of a V) needs no receive."""
        kind = "act" if a.kind == "F" else "grad"
        src = (self.prev if kind == "act" else self.next)[a.chunk]
        if src is None or src == self.r or (kind, a.chunk, a.mb) in self.posted:
            return  # nothing to receive (an end of the pipeline, the turn of a V), or posted already
        if kind == "act":
            known = self.pm.meta_recv.get(self._key(a))
            if known is None:
                return
            (shape, dtype), tag = known, ACT_TAG
        else:
            out = self.out.get((a.chunk, a.mb))
            if out is None:
                return
            shape, dtype, tag = out.shape, out.dtype, GRAD_TAG
        buf = torch.empty(shape, dtype=dtype, device=self._device())
        self.posted[(kind, a.chunk, a.mb)] = (buf, self.comm.irecv(buf, src, f"pp.{kind}", tag))

    def backward(self, a: Action, last: bool) -> None:
        key = (a.chunk, a.mb)
        chunk = self.pm.chunks[a.chunk]
        # Data-parallel wrappers reduce gradients only in a chunk's final backward.
        ctx = chunk.no_sync() if (not last and hasattr(chunk, "no_sync")) else contextlib.nullcontext()  # type: ignore[operator]
        out = self.out.pop(key)
        with ctx:
            torch.autograd.backward(out, self.grad.pop(key, None))

    def backward_input(self, a: Action) -> None:
        """B of a split backward: this chunk's input gradient only (what the previous stage waits for); the
        weight gradients wait in a handle for the schedule's W (:mod:`shardwise.parallel.pp.split_backward`).
        No parameter gradient arises here, so no data-parallel wrapper's hook fires."""
        key = (a.chunk, a.mb)
        out, grad, x = self.out.pop(key), self.grad.pop(key, None), self.x[key]
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            # The first stage's input (token ids, the batch) needs no gradient: B has nothing to compute and W is
            # the whole backward, run then as one plain pass.
            self.weights[key] = _WholeBackward(out, grad)
            return
        chunk = self.pm.chunks[a.chunk]
        params = [p for p in chunk.parameters() if p.requires_grad]
        # FSDP gathers its units for B without starting their backward (no_sync-free: B reduces nothing).
        ctx = chunk.input_pass() if hasattr(chunk, "input_pass") else contextlib.nullcontext()  # type: ignore[operator]
        with ctx:
            grads, self.weights[key] = backward_input(out, grad, [x], params)
        x.grad = grads[0]

    def backward_weight(self, a: Action, last: bool) -> None:
        """W: the weight gradients B left, accumulated into ``.grad`` as a plain backward would; data-parallel
        wrappers reduce in the chunk's last W (their hooks fire there, once per parameter), and their
        end-of-backward work runs once, after every autograd pass of the W."""
        chunk = self.pm.chunks[a.chunk]
        with contextlib.ExitStack() as stack:
            if not last and hasattr(chunk, "no_sync"):
                stack.enter_context(chunk.no_sync())  # type: ignore[operator]
            if hasattr(chunk, "backward_in_parts"):
                stack.enter_context(chunk.backward_in_parts())  # type: ignore[operator]
            self.weights.pop((a.chunk, a.mb)).backward_weight()

    def send_backward(self, a: Action) -> None:
        k, key = self.k[a.chunk], (a.chunk, a.mb)
        x = self.x.pop(key)
        if k == 0:
            return
        g = x.grad if x.grad is not None else torch.zeros_like(x)
        dst = self.prev[a.chunk]
        if dst == self.r:
            self.handed[("grad", a.mb, k - 1)] = g
            return
        self._sent(self.comm.isend(g, dst, "pp.grad", GRAD_TAG))  # type: ignore[arg-type]

    def _sent(self, h: Handle) -> None:
        # Finished sends are dropped as they go, not at the end of the step: each holds its tensor. Only from the
        # front, oldest first: polling every pending send on each send made about 15 polls per send at p = 4, m = 8
        # (its effect on the step time was 0.999x-1.077x in A/B runs: benchmarks/results/zero-bubble/NOTES.md).
        while self.sends and self.sends[0].poll():
            self.sends.popleft()
        self.sends.append(h)

    def in_flight(self) -> int:
        return len(self.out) + len(self.weights)  # a split backward frees a micro-batch's activations at W

    def saved_bytes(self) -> int:
        return self.saved.current if self.saved is not None else 0

    def _device(self) -> torch.device:
        return self.pm.device

    def finish(self) -> None:
        for h in self.sends:
            h.wait()
        self.sends.clear()
        if self.posted:
            raise RuntimeError(f"pipeline: receives posted for actions that never ran: {sorted(self.posted)}")


class _WholeBackward:
    """W of a stage whose input needs no gradient: the plain backward, deferred to where the schedule puts W."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        self.out, self.grad = out, grad

    def backward_weight(self) -> None:
        torch.autograd.backward(self.out, self.grad)


def resplit(micro_batches: Sequence[tuple[Any, Any]], m: int | None) -> list[tuple[Any, Any]]:
    """The trainer's micro-batches, or the same local batch cut into ``m`` equal ones."""

    if m is None:
        return list(micro_batches)
    xs, ys = [x for x, _ in micro_batches], [y for _, y in micro_batches]
    x, y = (_cat(xs) if len(xs) > 1 else xs[0]), (_cat(ys) if len(ys) > 1 else ys[0])
    n = x.shape[0]
    if m < 1 or n % m:
        raise ValueError(f"pipeline: the local batch of {n} samples does not split into microbatches={m} "
                         f"equal micro-batches (the mean loss needs equal sizes); choose a divisor of {n}")
    return list(zip(iter_chunks(x, m), iter_chunks(y, m)))


def _cat(parts: Sequence[Any]) -> Any:
    """Micro-batches joined again along dim 0: tensors, or dicts (a dict batch's target) and tuples of them."""
    first = parts[0]
    if isinstance(first, dict):
        return type(first)((k, _cat([p[k] for p in parts])) for k in first)
    if isinstance(first, (tuple, list)):
        if all(not isinstance(v, (torch.Tensor, dict, tuple, list)) for v in first):
            return type(first)(v for p in parts for v in p)  # a list of plain values (strings)
        return type(first)(_cat(list(vs)) for vs in zip(*parts))
    return torch.cat(parts)  # type: ignore[arg-type]


def pipeline_eval(pm: PipelineModel, x: Any, y: Any, fn: LossFn, topo: Topology,
                  forward_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None
                  ) -> torch.Tensor | None:
    """One evaluation batch forward through every stage, no backward: ``fn(output, y)`` on the last stage, None
    elsewhere. The batch goes as one micro-batch, chunk after chunk (:func:`~shardwise.parallel.pp.schedules.
    forward_only`); nothing is kept for a backward and tied weights are left alone."""
    pm.sync_copies()
    runner = _Runner(pm, topo.comm(PP), [(x, y)], fn, None, forward_context)
    with torch.no_grad():
        execute(forward_only(pm.stages, 1, pm.rank, len(pm.chunks)), runner, pm.rank)
        runner.finish()
    return runner.losses[0] if runner.losses else None


def sync_ties(pm: PipelineModel, comm: Comm) -> None:
    """Sum the gradients of tied copies over the stages holding them (same order everywhere: same sum).

    A rank's copies (one per chunk using the weight: a V's embedding and head) are summed first, in
    virtual-stage order; then the ranks' sums, in rank order."""
    copies: dict[str, list[torch.Tensor]] = {}
    owners: dict[str, list[int]] = {}
    for t in pm.ties:  # in canonical-name order on every rank: the exchanges pair up
        copies.setdefault(t.name, []).append(pm.grad_of_tie(t.param))
        owners[t.name] = t.owners
    for name, grads in copies.items():
        g = grads[0]
        for more in grads[1:]:
            g = g + more
        others = [o for o in owners[name] if o != pm.rank]
        bufs = {o: torch.empty_like(g) for o in others}
        hs = [comm.isend(g.contiguous(), o, "pp.tied") for o in others]
        for o in others:
            comm.irecv(bufs[o], o, "pp.tied").wait()
        for h in hs:
            h.wait()
        total = None
        for o in owners[name]:
            part = g if o == pm.rank else bufs[o]
            total = part.clone() if total is None else total + part
        # In place: a data-parallel wrapper may keep the gradient as a view of its bucket or shard.
        for mine in grads:
            mine.copy_(total)  # type: ignore[arg-type]


def pipeline_step(pm: PipelineModel, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, topo: Topology,
                  schedule: str = "1f1b", microbatches: int | None = None,
                  recorder: Recorder | None = None,
                  forward_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                  loss_scale: float = 1.0) -> torch.Tensor | None:
    """One optimizer step's forwards and backwards; the mean loss on the last stage, None elsewhere.

    ``forward_context`` (e.g. autocast for mixed precision) wraps every stage forward
    and the loss; ``loss_scale`` multiplies the loss before backward (fp16).
    """
    mbs = resplit(micro_batches, microbatches)
    set_aux_grad_scale(pm, loss_scale / len(mbs))
    acts = get_schedule(schedule)(pm.stages, len(mbs), pm.rank, len(pm.chunks))
    wanted = placement(schedule, pm.stages, len(pm.chunks))
    if wanted != pm.placement:
        raise ValueError(f"schedule={schedule!r} runs virtual stages placed as {wanted.shape!r}, but this pipeline "
                         f"model was built with the {pm.placement.shape!r} placement (other layers on each rank); "
                         f"build it with build_pipeline(..., shape={wanted.shape!r})")
    comm = topo.comm(PP)
    # gloo matches point-to-point messages per tag, NCCL in one channel per pair: the check follows suit.
    tagged = not dist.is_initialized() or "nccl" not in str(dist.get_backend(comm.group))
    check_message_order(schedule, pm.stages, len(mbs), len(pm.chunks), tagged)
    saved = None
    if recorder is not None and recorder.track_saved:
        # Parameters and the batch itself are not activations (micro-batches are views of one batch).
        data = [t for xy in mbs for t in xy if isinstance(t, torch.Tensor)]
        saved = SavedActivations(pm.parameters(), data)
    pm.sync_copies()
    runner = _Runner(pm, comm, mbs, loss_fn, saved, forward_context, loss_scale, ahead=tagged)
    execute(acts, runner, pm.rank, recorder)
    runner.finish()
    if recorder is not None:
        recorder.step += 1
        if saved is not None:
            recorder.peak_saved_bytes = max(recorder.peak_saved_bytes, saved.peak)
    sync_ties(pm, topo.comm(PP))
    if not runner.losses:
        return None
    return torch.stack(runner.losses).mean()
