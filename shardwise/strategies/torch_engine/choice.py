"""Which of PyTorch's engines runs a strategy under ``engine="torch"``, or why none does.

:func:`engine_for` turns a strategy object into the one that runs: the strategy itself under
``engine="shardwise"``; under ``"torch"`` the wrapper class of its row (:data:`WRAPPER_OF`, keyed by strategy
class; :mod:`shardwise.strategies.torch_engine.wrappers`), after :func:`refuse_torch` has refused, before any
process starts and naming what runs it instead, what torch has no engine for (:data:`NO_TORCH_ENGINE`), runs on
CUDA only (:data:`CUDA_ONLY`), or cannot run with the strategy's options. The rules themselves, and their reasons,
are written in the wing of the paradigm they belong to (``parallel/<wing>/torch_*.py``); this module holds the
table and asks them.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.comm.topology import Topology
from shardwise.dims import DP
from shardwise.layout import ENGINES, SHARDWISE
from shardwise.parallel.cp.torch_cp import CONTEXT_PARALLEL_CUDA_ONLY, refuse_torch_cp
from shardwise.parallel.dp.sync_bn import convert_sync_batchnorm
from shardwise.parallel.dp.torch_dp import (
    DATA_PARALLEL_CUDA_ONLY,
    SYNC_BATCHNORM_CUDA_ONLY,
    option_refusal,
    torch_sync_batchnorm,
)
from shardwise.parallel.pp.torch_pp import SP_IN_PIPELINE
from shardwise.strategies import pp as pp_strategy
from shardwise.strategies import tp as tp_strategy
from shardwise.strategies.base import Strategy
from shardwise.strategies.dp import threaded
from shardwise.strategies.dp.ddp import DDP
from shardwise.strategies.dp.fsdp import FSDP, HSDP
from shardwise.strategies.dp.zero import ZeRO1, ZeRO2
from shardwise.strategies.naive_mp import NaiveMP
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.ps import ParameterServer
from shardwise.strategies.single import Single
from shardwise.strategies.torch_engine.pipeline import TorchPP
from shardwise.strategies.torch_engine.wrappers import (
    TorchCP,
    TorchDDP,
    TorchDP,
    TorchEngine,
    TorchFSDP,
    TorchHSDP,
    TorchTP,
    TorchZeRO1,
    TorchZeRO2,
)

# The tables below are keyed by strategy class (the nearest in a class's MRO decides, so a user's subclass of
# DDP runs as DDP); a sw.Parallel's row is read from its sizes (_parallel_row).
# What PyTorch has no engine for at all.
NO_TORCH_ENGINE: dict[type[Strategy], str] = {ParameterServer: "a parameter server",
                                              NaiveMP: "naive model parallelism (layers placed on devices)"}
# What torch runs on CUDA only, and why not on CPU (each reason written beside its engine; refused on CPU before
# any process starts).
CUDA_ONLY = {"context parallelism": CONTEXT_PARALLEL_CUDA_ONLY, "strategy 'dp'": DATA_PARALLEL_CUDA_ONLY,
             "sync_batchnorm": SYNC_BATCHNORM_CUDA_ONLY}


# Each whole-model strategy's wrapper; FSDP's presets (ZeRO3, HSDP) find theirs through the MRO.
WRAPPER_OF: dict[type[Strategy], type[TorchEngine[Any]]] = {
    DDP: TorchDDP, ZeRO2: TorchZeRO2, ZeRO1: TorchZeRO1, HSDP: TorchHSDP, FSDP: TorchFSDP, tp_strategy.TP: TorchTP,
    pp_strategy.PP: TorchPP, threaded.DP: TorchDP}
# A row: the wrapper that runs the strategy, or the class that says why none does (a NO_TORCH_ENGINE key, a
# Parallel no wrapper takes, a user's own class), or None (a class none of the tables knows).
Row = type[Strategy] | None


def _row(strategy: Strategy) -> Row:
    """The wrapper of ``strategy``'s nearest known class (a ``sw.Parallel``'s from its sizes), or the class that
    torch's engines refuse (None: a class no table knows)."""
    for cls in type(strategy).__mro__:
        if cls in WRAPPER_OF:
            return WRAPPER_OF[cls]
        if cls in NO_TORCH_ENGINE:
            return cls
        if cls is Parallel and isinstance(strategy, Parallel):
            return _parallel_row(strategy)
    return None


def _parallel_row(strategy: Parallel) -> Row:
    """The wrapper that runs a ``sw.Parallel`` by its sizes, or :class:`Parallel` itself where none does (what
    else it splits, :func:`refuse_torch` says)."""
    if strategy.cp > 1:
        return TorchCP
    if (strategy.tp > 1 or strategy.sequence_parallel) and strategy.pp == 1:
        return TorchTP  # tp, then FSDP2 over dp (or nothing); TorchTP.check_model refuses dp > 1 with zero 0 or 1
    if strategy.pp > 1 and not strategy.sequence_parallel:
        # A pipeline, tp on each stage, then torch's DDP (ZeroRedundancyOptimizer with zero=1) or FSDP2 over dp;
        # dp > 1 over tp > 1 with zero 0 or 1 is refused by TorchPP.check_model, knowing the devices.
        return TorchPP
    if strategy.pp == strategy.tp == 1 and not strategy.sequence_parallel:  # split by dp alone: its zero's row
        return {0: TorchDDP, 1: TorchZeRO1, 2: TorchZeRO2}.get(strategy.zero,
                                                               TorchHSDP if strategy.replicate > 1 else TorchFSDP)
    return Parallel


def engine_for(strategy: Strategy, engine: str | None, *, sync_batchnorm: bool = False,
               cuda: bool = False) -> Strategy:
    """The strategy that runs ``strategy`` under the Trainer's ``engine`` (None: not given) and its own
    ``engine=`` (which wins; both given and different is refused), on CUDA or not. Raises ValueError, with what
    to use instead, for what the engine does not run."""
    for given in (engine, strategy.engine):
        if given is not None and given not in ENGINES:
            raise ValueError(f"engine must be 'shardwise' or 'torch', got {given!r}")
    if engine is not None and strategy.engine is not None and engine != strategy.engine:
        raise ValueError(f"Trainer(engine={engine!r}) conflicts with the strategy's own engine={strategy.engine!r} "
                         f"({type(strategy).__name__}(engine={strategy.engine!r})); give one of them")
    if (strategy.engine or engine or SHARDWISE) == SHARDWISE or strategy.name == Single.name:
        return strategy
    return _wrapper(strategy, sync_batchnorm=sync_batchnorm, cuda=cuda)(of=strategy)


def refuse_torch(strategy: Strategy, *, sync_batchnorm: bool, cuda: bool = False) -> None:
    """Raise, naming what to use instead, when engine="torch" cannot run ``strategy`` with these options (on CUDA
    or not)."""
    _wrapper(strategy, sync_batchnorm=sync_batchnorm, cuda=cuda)


def _wrapper(strategy: Strategy, *, sync_batchnorm: bool, cuda: bool) -> type[TorchEngine[Any]]:
    """The wrapper that runs ``strategy`` under engine="torch"; raises (see :func:`refuse_torch`) where none does."""
    name, row = strategy.name, _row(strategy)
    if isinstance(strategy, Parallel) and strategy.ep > 1:
        raise ValueError("engine='torch' has no engine for expert parallelism (ep > 1): PyTorch has none; "
                         "engine='shardwise' runs it")
    what = None if cuda else next(iter(_cuda_only(row, sync_batchnorm)), None)
    if what is not None:
        raise ValueError(f"engine='torch' runs {what} on CUDA only: {CUDA_ONLY[what]}; engine='shardwise' runs it "
                         "on CPU")
    if row is TorchCP and isinstance(strategy, Parallel):
        refuse_torch_cp(strategy.cp_mode, tp=strategy.tp, pp=strategy.pp, replicate=strategy.replicate,
                        zero=strategy.zero, sequence_parallel=strategy.sequence_parallel)
    if row in NO_TORCH_ENGINE:
        raise ValueError(f"engine='torch' has no engine for strategy {name!r}: PyTorch has none for "
                         f"{NO_TORCH_ENGINE[row]}; engine='shardwise' runs it")
    if row is Parallel:  # what no row takes: a pipeline with sequence parallelism
        raise ValueError(f"engine='torch' cannot run strategy {name!r} with pp > 1 and sequence_parallel=True: "
                         f"{SP_IN_PIPELINE}; engine='shardwise' runs it")
    if row is None or not issubclass(row, TorchEngine):
        raise ValueError(f"engine='torch' has no engine for strategy {name!r} (not a built-in strategy); "
                         "engine='shardwise' runs it")
    if sync_batchnorm and not issubclass(row, TorchDDP):  # torch's SyncBatchNorm is for its DDP
        raise ValueError(f"engine='torch' does not support sync_batchnorm outside torch's DDP ('ddp', 'zero1') yet "
                         f"(strategy {name!r}); engine='shardwise' does")
    why = _option_refusal(strategy, row)
    if why is not None:
        raise ValueError(f"engine='torch' cannot run strategy {name!r} with {why}; engine='shardwise' runs it")
    return row


def _cuda_only(row: Row, sync_batchnorm: bool) -> list[str]:
    """What of this run torch runs on CUDA only (keys of :data:`CUDA_ONLY`)."""
    asks = {"context parallelism": row is TorchCP, "strategy 'dp'": row is TorchDP, "sync_batchnorm": sync_batchnorm}
    return [what for what, asked in asks.items() if asked]


def _option_refusal(strategy: Strategy, row: type[TorchEngine[Any]]) -> str | None:
    """Why torch's engine ``row`` cannot run an option of ``strategy`` (None: it runs them all)."""
    # The options some strategies have (ZeRO's and FSDP's offload, DDP's all-reduce), read where they exist.
    return option_refusal(offload=getattr(strategy, "offload", "none"),
                          offload_device=getattr(strategy, "offload_device", "cpu"),
                          allreduce=getattr(strategy, "allreduce", "native"),
                          reduce_dtype=getattr(strategy, "reduce_dtype", None),
                          fsdp_alone=row in (TorchFSDP, TorchHSDP))  # sw.Parallel(zero=3) runs as tp, then FSDP2


def synced_batchnorm(model: nn.Module, strategy: Strategy, topo: Topology) -> nn.Module:
    """``model`` with BatchNorm normalising over the whole global batch (``sync_batchnorm=True``): torch's
    ``nn.SyncBatchNorm`` under torch's DDP family (CUDA; refuse_torch refused it elsewhere), our synchronised
    BatchNorm over dp otherwise. Returns the root (torch replaces a model that is itself a BatchNorm)."""
    if isinstance(strategy, TorchDDP):
        return torch_sync_batchnorm(model, topo)
    if topo.size(DP) > 1:
        convert_sync_batchnorm(model, topo.comm(DP))
    return model


__all__ = ["CUDA_ONLY", "ENGINES", "NO_TORCH_ENGINE", "WRAPPER_OF", "engine_for", "refuse_torch", "synced_batchnorm"]
