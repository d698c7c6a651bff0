"""The FSDP wrapper: :class:`FSDPModule`, its forward/backward hooks and its gradient reduction.

What a model wrapped for ZeRO-3, FSDP or HSDP is (the mechanics are described
in :mod:`shardwise.strategies.dp.fsdp`): construction of the units over a module
tree (materialising a meta-device model one module at a time), the hooks that
gather a unit before its forward and backward and free it after, and the
reduce-scatter (and, for HSDP, all-reduce across replicas) of each unit's
gradients once they are complete. The hooks and the reduction are the mixin
:class:`_Reduction`, so that neither class grows past the size rule.

The strategies (``FSDP``, ``ZeRO3``, ``HSDP``) are :mod:`shardwise.strategies.dp.fsdp`;
the units' machinery is :mod:`shardwise.parallel.dp.fsdp_units`.
"""
from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from shardwise.comm import Comm, Handle
from shardwise.data import leaves
from shardwise.parallel.dp.ddp import GradSync, by_group, check_same_parameters, drop_grad, forget_piece
from shardwise.parallel.dp.fsdp_units import WrapPolicy, _to_device, _Unit, unit_modules
from shardwise.parallel.dp.sharding import (
    broadcast_inplace,
    chunk_numel,
    local_numel,
    pick_collectives,
    shard_parts,
)
from shardwise.parallel.ep import expert_modules, is_expert


# ---- hooks and gradient reduction -------------------------------------------
class _Reduction(GradSync):
    """FSDPModule's forward/backward hooks and its reduction of each unit's gradients.

    A mixin: the state it works on (``units``, ``unit_of``, the forward order,
    the queues of reductions in flight) is built by :class:`FSDPModule`.
    """

    units: list[_Unit]
    unit_of: dict[nn.Parameter, _Unit]
    _input_pass: bool = False
    replicate: Comm | None
    reshard_after_forward: bool
    dp_size: int
    _order: list[_Unit]
    _prev_order: list[_Unit]
    _rs: deque[tuple[_Unit, torch.Tensor, list[Any]]]
    _ar: deque[tuple[_Unit, torch.Tensor, Handle | None]]

    def _reset_backward(self) -> None:
        """Per-backward bookkeeping, reset before each backward pass (at a forward and at each backward's end:
        a pipeline runs several forwards before their backwards, each backward a pass of its own)."""
        for u in self.units:
            u.pending = len(u.params)
            u.backward_started = False
            u.got_grad = False

    # ---- hooks -----------------------------------------------------------
    def _pre_forward_hook(self, u: _Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            u.unshard()
            if torch.is_grad_enabled():
                self._order.append(u)
                # Forward prefetch: start the gather of the unit that ran next last iteration.
                i = len(self._order)
                if i < len(self._prev_order):
                    self._prev_order[i].start_gather()
        return hook

    def _post_forward_hook(self, u: _Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                u.reshard()
                return
            for t in leaves(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook(u))
            if self.reshard_after_forward:
                u.reshard()
        return hook

    def _pre_backward_hook(self, u: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._input_pass:
                # A split backward's B (input gradients only): the unit's weights are needed, its gradients
                # are not computed, so its backward is not started here (W starts it; see input_pass).
                u.unshard()
                return
            if u.backward_started:
                return
            u.backward_started = True
            self._finish_at_backward_end()
            # The reductions still in flight finish before this unit's gradients
            # are computed: at most one unit's full gradients exist at a time.
            self._flush()
            u.unshard()
            # Backward prefetch: the unit before this one in forward order is needed
            # next, unless its backward is already over (an enclosing unit whose
            # own parameters came last in forward, first in backward).
            if u in self._order:
                i = self._order.index(u)
                if i > 0 and self._order[i - 1].pending > 0:
                    self._order[i - 1].start_gather()
        return hook

    def _on_grad(self, p: torch.Tensor) -> None:
        u = self.unit_of[p]  # type: ignore[index]
        # A split backward's W reaches parameters without passing a unit's output: its end is queued here.
        self._finish_at_backward_end()
        u.got_grad = True
        u.pending -= 1
        if u.pending == 0:
            self._post_backward(u)

    # ---- gradient reduction --------------------------------------------
    @torch.no_grad()
    def _post_backward(self, u: _Unit) -> None:
        if not self._sync:
            u.reshard()  # keep the full gradients, free the full parameters
            return
        out, work = u.start_reduce()
        u.reshard()
        self._rs.append((u, out, work))
        # It runs while the next unit's parameters are gathered; that unit's
        # pre-backward hook waits for it (see _pre_backward_hook).

    def _drain_rs(self) -> None:
        u, out, work = self._rs.popleft()
        for _staging, h in work:
            if h is not None:
                h.wait()
        if self.replicate is not None and self.replicate.size > 1:
            h2 = self.replicate.all_reduce(out, name=f"hsdp_all_reduce.u{u.index}", async_op=True)
            self._ar.append((u, out, h2))
        else:
            self._accumulate(u, out)

    def _drain_ar(self) -> None:
        u, out, h = self._ar.popleft()
        if h is not None:
            h.wait()
        self._accumulate(u, out)

    def _accumulate(self, u: _Unit, out: torch.Tensor) -> None:
        out.div_(self.dp_size)  # sum then divide: the mean without ReduceOp.AVG (gloo lacks it)
        if u.host is not None:
            out = out.to(u.host.device)  # ZeRO-Offload: the gradient shard goes where the optimizer runs
        if u.grad_shard is None:
            u.set_grad_shard(out)
        else:
            u.grad_shard.add_(out)
        u.cleared.clear()

    def _flush(self) -> None:
        while self._rs:
            self._drain_rs()
        while self._ar:
            self._drain_ar()

    def _finish(self) -> None:
        """End of backward: reduce units some of whose parameters got no gradient, wait, free."""
        if self._sync:
            for u in self.units:
                # In unit order, so that every rank issues the same collectives.
                if u.pending > 0 and (u.got_grad or u.backward_started):
                    u.pending = 0
                    self._post_backward(u)
            self._flush()
        for u in self.units:
            u.reshard()
        self._queued = False
        self._reset_backward()


# ---- the wrapper --------------------------------------------------------------
class FSDPModule(_Reduction, nn.Module):
    """Shard ``module``'s parameters over ``comm``'s group in units and run them FSDP-style.

    ``replicate`` (HSDP) is the group across which the shards are replicas:
    gradients reduce-scattered over ``comm`` are then all-reduced over it;
    ``dp_comm`` spans both (the whole data-parallel group) for the setup checks.
    """

    def __init__(self, module: nn.Module, comm: Comm, wrap: WrapPolicy = "auto", reshard_after_forward: bool = True,
                 replicate: Comm | None = None, param_init_fn: Callable[[nn.Module], None] | None = None,
                 device: torch.device | None = None, dp_comm: Comm | None = None,
                 collectives: str = "auto", offload: str = "none",
                 offload_device: torch.device | str = "cpu", expert_comm: Comm | None = None) -> None:
        super().__init__()
        self.module = module
        self.comm = comm
        # Expert-parallel parameters form units of their own, sharded over the ranks holding the same experts;
        # every unit's reduced gradient is divided by dp_size all the same (parallel/ep.py says why).
        self.expert_comm = expert_comm
        self.how = pick_collectives(collectives, comm)
        self.offload = offload
        self.replicate = replicate
        self.reshard_after_forward = reshard_after_forward
        self.dp_size = comm.size * (replicate.size if replicate is not None else 1)
        self._sync = True
        on_meta = any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))
        device = device or next((t.device for t in module.parameters() if t.device.type != "meta"),
                                torch.device("cpu"))
        if not on_meta:
            # Every rank must start from the same weights: rank 0's, as in DDP. (A
            # meta-device model is initialised identically on every rank instead,
            # from the same seed, so nothing full ever exists to broadcast.)
            everyone = dp_comm or comm
            check_same_parameters(module, everyone)
            for group, tensors in by_group(list(module.parameters()) + list(module.buffers()), everyone,
                                           expert_comm):
                broadcast_inplace(tensors, group, name="fsdp_broadcast")

        self.units = self._build_units(module, wrap)
        self.unit_of = {p: u for u in self.units for p in u.params}
        for u in self.units:
            u.allocate(device)
        self.materialize_peak_bytes = 0
        if on_meta:
            self._materialize(module, device, param_init_fn)
        else:
            with torch.no_grad():
                for u in self.units:
                    for i, p in enumerate(u.params):
                        u.take_shard(i, p.detach())
                        u.point_to_padded(i)
        if offload != "none":
            for u in self.units:
                u.offload_to(torch.device(offload_device), everything=offload == "all")
        self.shard_params = [s for u in self.units for s in u.shard_params]
        self.shard_names = {s: n for u in self.units for s, n in zip(u.shard_params, u.names)}
        self.numel_of = {s: p.numel() for u in self.units for s, p in zip(u.shard_params, u.params)}
        self.local_of = {s: local_numel(p.numel(), u.comm.size, u.comm.rank)
                         for u in self.units for s, p in zip(u.shard_params, u.params)}

        self._order: list[_Unit] = []
        self._prev_order: list[_Unit] = []
        self._queued = False
        self._rs: deque[tuple[_Unit, torch.Tensor, list[Any]]] = deque()
        self._ar: deque[tuple[_Unit, torch.Tensor, Handle | None]] = deque()
        self._hooks: list[Any] = []
        self._reset_backward()
        for u in self.units:
            m = self._module_of[u.index]
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward_hook(u)))
            self._hooks.append(m.register_forward_hook(self._post_forward_hook(u)))
            self._hooks += self._hook_grads(u.params)

    # ---- construction ----------------------------------------------------
    def _build_units(self, root: nn.Module, wrap: WrapPolicy) -> list[_Unit]:
        mods = unit_modules(root, wrap)
        if self.expert_comm is not None:  # each experts module a unit, so no unit mixes the two groups
            mods = [m for _, m in expert_modules(root) if m not in mods] + mods
        is_unit = {id(m) for m in mods}
        names = {id(m): n for n, m in root.named_modules()}
        # Each module's nearest enclosing unit, and each unit's parent unit.
        enclosing: dict[int, nn.Module] = {}
        parent: dict[int, nn.Module | None] = {id(root): None}

        def walk(m: nn.Module, unit: nn.Module) -> None:
            for c in m.children():
                if id(c) in enclosing:
                    continue
                if id(c) in is_unit:
                    parent[id(c)] = unit
                    enclosing[id(c)] = c
                    walk(c, c)
                else:
                    enclosing[id(c)] = unit
                    walk(c, unit)
        enclosing[id(root)] = root
        walk(root, root)

        def chain(u: nn.Module) -> list[int]:
            out = []
            cur: nn.Module | None = u
            while cur is not None:
                out.append(id(cur))
                cur = parent.get(id(cur))
            return out

        # A parameter shared by modules of different units belongs to their
        # lowest common ancestor unit, which stays gathered over every use.
        owner: dict[nn.Parameter, nn.Module] = {}
        for m in root.modules():
            for p in m.parameters(recurse=False):
                if not p.requires_grad:
                    continue
                u = enclosing[id(m)]
                if p in owner and owner[p] is not u:
                    mine = chain(u)
                    common = next(x for x in chain(owner[p]) if x in mine)
                    owner[p] = next(mm for mm in mods if id(mm) == common)
                else:
                    owner[p] = u
        fqn = {p: n for n, p in root.named_parameters()}
        for p, n in fqn.items():
            if not p.is_contiguous():
                raise ValueError(f"parameter '{n}' is not contiguous; FSDP shards flattened parameters")
        units: list[_Unit] = []
        self._module_of: dict[int, nn.Module] = {}
        # Units in module order (root first), parameters in named_parameters order: the same on every rank.
        order = sorted(mods, key=lambda m: list(names).index(id(m)))
        for m in order:
            params = [(n, p) for n, p in root.named_parameters() if owner.get(p) is m]
            if not params:
                continue
            experts = [is_expert(p) for _, p in params]
            if self.expert_comm is not None and any(experts) and not all(experts):
                raise ValueError(f"FSDP unit '{names[id(m)]}' holds expert-parallel and dense parameters; the "
                                 "experts module must be a unit of its own (the default wrap makes it one)")
            group = self.expert_comm if self.expert_comm is not None and all(experts) else self.comm
            u = _Unit(len(units), names[id(m)], params, group, self.how)  # type: ignore[assignment]
            self._module_of[u.index] = m  # type: ignore[index]
            units.append(u)  # type: ignore[arg-type]
        return units

    @torch.no_grad()
    def _materialize(self, root: nn.Module, device: torch.device,
                     init: Callable[[nn.Module], None] | None) -> None:
        """Allocate, initialise, shard and free one module's parameters at a time (meta-device models)."""
        where = {p: (u, i) for u in self.units for i, p in enumerate(u.params)}
        done: set[nn.Parameter] = set()
        later = getattr(init, "filled_later", None)  # a load fills these modules afterwards: no full copy needed
        for name, m in root.named_modules():
            own = [p for p in m.parameters(recurse=False) if p.device.type == "meta" and p not in done]
            bufs = [(k, b) for k, b in m.named_buffers(recurse=False) if b is not None and b.device.type == "meta"]
            if not own and not bufs:
                continue
            if later is not None and later(m):
                self._shards_only(m, own, bufs, where, device)
                done.update(own)
                continue
            if init is None and not hasattr(m, "reset_parameters"):
                raise ValueError(
                    f"module '{name}' ({type(m).__name__}) has tensors on the meta device but no reset_parameters(); "
                    "pass param_init_fn= to initialise it")
            for p in own:
                _to_device(p, device)
            # A parameter shared with an earlier module is already sharded (its
            # storage freed): give it scratch memory so this module's initialiser
            # cannot write into freed memory; its first initialisation stands.
            shared = [p for p in m.parameters(recurse=False) if p in done and p in where]
            for p in shared:
                p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
            for k, b in bufs:
                m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)
            (init or (lambda mod: mod.reset_parameters()))(m)  # type: ignore[operator]
            for p in shared:
                u, i = where[p]
                u.point_to_padded(i)
            self.materialize_peak_bytes = max(self.materialize_peak_bytes,
                                              sum(p.numel() * p.element_size() for p in own))
            for p in own:
                done.add(p)
                if p in where:
                    u, i = where[p]
                    u.take_shard(i, p.detach())
                    u.point_to_padded(i)

    @staticmethod
    def _shards_only(m: nn.Module, own: list[nn.Parameter], bufs: list[tuple[str, torch.Tensor]],
                     where: dict[nn.Parameter, tuple[_Unit, int]], device: torch.device) -> None:
        """A meta module whose every tensor a load fills afterwards (``init_from``): its parameters point at
        their (freed) padded storage at once, the shard left for the load; a parameter outside every unit (a
        frozen one) and the buffers get whole, uninitialised memory."""
        for p in own:
            if p in where:
                u, i = where[p]
                u.point_to_padded(i)
            else:
                _to_device(p, device)
        for k, b in bufs:
            m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)

    # ---- public --------------------------------------------------------
    @contextlib.contextmanager
    def input_pass(self) -> Iterator[None]:
        """A split backward's B (:mod:`shardwise.parallel.pp.split_backward`): units are gathered for their input
        gradients, no gradient is reduced and no unit's backward is counted as started; the units are freed
        again after it. The weight gradients come in W, whose passes end one backward of this wrapper
        (:meth:`backward_in_parts`), reduced as a plain backward's."""
        self._input_pass = True
        try:
            yield
        finally:
            self._input_pass = False
            for u in self.units:
                u.reshard()

    @contextlib.contextmanager
    def backward_in_parts(self) -> Iterator[None]:
        """A split backward's W: the autograd passes reuse nodes of the forward graph whose saved tensors
        include the weights, and W reaches no unit's output to gather it just in time, so every unit of this
        wrapper is gathered for the W and freed by its end (``_finish`` reshards)."""
        for u in self.units:
            u.unshard()
        with super().backward_in_parts():
            yield
        if not self._queued:  # no gradient arrived (every parameter frozen): free what was gathered
            for u in self.units:
                u.reshard()

    # no_sync() (GradSync): full gradients accumulate locally, no reduce-scatter. Parameters
    # stay sharded, so each micro-batch still all-gathers them.

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if self._order:
                self._prev_order = self._order
            self._order = []
            self._reset_backward()
        return self.module(*args, **kwargs)

    def grad_piece(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's (padded) piece of ``p``'s reduced gradient, created as zeros if none exists yet.

        Every rank of the shard group holds elements ``[r*c, r*c+c)`` of the
        flattened parameter whatever else its unit holds, so the pieces of one
        parameter line up across models that shard it alike (weights tied
        across pipeline stages are summed piece by piece).
        """
        u = self.unit_of[p]
        if u.grad_shard is None:
            u.set_grad_shard(torch.zeros(u.row_numel, dtype=u.dtype,
                                         device=u.host.device if u.host is not None else u.device))
        i = next(i for i, q in enumerate(u.params) if q is p)  # by identity: == would compare values
        return u.shard_params[i].grad  # type: ignore[return-value]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Shard rows, any unit gathered at this moment (zero bytes once resharded), gradients; host rows if
        offloaded."""
        params = [u.shard for u in self.units] + [b for u in self.units for b in u.padded]
        params += [p for p in self.module.parameters() if p not in self.unit_of]
        full = [p.grad for u in self.units for p in u.params if p.grad is not None]
        if self.offload == "none":
            return {"params": params, "grads": self.shard_grads() + full}
        # Offloaded: the optimizer's rows, gradient shards and states are host memory.
        return {"params": params, "grads": full, "host_params": [u.host for u in self.units if u.host is not None],
                "host_grads": self.shard_grads()}

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, list[tuple[str, int, Tensor]]]:
        """This rank's piece of each sharded parameter and of its optimizer states (frozen ones stay whole)."""
        return {p: shard_parts(s, u.comm.rank * chunk_numel(self.numel_of[s], u.comm.size), self.local_of[s],
                               optimizer, with_param=True)
                for u in self.units for s, p in zip(u.shard_params, u.params)}

    def shard_sources(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each shard parameter the optimizer steps -> the model's parameter it is a piece of."""
        return {s: p for u in self.units for s, p in zip(u.shard_params, u.params)}

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(reduced gradient piece, the parameter it belongs to) for every piece this rank holds."""
        return [(s.grad, p) for u in self.units for s, p in zip(u.shard_params, u.params) if s.grad is not None]

    def shard_grads(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units if u.grad_shard is not None]

    def gather_full(self, keep: bool = True) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full value on CPU (a collective over the shard group); ``keep=False``: this rank
        only takes part, one unit at a time, and returns an empty dict."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        with torch.no_grad():
            for u in self.units:
                for p, f in zip(u.params, u.gather_full(keep)):
                    out[p] = f.cpu()
        return out

    # ---- called by ShardedOptimizer -----------------------------------
    def before_step(self) -> None:
        self._flush()

    def after_step(self) -> None:
        """Nothing to spread: the next forward gathers the updated shards."""

    def forget_grad(self, p: nn.Parameter) -> None:
        u = self.unit_of.get(p)
        if u is not None and u.grad_shard is not None:
            forget_piece(u.params, u.shard_params, u.cleared, p, lambda: u.set_grad_shard(None))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units:
            u.cleared.clear()
            for p in u.params:
                drop_grad(p)
            if set_to_none:
                u.set_grad_shard(None)
            elif u.grad_shard is not None:
                u.grad_shard.zero_()
