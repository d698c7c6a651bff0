"""Parameter server, the two roles: a worker's pull and push, a server's sync and async loops.

What each rank of a parameter-server job runs (the protocol is described in
:mod:`shardwise.parallel.ps.module`): the async schedule under a staleness bound
(:class:`StalenessGate`, pure Python), the layout of the flat parameter
vector over the servers (:class:`_Layout`), the worker side (:class:`_Worker`
and its :class:`_PushOptimizer`) and the server side (:class:`_Server`), with
the wire constants ``HEADER`` (a push's 16-byte header) and ``APPLY``/``PULL``
(the async leader's decisions).

The roles are this module's one role: the wrapper ``PSModule`` is ``ps.py``
(which imports this module) and the strategy :mod:`shardwise.strategies.ps`.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm, Handle

HEADER = 16  # bytes: float64 (worker step, clipping bound or -1)
APPLY, PULL = 0, 1  # decisions of the async leader


# ---- the async schedule (pure Python, no communication) ------------------------------
class StalenessGate:
    """When the async server may apply a push and when a worker may pull, under a staleness bound.

    A worker holds an *open window* from the moment it is sent weights
    (version ``p``) until its gradient is applied; the window's count is the
    number of updates applied since, and the staleness of the update is that
    count when it is applied. With bound ``s``, sort the open counts
    descending, ``c_1 >= c_2 >= ...``: the state is safe while
    ``c_i + (i - 1) <= s`` for every ``i``, because applying the windows in
    that order closes each within the bound. Applying the window with the
    largest count always keeps the state safe, and that worker is computing,
    so waiting for it always makes progress: no deadlock. Any other apply or
    a new pull happens only if the state stays safe; otherwise the worker
    waits. ``max_staleness=None`` applies and serves everything at once.
    """

    def __init__(self, workers: int, steps: int, max_staleness: int | None) -> None:
        self.bound = max_staleness
        self.version = 0
        self.window: dict[int, int] = {}        # worker -> version it pulled
        self.arrived: list[int] = []            # pushes received, not yet applied (FIFO)
        self.waiting: list[int] = list(range(workers))  # workers wanting weights (FIFO)
        self.left = [steps] * workers           # pushes still to come per worker
        self.staleness: list[int] = []          # of every applied update, in order
        self.applied_by: list[int] = []

    def _safe(self, counts: list[int]) -> bool:
        if self.bound is None:
            return True
        return all(c + i <= self.bound for i, c in enumerate(sorted(counts, reverse=True)))

    def _can_apply(self, w: int) -> bool:
        return self._safe([self.version + 1 - p for x, p in self.window.items() if x != w])

    def _can_pull(self) -> bool:
        return self._safe([self.version - p for p in self.window.values()] + [0])

    def push(self, w: int) -> list[tuple[int, int]]:
        """Worker ``w``'s gradient arrived; returns the decisions it unblocks."""
        if w not in self.window or w in self.arrived:
            raise RuntimeError(f"worker {w} pushed without holding weights (protocol error)")
        self.arrived.append(w)
        return self.decide()

    def decide(self) -> list[tuple[int, int]]:
        """Every (APPLY | PULL, worker) that may happen now, in order; applies first (fresher weights)."""
        out: list[tuple[int, int]] = []
        while True:
            w = next((x for x in self.arrived if self._can_apply(x)), None)
            if w is not None:
                self.arrived.remove(w)
                self.staleness.append(self.version - self.window.pop(w))
                self.applied_by.append(w)
                self.version += 1
                self.left[w] -= 1
                if self.left[w] > 0:
                    self.waiting.append(w)
                out.append((APPLY, w))
                continue
            if self.waiting and self._can_pull():
                w = self.waiting.pop(0)
                self.window[w] = self.version
                out.append((PULL, w))
                continue
            return out

    @property
    def done(self) -> bool:
        return not any(self.left)

    @property
    def pushing(self) -> list[int]:
        """Workers holding weights whose gradient has not arrived yet."""
        return [w for w in self.window if w not in self.arrived]


# ---- layout of the flat parameter vector -------------------------------------------------
class _Layout:
    """Where each trainable parameter sits in the flat vector, and which range each server owns."""

    def __init__(self, module: nn.Module, servers: int) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the parameter server needs a model with trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"the parameter server keeps one flat vector per shard and needs a single "
                             f"parameter dtype; the model has {sorted(map(str, dtypes))}")
        self.dtype = self.params[0].dtype
        self.offsets: list[int] = []
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        base, extra = divmod(off, servers)
        sizes = [base + (1 if s < extra else 0) for s in range(servers)]
        self.ranges = [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(servers)]
        ids = {id(p): i for i, p in enumerate(self.params)}
        self.names = {n: ids[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}
        # Each parameter's first name, the one the unsplit model's state dict (and a checkpoint) uses for it:
        # named_parameters() lists a tied parameter once, under that name.
        first = {id(p): n for n, p in module.named_parameters()}
        self.first_names = [first[id(p)] for p in self.params]

    def pieces(self, s: int) -> list[tuple[int, int, int, int]]:
        """(parameter index, start in parameter, start in shard, length) of what server ``s`` owns."""
        lo, hi = self.ranges[s]
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append((i, a - off, a - lo, b - a))
        return out

    def shard_numel(self, s: int) -> int:
        return self.ranges[s][1] - self.ranges[s][0]


def _wait(h: Handle, what: str) -> None:
    try:
        h.wait()
    except RuntimeError as e:
        raise RuntimeError(f"parameter server: {what}: {str(e).splitlines()[0]}") from e


# ---- worker side ---------------------------------------------------------------------------
class _Worker:
    def __init__(self, comm: Comm, layout: _Layout, servers: int, mode: str) -> None:
        self.comm, self.layout, self.servers, self.mode = comm, layout, servers, mode
        self.pieces = [layout.pieces(s) for s in range(servers)]
        dev = layout.params[0].device
        esize = torch.empty((), dtype=layout.dtype).element_size()
        self.push_buf = [torch.zeros(HEADER + layout.shard_numel(s) * esize, dtype=torch.uint8, device=dev)
                         for s in range(servers)]
        self.pull_buf = [torch.empty(layout.shard_numel(s), dtype=layout.dtype, device=dev) for s in range(servers)]
        self.step = 0
        self.clip = -1.0

    def pull(self) -> None:
        hs = [self.comm.irecv(self.pull_buf[s], s, "ps.pull") for s in range(self.servers)]
        for s, h in enumerate(hs):
            _wait(h, f"worker rank {self.comm.global_rank(self.comm.rank)} got no weights from server "
                     f"rank {self.comm.global_rank(s)} for step {self.step}")
        with torch.no_grad():
            for s in range(self.servers):
                for i, a, b, n in self.pieces[s]:
                    self.layout.params[i].view(-1)[a:a + n].copy_(self.pull_buf[s][b:b + n])

    def push(self) -> None:
        hs = []
        for s in range(self.servers):
            buf = self.push_buf[s]
            buf[:HEADER].view(torch.float64).copy_(torch.tensor([self.step, self.clip], dtype=torch.float64,
                                                                device=buf.device))
            grads = buf[HEADER:].view(self.layout.dtype)
            for i, a, b, n in self.pieces[s]:
                g = self.layout.params[i].grad
                if g is None:  # a parameter this step did not reach
                    grads[b:b + n].zero_()
                else:
                    grads[b:b + n].copy_(g.reshape(-1)[a:a + n])
            hs.append(self.comm.isend(buf, s, "ps.push"))
        for s, h in enumerate(hs):
            _wait(h, f"worker rank {self.comm.global_rank(self.comm.rank)} could not push to server "
                     f"rank {self.comm.global_rank(s)} at step {self.step}")
        self.step += 1
        self.clip = -1.0


class _PushOptimizer(torch.optim.Optimizer):
    """A worker's optimizer: ``step()`` pushes the gradients; the real optimizer runs on the servers.

    ``keeps_state = False`` tells :func:`shardwise.checkpoint.materialize` that there are no
    states to create here (stepping it to make them would push gradients nobody waits for).
    """

    keeps_state = False

    def __init__(self, params: Sequence[nn.Parameter], worker: _Worker) -> None:
        super().__init__(params, {})
        self._worker = worker

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self._worker.push()
        return loss


# ---- server side ---------------------------------------------------------------------------
class _Server:
    def __init__(self, comm: Comm, layout: _Layout, index: int, servers: int, shard: nn.Parameter,
                 mode: str, max_staleness: int | None) -> None:
        self.comm, self.layout, self.index, self.servers = comm, layout, index, servers
        self.shard, self.mode, self.max_staleness = shard, mode, max_staleness
        self.workers = comm.size - servers
        esize = shard.element_size()
        self.push_buf = [torch.empty(HEADER + shard.numel() * esize, dtype=torch.uint8, device=shard.device)
                         for _ in range(self.workers)]
        shard.grad = torch.zeros_like(shard)
        self.staleness: list[int] = []
        self.applied_by: list[int] = []
        self.served = 0  # sync steps served by this process, over all calls (a run serves in segments)

    # helpers
    def rank_of(self, w: int) -> int:
        return self.servers + w

    def who(self, w: int) -> str:
        return f"worker rank {self.comm.global_rank(self.rank_of(w))} (worker {w})"

    def header(self, w: int) -> tuple[int, float]:
        step, clip = self.push_buf[w][:HEADER].view(torch.float64).tolist()
        return int(step), clip

    def grad_of(self, w: int) -> torch.Tensor:
        return self.push_buf[w][HEADER:].view(self.shard.dtype)

    def recv_push(self, w: int) -> Handle:
        return self.comm.irecv(self.push_buf[w], self.rank_of(w), "ps.push")

    def send_weights(self, w: int, step: int) -> None:
        _wait(self.comm.isend(self.shard.detach(), self.rank_of(w), "ps.pull"),
              f"server rank {self.comm.global_rank(self.index)} could not send weights to {self.who(w)} "
              f"for its step {step}")

    # synchronous: every step waits for every worker
    def run_sync(self, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        """``steps`` synchronous steps; a worker's header counts its pushes since its process started,
        as :attr:`served` does here, so a run served in segments (between checkpoints) checks the same."""
        times = []
        me = self.comm.global_rank(self.index)
        for _ in range(steps):
            t = self.served
            start = time.perf_counter()
            sends = [self.comm.isend(self.shard.detach(), self.rank_of(w), "ps.pull") for w in range(self.workers)]
            recvs = [self.recv_push(w) for w in range(self.workers)]
            for w, h in enumerate(recvs):
                _wait(h, f"server rank {me} got no gradient from {self.who(w)} for step {t} "
                         f"(the worker died or hangs)")
            for w, h in enumerate(sends):
                _wait(h, f"server rank {me} could not send weights to {self.who(w)} for step {t}")
            g = self.shard.grad
            assert g is not None
            g.zero_()
            clips = set()
            for w in range(self.workers):  # worker order: the same sum every run
                step, clip = self.header(w)
                if step != t:
                    raise RuntimeError(f"parameter server: {self.who(w)} pushed its step {step} during step {t}")
                clips.add(clip)
                g.add_(self.grad_of(w))
            g.div_(self.workers)
            if len(clips) > 1:
                raise RuntimeError(f"parameter server: workers disagree on the clipping bound: {sorted(clips)}")
            clip = clips.pop()
            if clip >= 0:
                self.clip(clip)
            opt.step()
            self.served += 1
            self.staleness.append(0)
            self.applied_by.append(-1)
            times.append(time.perf_counter() - start)
        return times

    def clip(self, max_norm: float) -> None:
        """Scale the averaged gradient as torch.nn.utils.clip_grad_norm_ would on the whole model."""
        g = self.shard.grad
        assert g is not None
        mine = torch.linalg.vector_norm(g).reshape(1)
        norms = [torch.zeros_like(mine) for _ in range(self.servers)]
        norms[self.index] = mine
        hs = []
        for s in range(self.servers):
            if s != self.index:
                hs.append(self.comm.isend(mine, s, "ps.norm"))
                hs.append(self.comm.irecv(norms[s], s, "ps.norm"))
        for h in hs:
            _wait(h, f"server rank {self.comm.global_rank(self.index)}: gradient-norm exchange between servers")
        total = torch.linalg.vector_norm(torch.cat(norms))
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))

    # asynchronous: the first server decides the order, the others follow it
    def run_async(self, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        if self.index == 0:
            return self._lead(opt, steps)
        return self._follow(opt, steps)

    def _apply(self, w: int, opt: torch.optim.Optimizer) -> None:
        g = self.shard.grad
        assert g is not None
        g.copy_(self.grad_of(w))  # clipped on the worker, which holds this whole gradient
        opt.step()

    def _lead(self, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        gate = StalenessGate(self.workers, steps, self.max_staleness)
        me = self.comm.global_rank(0)
        arrivals: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()
        inbox: list[queue.Queue[Handle | None]] = [queue.Queue() for _ in range(self.workers)]

        def waiter(w: int) -> None:
            # Receives are posted (and counted) on the main thread; only the waiting happens here.
            while (h := inbox[w].get()) is not None:
                try:
                    h.wait()
                    _host_wait(self.shard.device)  # NCCL's wait() only orders streams: block until it landed
                    arrivals.put((w, None))
                except BaseException as e:  # reported by the main thread, naming the worker
                    arrivals.put((w, e))
                    return

        threads = [threading.Thread(target=waiter, args=(w,), daemon=True, name=f"shardwise-ps-w{w}")
                   for w in range(self.workers)]
        for th in threads:
            th.start()
        orders: list[tuple[torch.Tensor, list[Handle]]] = []
        applied_at: list[float] = []
        done_pushes = [0] * self.workers
        decisions = gate.decide()
        try:
            while True:
                for kind, w in decisions:
                    if kind == APPLY:
                        self._apply(w, opt)
                        done_pushes[w] += 1
                        applied_at.append(time.perf_counter())
                    else:
                        inbox[w].put(self.recv_push(w))  # its next push, expected now
                        self.send_weights(w, done_pushes[w])
                    # On the communication device: NCCL sends only CUDA tensors (gloo takes either).
                    msg = torch.tensor([kind, w], dtype=torch.int64, device=self.shard.device)
                    orders.append((msg, [self.comm.isend(msg, s, "ps.order") for s in range(1, self.servers)]))
                if len(orders) > 256:  # keep the in-flight order messages (and their buffers) bounded
                    for _, hs in orders[:128]:
                        for h in hs:
                            _wait(h, f"server rank {me} could not send the update order to the other servers")
                    del orders[:128]
                if gate.done:
                    break
                try:
                    w, err = arrivals.get(timeout=self.comm.timeout.total_seconds() * 1.05)
                except queue.Empty:
                    raise RuntimeError(
                        f"parameter server: server rank {me} got no gradient from "
                        f"{', '.join(self.who(x) for x in gate.pushing)} within {self.comm.timeout} "
                        f"(the worker died or hangs)") from None
                if err is not None:
                    raise RuntimeError(f"parameter server: server rank {me} got no gradient from {self.who(w)} "
                                       f"for its step {done_pushes[w]} (the worker died or hangs): "
                                       f"{str(err).splitlines()[0]}") from err
                decisions = gate.push(w)
            for _, hs in orders:
                for h in hs:
                    _wait(h, f"server rank {me} could not send the update order to the other servers")
        finally:
            for q in inbox:
                q.put(None)
        self.staleness += gate.staleness  # over every segment this process served
        self.applied_by += gate.applied_by
        return _per_step(applied_at, self.workers)

    def _follow(self, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        me = self.comm.global_rank(self.index)
        pending: dict[int, Handle] = {}
        done_pushes = [0] * self.workers
        version = 0
        pulled: dict[int, int] = {}
        applied_at: list[float] = []
        msg = torch.empty(2, dtype=torch.int64, device=self.shard.device)  # the communication device (NCCL: CUDA)
        for _ in range(2 * self.workers * steps):
            _wait(self.comm.irecv(msg, 0, "ps.order"),
                  f"server rank {me} got no update order from the first server rank {self.comm.global_rank(0)}")
            kind, w = (int(v) for v in msg.tolist())
            if kind == APPLY:
                _wait(pending.pop(w), f"server rank {me} got no gradient from {self.who(w)} for its step "
                                      f"{done_pushes[w]} (the worker died or hangs)")
                self._apply(w, opt)
                self.staleness.append(version - pulled.pop(w))
                self.applied_by.append(w)
                version += 1
                done_pushes[w] += 1
                applied_at.append(time.perf_counter())
            else:
                pending[w] = self.recv_push(w)
                pulled[w] = version
                self.send_weights(w, done_pushes[w])
        return _per_step(applied_at, self.workers)


def _host_wait(device: torch.device) -> None:
    """Block this thread until the work its current stream waits for is done (CUDA only).

    gloo's ``wait()`` blocks until a receive completed; NCCL's only makes the
    current stream wait for it. The asynchronous lead server's waiter threads
    use the return of ``wait()`` as "this gradient arrived", so under NCCL
    they also synchronise the stream. A thread's current CUDA device is its
    own, hence the explicit ``device``.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _per_step(stamps: list[float], workers: int) -> list[float]:
    """Seconds per ``workers`` applied updates (one 'step' of every worker, on average)."""
    marks = stamps[workers - 1::workers]
    return [b - a for a, b in zip(marks, marks[1:])]
