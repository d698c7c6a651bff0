"""``engine="torch"``: the same strategy names and the same Trainer, run by PyTorch's own engines.

:func:`~shardwise.strategies.torch_engine.choice.engine_for` turns a strategy object into the one that runs
(the strategy itself under ``engine="shardwise"``); under ``"torch"``, the class here of its row:

====================  =====================================================================
``ddp``               ``torch.nn.parallel.DistributedDataParallel`` (:class:`TorchDDP`)
``zero1``             ``torch.distributed.optim.ZeroRedundancyOptimizer`` under DDP (:class:`TorchZeRO1`)
``zero2``             FSDP2 with ``reshard_after_forward=False`` (:class:`TorchZeRO2`): parameters
                      are sharded between steps too, which our ZeRO-2 does not do
``zero3``, ``fsdp``   FSDP2 ``fully_shard`` on each of our FSDP's units, then the root, on a 1-D
                      mesh over the data-parallel ranks (:class:`TorchFSDP`)
``hsdp``              FSDP2 on the 2-D (replicate, shard) mesh (:class:`TorchHSDP`)
``tp``                DTensor ``parallelize_module`` with torch's styles for our plan, also
                      ``sw.Parallel`` split by tp alone, ``sequence_parallel`` included (:class:`TorchTP`)
``Parallel(tp, dp)``  tp, then FSDP2 over dp on the same root mesh (torchtitan's order): ``zero=3``,
                      ``zero=2`` (no resharding after the forward), HSDP with ``replicate``; dp over
                      tp with ``zero`` 0 or 1 refused (torch's DDP and DTensor parameters)
``pp``                ``torch.distributed.pipelining``: our stages (same cut, same tied weights kept
                      in sync) as ``PipelineStage`` objects, run by torch's schedule for ours, on the
                      same placement and in the same order: gpipe ``ScheduleGPipe``, 1f1b
                      ``Schedule1F1B``, interleaved ``ScheduleInterleaved1F1B``, zb-h1
                      ``ScheduleInterleavedZeroBubble`` given one stage per rank (the paper's ZB1P,
                      there ZB-H1), zbv ``ScheduleZBVZeroBubble``, dualpipev ``ScheduleDualPipeV``
                      (the V's: the same actions, ours run a few more backwards whole)
                      (:class:`~shardwise.strategies.torch_engine.pipeline.TorchPP`)
``Parallel(pp, ..)``  torchtitan's order on each rank's stage chunks: the pipeline's split, tp
                      (``parallelize_module`` on the stage's modules), then over dp FSDP2 (``zero=3``,
                      ``zero=2`` unresharded, HSDP with ``replicate``) or torch's DDP (``zero=0``,
                      ``ZeroRedundancyOptimizer`` per stage with ``zero=1``; under zbv, gradients
                      averaged over dp after the schedule instead); sequence parallelism refused
``Parallel(dp, ..)``  split by dp alone: the row of its ``zero`` (ddp, zero1, zero2, fsdp; hsdp with
                      ``replicate``)
``Parallel(cp)``      on CUDA: ``context_parallel`` around each step's micro-batches, attention through SDPA
                      (:mod:`shardwise.parallel.cp.torch_cp`), with ``dp``: torch's DDP over dp x cp
                      (``zero=0``) or FSDP2 over dp_shard x cp (``zero=3``) (:class:`TorchCP`)
``dp``                on CUDA: ``torch.nn.DataParallel`` over the strategy's devices (:class:`TorchDP`)
``sync_batchnorm``    on CUDA, under torch's DDP (``ddp``, ``zero1``): ``nn.SyncBatchNorm`` over dp
====================  =====================================================================

The options around the engine map to torch's where they mean the same: ``offload="all"`` is FSDP2's
``CPUOffloadPolicy`` (:meth:`TorchFSDP.offload_policy`), a meta-device model is initialised into FSDP2's shards
or DDP's whole tensors (:mod:`shardwise.parallel.dp.torch_meta`), and DDP's ``reduce_dtype`` is torch's compress
hook of that dtype (:data:`~shardwise.parallel.dp.torch_dp.COMPRESS_HOOKS`). The order in which the compositions
are built (pipeline split, tp, then FSDP2 or DDP) is :mod:`shardwise.parallel.torch_parallelize`'s.

Everything else is refused before any process starts, naming what runs it, by
:mod:`shardwise.strategies.torch_engine.choice`; so are the three CUDA-only engines on CPU, with the reason. The
engines keep the model's own parameter names, so parameter groups, the final state
dict and the layout-free checkpoint (:mod:`shardwise.checkpoint`) are the same as
under our engines: a run saved under one engine resumes under the other. The one
key mapping is :meth:`TorchEngine.checkpoint_held` (DDP's ``module.`` prefix is
dropped by :func:`~shardwise.step.unwrap`; FSDP2's DTensor shards become flat runs;
``ZeroRedundancyOptimizer``'s states are those of its partition, each saved by the rank that owns it).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.nn.parallel import DistributedDataParallel

from shardwise.checkpoint.held import Held, named_state
from shardwise.comm.topology import Topology
from shardwise.dims import DP, DP_CP, DP_SHARD
from shardwise.layout import TORCH, RunLayout
from shardwise.optim.param_groups import GroupedFactory
from shardwise.parallel.accounting import with_optimizer_states
from shardwise.parallel.clip import clip_global_norm
from shardwise.parallel.cp.torch_cp import (
    TorchContextParallel,
    cp_mesh,
    dp_shard_cp_mesh,
    refuse_float64,
)
from shardwise.parallel.dp.fsdp_units import unit_modules
from shardwise.parallel.dp.threaded import DataParallelModule
from shardwise.parallel.dp.torch_dp import (
    compress_gradients,
    dp_mesh,
    fully_shard_units,
    hsdp_mesh,
    refuse_reduce_dtype,
    torch_ddp,
    zero_redundancy,
)
from shardwise.parallel.dp.torch_meta import init_meta
from shardwise.parallel.dtensor import (
    dim0_run,
    full,
    local,
)
from shardwise.parallel.torch_parallelize import torch_parallelize_tp
from shardwise.parallel.tp.plans import Plan, resolve_plan
from shardwise.parallel.tp.torch_tp import (
    clip_grad_norm_,
    on_tp_mesh,
    refuse_ddp_over_tp,
    refuse_plan,
    tp_slice,
)
from shardwise.step import LossFn, OptimizerFactory, StepRun, unwrap
from shardwise.strategies import tp as tp_strategy
from shardwise.strategies.base import Strategy
from shardwise.strategies.dp import threaded as threaded_strategy
from shardwise.strategies.dp.family import on_meta
from shardwise.strategies.parallel import Parallel
from shardwise.torch_private import forget_dtensor_plans

# The strategy a wrapper runs: each wrapper says which classes it takes, so that it reads their fields typed.
S = TypeVar("S", bound=Strategy)


@dataclass
class TorchEngine(Strategy, Generic[S]):
    """A shardwise strategy (``of``: its layout, its options) run by a PyTorch engine."""

    of: S
    comm_counted: ClassVar[bool] = False  # torch's DDP, FSDP2, DTensor and pipelining send outside our Comm
    inits_meta: ClassVar[bool] = False  # whether setup gives a meta-device model memory (torch_meta.init_meta)

    def __post_init__(self) -> None:
        # Checkpoints, messages and the planner see the same name: the wrapped strategy's, on this instance (the
        # class's own is the base's).
        object.__setattr__(self, "name", self.of.name)

    def layout(self, devices: int) -> RunLayout:
        return replace(self.of.layout(devices), engine=TORCH)  # the one place a run's engine is written

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        self.of.check_model(model, devices, batch_size, accumulate_grad_batches, backend)

    def owns_loss(self, topo: Topology) -> bool:
        return self.of.owns_loss(topo)  # one loss per tp group, as under our engine

    def check_setup(self, model: nn.Module) -> None:
        if not dist.is_initialized():  # one process started without a group: torch's engines need one
            raise ValueError(f"engine='torch' runs torch's engine for strategy {self.name!r} in a process group, "
                             "and this one-process run has none: launch it with `shardwise run --nproc 1`, or "
                             "drop engine='torch' (one device splits nothing)")
        forget_dtensor_plans()  # an earlier group's meshes, equal to this one's, may be in torch's caches
        if on_meta(model) and not self.inits_meta:
            raise ValueError(f"engine='torch' does not set up a model on the meta device under strategy "
                             f"{self.name!r} yet (ddp, zero1, zero2, zero3, fsdp and hsdp do); build it on the "
                             "CPU, or use engine='shardwise', which materialises it shard by shard")

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """The layout-free checkpoint's keys for torch's engines: the model's own names (the one key mapping).
        A parameter's optimizer states are where this rank's optimizer keeps them: all of them (DDP), its
        shard's (FSDP2), or only those of the parameters its ``ZeroRedundancyOptimizer`` partition owns."""
        return held_named(named_state(unwrap(model)), optimizer)

    def partitioned(self, model: nn.Module, optimizer_fn: OptimizerFactory, base: torch.optim.Optimizer,
                    topo: Topology) -> torch.optim.Optimizer:
        """``base`` as ``ZeroRedundancyOptimizer`` over the dp ranks (ZeRO-1 under torch's DDP)."""
        # It partitions by parameter group once it is built, so the run's groups must be final before: regroup
        # the factory's optimizer now (the Trainer's second regrouping changes nothing).
        if isinstance(optimizer_fn, GroupedFactory):
            optimizer_fn.finish(self.param_names(model))
        return zero_redundancy(base, topo)


def held_named(named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> list[Held]:
    """:class:`Held` entries of ``named`` tensors (the unsplit model's names) and their optimizer states."""
    out: list[Held] = []
    for name, t in named:
        out.append(_held(f"model.{name}", t.detach()))
        for k, v in optimizer.state.get(t, {}).items():
            if isinstance(v, torch.Tensor):
                out.append(_held(f"optim.{name}.{k}", v))
    return out


def _held(key: str, t: torch.Tensor) -> Held:
    if on_tp_mesh(t):  # our tp layout's slice (torch.chunk's equals ours: every split is even), or a replica
        return Held(key, local(t), 0, tp_slice(t))
    start, data = dim0_run(t)  # an FSDP2 shard: a run of this rank's tp slice (the whole tensor without tp)
    return Held(key, data, start, tp_slice(t))


@dataclass
class TorchDDP(TorchEngine[S]):
    """``strategy="ddp"`` under torch's ``DistributedDataParallel`` (DDP's ``bucket_cap_mb`` and
    ``find_unused_parameters`` carry over; ``reduce_dtype`` float16 or bfloat16 becomes torch's compress hook
    of that dtype). A meta-device model gets whole memory first, initialised module by module."""

    inits_meta: ClassVar[bool] = True

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        super().check_model(model, devices, batch_size, accumulate_grad_batches, backend)
        refuse_reduce_dtype(getattr(self.of, "reduce_dtype", None), backend)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.check_setup(model)
        if on_meta(model):  # DDP wraps whole tensors
            init_meta(model, topo.device)
        model = model.to(topo.device)
        ddp = torch_ddp(model, topo, getattr(self.of, "bucket_cap_mb", None),
                        getattr(self.of, "find_unused_parameters", False))
        compress_gradients(ddp, topo, getattr(self.of, "reduce_dtype", None))
        return ddp, optimizer_fn(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _torch_ddp(model).no_sync()


@dataclass
class TorchZeRO1(TorchDDP[S]):
    """``strategy="zero1"`` under torch's DDP with ``ZeroRedundancyOptimizer``: full gradients all-reduced by
    DDP, each rank steps the parameters its partition owns (whole tensors, greedily balanced by size) and
    broadcasts them."""

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        ddp, base = super().setup(model, optimizer_fn, topo)
        return ddp, self.partitioned(ddp, optimizer_fn, base, topo)


@dataclass
class TorchDTensors(TorchEngine[S]):
    """An engine that keeps the model's parameters, some or all of them as DTensors (FSDP2, tp)."""

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return {k: full(v.detach()).cpu().clone() for k, v in model.state_dict().items()}

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        params = [local(p) for p in model.parameters()]
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        out = with_optimizer_states({"params": params, "grads": grads}, optimizer)
        out["optimizer"] = [local(v) for v in out["optimizer"]]
        return out


AnyTorchFSDP = TypeVar("AnyTorchFSDP", bound="TorchFSDP[Any]")


@dataclass
class TorchFSDP(TorchDTensors[S]):
    """``strategy="fsdp"``/``"zero3"`` under FSDP2: ``fully_shard`` on the units our FSDP picks (its ``wrap``),
    then the root; ``reshard_after_forward`` carries over, and ``offload="all"`` is FSDP2's ``CPUOffloadPolicy``.
    Parameters stay the model's, as DTensors. A meta-device model is sharded on meta, then only the shards get
    memory, initialised module by module (``param_init_fn``, else each module's ``reset_parameters()``)."""

    inits_meta: ClassVar[bool] = True
    shard_dim: ClassVar[str] = DP  # the ranks whose shards together hold each parameter once

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.check_setup(model)
        meta = on_meta(model)
        if not meta:
            model = model.to(topo.device)
        units = unit_modules(model, getattr(self.of, "wrap", "auto"))
        policy = self.offload_policy(topo)
        fully_shard_units(units, self.mesh(topo), self.reshard_after_forward(), policy)
        if meta:
            init_meta(model, topo.device, getattr(self.of, "param_init_fn", None),
                      shards_on="cpu" if self.offloaded() else topo.device)
        return model, optimizer_fn(model.parameters())

    def offloaded(self) -> bool:
        """Our ``offload="all"``: no shard kept on the device, the optimizer steps on the CPU."""
        return getattr(self.of, "offload", "none") == "all"

    def offload_policy(self, topo: Topology) -> OffloadPolicy:
        """FSDP2's for our ``offload``: ``"all"`` is ``CPUOffloadPolicy``, in pinned memory where there is an
        accelerator to copy to (pinning needs one)."""
        if not self.offloaded():
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=topo.device.type != "cpu")

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        """The shards as :class:`TorchDTensors` counts them; under ``CPUOffloadPolicy`` every one of them (frozen
        parameters' too) lives in host memory, and is counted there, as our offload's are."""
        out = super().state_tensors(model, optimizer)
        if not self.offloaded():
            return out
        return {"params": [], "grads": [], "optimizer": [], "host_params": out["params"],
                "host_grads": out["grads"], "host_optimizer": out["optimizer"]}

    def materialises_meta(self) -> bool:
        return self.of.materialises_meta()  # FSDP2 for our FSDP's presets: sharded on meta first

    def with_param_init(self: AnyTorchFSDP, init: Callable[[nn.Module], None]) -> AnyTorchFSDP:
        return replace(self, of=self.of.with_param_init(init))

    def mesh(self, topo: Topology) -> DeviceMesh:
        """The mesh FSDP2 shards over: the data-parallel ranks."""
        return dp_mesh(topo)

    def reshard_after_forward(self) -> bool:
        return bool(getattr(self.of, "reshard_after_forward", True))

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return _no_gradient_sync(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        if not self.offloaded():
            # torch's clip handles DTensor gradients: the norm of the shards is reduced over the mesh.
            return full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        # Offloaded gradients are on the CPU, which torch's clip would reduce over the mesh's backend (NCCL cannot):
        # this rank's squares are summed on the host, and the scalar all-reduced on the device over the shards.
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        return clip_global_norm(grads, grads, max_norm, [(topo.comm(self.shard_dim), "torch_fsdp_clip")],
                                topo.device)


@dataclass
class TorchZeRO2(TorchFSDP[S]):
    """``strategy="zero2"`` under FSDP2 with ``reshard_after_forward=False`` (torch's answer to ZeRO-2, FSDP1's
    SHARD_GRAD_OP): gradients and optimizer states sharded, parameters gathered from a unit's forward to its
    backward; unlike our ZeRO-2 they are sharded between steps too. Units as our FSDP's default ``wrap``."""

    def reshard_after_forward(self) -> bool:
        return False


@dataclass
class TorchHSDP(TorchFSDP[S]):
    """``strategy="hsdp"`` under FSDP2 on the 2-D (replicate, shard) mesh of the run's replicas of shards:
    each parameter a DTensor replicated over the first dimension and sharded on dim 0 over the second."""

    shard_dim: ClassVar[str] = DP_SHARD

    def mesh(self, topo: Topology) -> DeviceMesh:
        return hsdp_mesh(topo)


@dataclass
class TorchTP(TorchDTensors[tp_strategy.TP | Parallel]):
    """``strategy="tp"`` (and ``sw.Parallel`` split by tp, ``sequence_parallel`` included) under DTensor's
    ``parallelize_module``, with torch's styles for our plan (:mod:`shardwise.parallel.tp.torch_tp`); with
    ``Parallel(dp=N, zero=3)``, then FSDP2 ``fully_shard`` on our units over dp (torchtitan's order)."""

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.check_setup(model)
        of = self.of
        data = of.data_options() if isinstance(of, Parallel) else None  # a TP strategy's dp is 1
        model = torch_parallelize_tp(model.to(topo.device), topo, of.tensor_parallel_plan(), self.sequence_parallel(),
                                     data)
        return model, optimizer_fn(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        # FSDP2 over dp: its own switch; tp alone reduces no gradients over ranks.
        return _no_gradient_sync(model) if isinstance(model, FSDPModule) else contextlib.nullcontext()

    def plan(self, model: nn.Module) -> Plan:
        return resolve_plan(self.of.tensor_parallel_plan(), model)

    def sequence_parallel(self) -> bool:
        return bool(getattr(self.of, "sequence_parallel", False))

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        super().check_model(model, devices, batch_size, accumulate_grad_batches, backend)
        layout = self.layout(devices)
        refuse_ddp_over_tp(self.name, layout.dp, layout.tp, getattr(self.of, "zero", 0))
        refuse_plan(self.name, self.plan(model), model, self.sequence_parallel())

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        return clip_grad_norm_(list(model.parameters()), max_norm)


@dataclass
class TorchCP(TorchFSDP[Parallel]):
    """``sw.Parallel(cp=N)`` on CUDA under torch's ``context_parallel`` (:mod:`shardwise.parallel.cp.torch_cp`): each
    step's micro-batches cut along the sequence with their positions, forward and backward inside one block, the
    attention through SDPA; gradients averaged over dp x cp by torch's DDP (``zero=0``), or reduce-scattered by
    FSDP2 over dp_shard x cp (``zero=3``, on our units; torchtitan's layout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.context: TorchContextParallel | None = None  # built in the rank, by setup

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.check_setup(model)
        # On the model's own modules, before a wrapper: the position hooks and a Hugging Face model's SDPA.
        self.context = TorchContextParallel(cp_mesh(topo))
        self.context.prepare(model)
        if self.sharded():
            return super().setup(model, optimizer_fn, topo)
        model = model.to(topo.device)
        return torch_ddp(model, topo, self.of.bucket_cap_mb, dim=DP_CP), \
            optimizer_fn(model.parameters())

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        super().check_model(model, devices, batch_size, accumulate_grad_batches, backend)
        refuse_float64(self.name, model)

    def sharded(self) -> bool:
        """FSDP2 over dp_shard x cp (``zero=3``), else torch's DDP over dp x cp."""
        return self.of.zero == 3

    def mesh(self, topo: Topology) -> DeviceMesh:
        return dp_shard_cp_mesh(topo)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return super().no_sync(model) if self.sharded() else _torch_ddp(model).no_sync()

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        with self._context().sharded(micro_batches) as local:
            return super().train_step(model, local, loss_fn, topo, run)

    def eval_step(self, model: nn.Module, x: Any, y: Any, fn: LossFn, topo: Topology,
                  run: StepRun = StepRun()) -> torch.Tensor | None:
        with self._context().sharded([(x, y)]) as [(x, y)]:  # this rank's tokens, as evaluation joins them
            return super().eval_step(model, x, y, fn, topo, run)

    def _context(self) -> TorchContextParallel:
        assert self.context is not None, "setup builds the context"
        return self.context

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return super().full_state_dict(unwrap(model), topo)  # DDP's module. prefix dropped


@dataclass
class TorchDP(TorchEngine[threaded_strategy.DP]):
    """``strategy="dp"`` on CUDA under ``torch.nn.DataParallel``: one process, the batch scattered over the
    strategy's devices (primary first), replicas in threads, gradients summed on the primary device; the same
    design as ours (:mod:`shardwise.parallel.dp.threaded`), so the devices, the primary-device check and the
    optimizer are our DP's."""

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        # One process drives every device: DataParallel needs no process group (no check_setup).
        ours, optimizer = self.of.setup(model, optimizer_fn, topo)
        assert isinstance(ours, DataParallelModule)
        return nn.DataParallel(ours.module, device_ids=ours.devices, output_device=ours.devices[0]), optimizer


def _torch_ddp(model: nn.Module) -> DistributedDataParallel:
    """The model torch's DDP wrapped (:func:`~shardwise.parallel.dp.torch_dp.torch_ddp`)."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"expected a model torch's DDP wrapped, got {type(model).__name__}")
    return model


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: gradients accumulate unsharded and unreduced until the block ends."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"expected a model FSDP2 sharded, got {type(model).__name__}")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


__all__ = ["TorchCP", "TorchDDP", "TorchDP", "TorchDTensors", "TorchEngine", "TorchFSDP", "TorchHSDP", "TorchTP",
           "TorchZeRO1", "TorchZeRO2", "held_named"]
