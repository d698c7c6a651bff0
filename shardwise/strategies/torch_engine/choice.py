"""Which of PyTorch's engines runs a strategy under ``engine="torch"``, or why none does.

:func:`engine_for` turns a strategy object into the one that runs: the strategy itself under
``engine="shardwise"``; under ``"torch"`` the :mod:`shardwise.strategies.torch_engine.wrappers` class of its row
(:data:`TORCH`), after :func:`refuse_torch` has refused, before any process starts and naming what runs it
instead, what torch has no engine for (:data:`NO_TORCH_ENGINE`), runs on CUDA only (:data:`CUDA_ONLY`), or
cannot run with the strategy's options.
"""
from __future__ import annotations

import functools

from torch import nn

from shardwise.comm.topology import Topology
from shardwise.dims import CP, DP, EP, PP, TP
from shardwise.parallel.dp.sync_bn import convert_sync_batchnorm
from shardwise.parallel.dp.torch_dp import torch_sync_batchnorm
from shardwise.strategies.base import Strategy
from shardwise.strategies.torch_engine.wrappers import (
    COMPRESS_HOOKS,
    TorchCP,
    TorchDDP,
    TorchDP,
    TorchEngine,
    TorchFSDP,
    TorchHSDP,
    TorchPP,
    TorchTP,
    TorchZeRO1,
    TorchZeRO2,
)

ENGINES = ("shardwise", "torch")

# The tables below are keyed by strategy class (the nearest in a class's MRO decides, so a user's subclass of
# DDP runs as DDP): the strategy names "dp", "tp" and "pp" are also dimension names, written only in dims.py.
# Why torch's engines cannot run a sw.Parallel that no row below takes (a pipeline with sequence parallelism).
SP_IN_PIPELINE = ("torch's sequence-parallel styles for our plan hold the sequence region from the embedding to the "
                  "head within one module (shardwise.parallel.tp.torch_tp), and a pipeline stage holds only part of it")
# What PyTorch has no engine for at all.
NO_TORCH_ENGINE = {"ParameterServer": "a parameter server",
                   "NaiveMP": "naive model parallelism (layers placed on devices)"}
# What torch runs on CUDA only, and why not on CPU (torch 2.13; refused on CPU before any process starts).
CUDA_ONLY = {
    "context parallelism": "torch's context_parallel runs its ring attention through SDPA's flash, efficient and "
                           "cuDNN kernels, which are CUDA's, and has no sharding strategy for the CPU's "
                           "(aten._scaled_dot_product_flash_attention_for_cpu)",
    "strategy 'dp'": "torch.nn.DataParallel splits the batch over CUDA devices only (on CPU it runs the module "
                     "unsplit, on one replica)",
    "sync_batchnorm": "torch's nn.SyncBatchNorm takes CUDA inputs only (on CPU its forward raises 'SyncBatchNorm "
                      "expected input tensor to be on GPU', and its statistics kernel, batch_norm_stats, has no "
                      "CPU implementation)"}


TORCH: dict[str, type[TorchEngine]] = {"DDP": TorchDDP, "ZeRO1": TorchZeRO1, "ZeRO2": TorchZeRO2,
                                       "ZeRO3": TorchFSDP, "FSDP": TorchFSDP, "HSDP": TorchHSDP, "TP": TorchTP,
                                       "PP": TorchPP, "CP": TorchCP, "DP": TorchDP}


def _row(strategy: Strategy) -> str | None:
    """The name of the nearest class of ``strategy`` that the tables here know (None: none, a user's own)."""
    known = {*TORCH, *NO_TORCH_ENGINE, "Parallel"}  # a Parallel's row is read from its sizes below
    row = next((c.__name__ for c in type(strategy).__mro__ if c.__name__ in known), None)
    if row == "Parallel" and getattr(strategy, CP) > 1:  # what else it splits, refuse_torch says
        return "CP"
    if row == "Parallel" and _tp_then_fsdp(strategy):
        return "TP"
    if row == "Parallel" and _pp_composed(strategy):
        return "PP"
    return _data_parallel_row(strategy) if row == "Parallel" and _dp_alone(strategy) else row


def _dp_alone(strategy: Strategy) -> bool:
    """Whether a ``sw.Parallel`` splits by dp alone (its form over dp is one of the whole-model strategies)."""
    field = functools.partial(getattr, strategy)
    return field(PP) == field(TP) == field(CP) == 1 and not field("sequence_parallel")


def _data_parallel_row(strategy: Strategy) -> str:
    """The whole-model strategy a ``sw.Parallel`` split by dp alone is: its ``zero`` stage (HSDP with replicas)."""
    zero, replicate = strategy.zero, strategy.replicate  # type: ignore[attr-defined]
    return {0: "DDP", 1: "ZeRO1", 2: "ZeRO2"}.get(zero, "HSDP" if replicate > 1 else "FSDP")


def _tp_then_fsdp(strategy: Strategy) -> bool:
    """Whether a ``sw.Parallel`` is what :class:`TorchTP` runs: tp (or sequence parallelism on a tp mesh of one),
    no pipeline, then FSDP2 over dp (or nothing); TorchTP.check_model refuses dp > 1 with zero 0 or 1."""
    field = functools.partial(getattr, strategy)
    return bool(field(TP) > 1 or field("sequence_parallel")) and field(PP) == 1


def _pp_composed(strategy: Strategy) -> bool:
    """Whether a ``sw.Parallel`` is what :class:`TorchPP` runs: a pipeline, then tp on each stage, then over dp
    torch's DDP (``zero=0``, ``ZeroRedundancyOptimizer`` under it with ``zero=1``) or FSDP2 (``zero=2`` or 3,
    HSDP with replicas), with no sequence parallelism (dp > 1 over tp > 1 with zero 0 or 1 is refused by
    TorchPP.check_model, knowing the devices)."""
    field = functools.partial(getattr, strategy)
    return field(PP) > 1 and not field("sequence_parallel")


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
    if (strategy.engine or engine or "shardwise") == "shardwise" or strategy.name == "single":
        return strategy
    refuse_torch(strategy, sync_batchnorm=sync_batchnorm, cuda=cuda)
    return TORCH[_row(strategy)](of=strategy)  # type: ignore[index]  # refuse_torch let only these through


def refuse_torch(strategy: Strategy, *, sync_batchnorm: bool, cuda: bool = False) -> None:
    """Raise, naming what to use instead, when engine="torch" cannot run ``strategy`` with these options (on CUDA
    or not)."""
    name, row = strategy.name, _row(strategy)
    if getattr(strategy, EP, 1) > 1:  # sw.Parallel's ep= and cp= fields, named as the dimensions
        raise ValueError("engine='torch' has no engine for expert parallelism (ep > 1): PyTorch has none; "
                         "engine='shardwise' runs it")
    what = None if cuda else next(iter(_cuda_only(row, sync_batchnorm)), None)
    if what is not None:
        raise ValueError(f"engine='torch' runs {what} on CUDA only: {CUDA_ONLY[what]}; engine='shardwise' runs it "
                         "on CPU")
    if row == "CP":
        refuse_torch_cp(strategy)
    if row in NO_TORCH_ENGINE:
        raise ValueError(f"engine='torch' has no engine for strategy {name!r}: PyTorch has none for "
                         f"{NO_TORCH_ENGINE[row]}; engine='shardwise' runs it")
    if row == "Parallel":  # what no row takes: a pipeline with sequence parallelism
        raise ValueError(f"engine='torch' cannot run strategy {name!r} with pp > 1 and sequence_parallel=True: "
                         f"{SP_IN_PIPELINE}; engine='shardwise' runs it")
    if row not in TORCH:
        raise ValueError(f"engine='torch' has no engine for strategy {name!r} (not a built-in strategy); "
                         "engine='shardwise' runs it")
    if sync_batchnorm and not issubclass(TORCH[row], TorchDDP):  # torch's SyncBatchNorm is for its DDP
        raise ValueError(f"engine='torch' does not support sync_batchnorm outside torch's DDP ('ddp', 'zero1') yet "
                         f"(strategy {name!r}); engine='shardwise' does")
    why = _option_refusal(strategy, row)
    if why is not None:
        raise ValueError(f"engine='torch' cannot run strategy {name!r} with {why}; engine='shardwise' runs it")


def _cuda_only(row: str | None, sync_batchnorm: bool) -> list[str]:
    """What of this run torch runs on CUDA only (keys of :data:`CUDA_ONLY`)."""
    asks = {"context parallelism": row == "CP", "strategy 'dp'": row == "DP", "sync_batchnorm": sync_batchnorm}
    return [what for what, asked in asks.items() if asked]


def refuse_torch_cp(strategy: Strategy) -> None:
    """Refuse what :class:`TorchCP` does not run of a ``sw.Parallel`` with cp > 1: torch's ring only, split by
    nothing but dp, gradients through DDP or FSDP2 without replicas."""
    field = functools.partial(getattr, strategy)
    if field("cp_mode") != "ring":
        raise ValueError(f"engine='torch' has no engine for cp_mode={field('cp_mode')!r}: torch's context_parallel "
                         "is ring attention only; use cp_mode='ring', or engine='shardwise'")
    others = {TP: field(TP), PP: field(PP), "replicate": field("replicate")}
    split = {k: v for k, v in others.items() if v != 1}
    if split or field("sequence_parallel") or field("zero") not in (0, 3):
        given = ", ".join(f"{k}={v}" for k, v in {**split, "zero": field("zero")}.items())
        raise ValueError(f"engine='torch' runs context parallelism only with dp yet (sw.Parallel(cp=N, dp=M) with "
                         f"zero=0: torch's DDP over dp x cp, or zero=3: FSDP2 over dp x cp), got {given}"
                         f"{', sequence_parallel=True' if field('sequence_parallel') else ''}; engine='shardwise' "
                         "runs it")




def _option_refusal(strategy: Strategy, row: str | None) -> str | None:
    """Why torch's engine for ``row`` cannot run an option of ``strategy`` (None: it runs them all): the end of
    the sentence "engine='torch' cannot run strategy X with ..."."""
    offload, allreduce = getattr(strategy, "offload", "none"), getattr(strategy, "allreduce", "native")
    reduce_dtype = getattr(strategy, "reduce_dtype", None)
    if offload == "optimizer":
        return ("offload='optimizer': torch's one offload is FSDP2's CPUOffloadPolicy, which keeps the parameter "
                "shards on the CPU too and copies them over at each gather (our offload='all'); no torch engine "
                "keeps a shard on the device and offloads only the optimizer")
    if offload == "all" and row not in ("FSDP", "ZeRO3", "HSDP"):  # sw.Parallel(zero=3) runs as tp, then FSDP2
        return "offload='all' after tp: FSDP2's CPUOffloadPolicy is run here for fsdp, zero3 and hsdp alone"
    if offload != "none" and getattr(strategy, "offload_device", "cpu") != "cpu":
        return (f"offload_device={strategy.offload_device!r}: FSDP2's CPUOffloadPolicy "  # type: ignore[attr-defined]
                "offloads to the CPU only")
    if allreduce != "native":
        return (f"allreduce={allreduce!r}: torch's DDP all-reduces each bucket with the process group's own "
                "all-reduce (gloo's or NCCL's algorithm), so our algorithms have no place in it; use "
                "allreduce='native'")
    if reduce_dtype is not None and reduce_dtype not in COMPRESS_HOOKS:
        return (f"reduce_dtype={reduce_dtype!r}: torch's DDP sends gradients in float16 or bfloat16 only "
                "(fp16_compress_hook, bf16_compress_hook)")
    return None


def synced_batchnorm(model: nn.Module, strategy: Strategy, topo: Topology) -> nn.Module:
    """``model`` with BatchNorm normalising over the whole global batch (``sync_batchnorm=True``): torch's
    ``nn.SyncBatchNorm`` under torch's DDP family (CUDA; refuse_torch refused it elsewhere), our synchronised
    BatchNorm over dp otherwise. Returns the root (torch replaces a model that is itself a BatchNorm)."""
    if isinstance(strategy, TorchDDP):
        return torch_sync_batchnorm(model, topo)
    if topo.size(DP) > 1:
        convert_sync_batchnorm(model, topo.comm(DP))
    return model


__all__ = ["CUDA_ONLY", "ENGINES", "NO_TORCH_ENGINE", "TORCH", "engine_for", "refuse_torch",
           "refuse_torch_cp", "synced_batchnorm"]
