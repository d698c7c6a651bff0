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
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm import Comm, Handle
from shardwise.parallel.ddp import check_same_parameters
from shardwise.layout import RunLayout
from shardwise.strategy import LossFn, OptimizerFactory, StepRun, Strategy, unwrap, with_optimizer_states
from shardwise.topology import Topology

HEADER = 16  # bytes: float64 (worker step, clipping bound or -1)
MODES = ("sync", "async")
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
            buf[:HEADER].view(torch.float64).copy_(torch.tensor([self.step, self.clip], dtype=torch.float64))
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
    """A worker's optimizer: ``step()`` pushes the gradients; the real optimizer runs on the servers."""

    def __init__(self, params: Sequence[nn.Parameter], worker: _Worker) -> None:
        super().__init__(params, {})
        self._worker = worker

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
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
        times = []
        me = self.comm.global_rank(self.index)
        for t in range(steps):
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
                    msg = torch.tensor([kind, w], dtype=torch.int64)
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
        self.staleness, self.applied_by = gate.staleness, gate.applied_by
        return _per_step(applied_at, self.workers)

    def _follow(self, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        me = self.comm.global_rank(self.index)
        pending: dict[int, Handle] = {}
        done_pushes = [0] * self.workers
        version = 0
        pulled: dict[int, int] = {}
        applied_at: list[float] = []
        msg = torch.empty(2, dtype=torch.int64)
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


def _per_step(stamps: list[float], workers: int) -> list[float]:
    """Seconds per ``workers`` applied updates (one 'step' of every worker, on average)."""
    marks = stamps[workers - 1::workers]
    return [b - a for a, b in zip(marks, marks[1:])]


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


@dataclass
class ParameterServer(Strategy):
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

    def describe(self, devices: int) -> RunLayout:
        return replace(super().describe(devices), servers=self.servers)

    def sizes(self, devices: int) -> dict[str, int]:
        if devices < self.servers + 1:
            raise ValueError(f"the parameter server with servers={self.servers} needs at least "
                             f"{self.servers + 1} devices (the servers plus one worker), got devices={devices}")
        return {"dp": devices, "tp": 1, "pp": 1}

    def processes(self, devices: int) -> int:
        return devices

    def batch_shards(self, devices: int) -> int:
        return devices - self.servers

    def is_server(self, topo: Topology) -> bool:
        return topo.coord("dp") < self.servers

    def owns_loss(self, topo: Topology) -> bool:
        return not self.is_server(topo)

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        # Servers read no data: -1 makes any attempt to give them a shard fail loudly.
        workers = topo.size("dp") - self.servers
        return workers, (topo.coord("dp") - self.servers if not self.is_server(topo) else -1)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        comm = topo.comm("dp")
        if comm.size < self.servers + 1:
            raise ValueError(f"the parameter server with servers={self.servers} needs at least "
                             f"{self.servers + 1} ranks, the group has {comm.size}")
        model = model.to(topo.device)
        check_same_parameters(model, comm)
        layout = _Layout(model, self.servers)
        if self.is_server(topo):
            s = topo.coord("dp")
            lo, hi = layout.ranges[s]
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1) for p in layout.params])
                shard = nn.Parameter(flat[lo:hi].clone())
            del flat
            # The server needs names and shapes only; the weights it serves live in the shard.
            model.to("meta")
            layout.params = [p for p in model.parameters() if p.requires_grad]
            opt = optimizer_fn([shard])
            role: _Worker | _Server = _Server(comm, layout, s, self.servers, shard, self.mode, self.max_staleness)
            return PSModule(model, role), opt
        worker = _Worker(comm, layout, self.servers, self.mode)
        return PSModule(model, worker), _PushOptimizer(layout.params, worker)

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        role = model.role  # type: ignore[union-attr]
        role.pull()  # fresh weights first; the push happens in optimizer.step()
        return super().train_step(model, micro_batches, loss_fn, topo, run)

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology, steps: int) -> list[float]:
        role: _Server = model.role  # type: ignore[assignment,union-attr]
        if self.mode == "sync":
            return role.run_sync(optimizer, steps)
        return role.run_async(optimizer, steps)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        """Async: clip this worker's gradient, which is exactly the update applied.

        Sync: the update is the average over workers, which only the servers
        see; the bound travels with the push and the servers clip by the
        global norm. Returns this worker's local gradient norm.
        """
        role: _Worker = model.role  # type: ignore[assignment,union-attr]
        params = role.layout.params
        if self.mode == "async":
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        role.clip = float(max_norm)
        grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.cat(grads)) if grads else torch.zeros(())

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The servers' final weights, on every rank (each server broadcasts its shard).

        Buffers and frozen parameters are not served; they come from the first
        worker.
        """
        wrapper: PSModule = model  # type: ignore[assignment]
        comm, layout = topo.comm("dp"), wrapper.role.layout
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

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                         topo: Topology) -> dict[str, Any]:
        raise NotImplementedError("checkpointing is not supported for the parameter server yet")

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        role = model.role  # type: ignore[union-attr]
        if isinstance(role, _Server):
            return with_optimizer_states({"params": [role.shard], "grads": [role.shard.grad]}, optimizer)
        params = role.layout.params
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": []}

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        """Servers: the staleness of every update they applied, and which worker pushed it."""
        role = model.role  # type: ignore[union-attr]
        if isinstance(role, _Server):
            return {"role": "server", "staleness": list(role.staleness), "applied_by": list(role.applied_by)}
        return {"role": "worker"}


__all__ = ["PSModule", "ParameterServer", "StalenessGate"]
