"""The ``shardwise plan`` command line's flags and their parsers, without torch.

Separate from :mod:`shardwise.plan.command.cli` (which runs the planner, and so
imports torch) so that ``shardwise --help`` and ``shardwise plan --help``
answer at once.
"""
from __future__ import annotations

import argparse
import re

from shardwise.parallel.pp.schedules import SCHEDULES
from shardwise.plan.known import SHAPES
from shardwise.plan.specs import (
    CP_MODES,
    GPU_PRESETS,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
)

_SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_BYTES = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
_SECONDS = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _number(text: str, units: dict[str, float], what: str, upper: bool = False) -> float:
    m = re.fullmatch(r"\s*([0-9._]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ]*)\s*", text)
    unit = (m.group(2).upper() if upper else m.group(2)) if m else ""
    if not m or unit not in units:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as {what} (units: {', '.join(u for u in units if u)})")
    return float(m.group(1).replace("_", "")) * units[unit]


def parse_count(text: str) -> int:
    """``7.5e9``, ``7B``, ``350M``, ``1T`` -> an integer count."""
    return int(round(_number(text, _SI, "a count")))


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``8e10`` -> bytes."""
    return int(round(_number(text, _BYTES, "a size", upper=True)))


def parse_rate(text: str) -> float:
    """``450GB/s``, ``4.5e11`` -> bytes per second."""
    return float(_number(text.removesuffix("/s"), _BYTES, "a bandwidth", upper=True))


def parse_seconds(text: str) -> float:
    """``3us``, ``0.01ms``, ``3e-6`` -> seconds."""
    return _number(text, _SECONDS, "a duration")


def parse_flops(text: str) -> float:
    """``989T``, ``9.89e14`` -> FLOP/s."""
    return _number(text.removesuffix("FLOP/s").removesuffix("/s"), _SI, "FLOP/s")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a shape like 8,64") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the planner's flags on ``parser``, one argument group at a time."""
    _model_arguments(parser.add_argument_group("model (one of --model, --params, or a shape)"))
    _cluster_arguments(parser.add_argument_group("cluster"))
    _training_arguments(parser.add_argument_group("training"))
    _output_arguments(parser.add_argument_group("output"))


def _model_arguments(m: argparse._ArgumentGroup) -> None:
    m.add_argument("--model", help=f"known shape ({', '.join(SHAPES)}) or path.py:factory (traced on meta)")
    m.add_argument("--params", type=parse_count, help="parameter count, e.g. 7.5e9 or 7B")
    m.add_argument("--layers", type=int, help="transformer layers (a shape: with --hidden and --heads)")
    m.add_argument("--hidden", type=int, help="hidden size (model width)")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 50257)")
    m.add_argument("--ffn-hidden", type=int, default=0, help="MLP inner size (default 4 x hidden)")
    m.add_argument("--kv-heads", type=int, default=0, help="key/value heads (grouped-query attention)")
    m.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (three matrices)")
    m.add_argument("--experts", type=int, default=0, help="a mixture of experts: experts per MoE layer (every "
                   "block's MLP becomes E SwiGLU experts and a router)")
    m.add_argument("--top-k", type=int, default=2, help="experts each token is routed to (default 2)")
    m.add_argument("--moe-ffn-hidden", type=int, default=0, help="one expert's inner size (default --ffn-hidden)")
    m.add_argument("--input-shape", type=parse_shape, help="factory input shape with batch first, e.g. 8,64")
    m.add_argument("--input-dtype", default="float", help="factory input dtype: float, long, bf16...")


def _cluster_arguments(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--gpu", default="h100-80gb", choices=sorted(GPU_PRESETS), help="device preset (default h100-80gb)")
    c.add_argument("--devices", type=int, help="devices in total (default one node)")
    c.add_argument("--devices-per-node", type=int, default=8, help="devices in one node (default 8)")
    c.add_argument("--nodes", type=int, help="nodes (instead of --devices)")
    c.add_argument("--device-memory", type=parse_bytes, help="per device, e.g. 80GB or 80GiB")
    c.add_argument("--intra-bw", type=parse_rate, help="per device inside a node, e.g. 450GB/s")
    c.add_argument("--inter-bw", type=parse_rate, help="per device across nodes, e.g. 50GB/s")
    c.add_argument("--intra-latency", type=parse_seconds, help="e.g. 3us")
    c.add_argument("--inter-latency", type=parse_seconds, help="e.g. 10us")
    c.add_argument("--peak-flops", type=parse_flops, help="dense 16-bit peak per device, e.g. 989T")
    c.add_argument("--efficiency", type=float, help="fraction of peak the matmuls reach (default 0.5)")
    c.add_argument("--reserve", type=parse_bytes, help="memory lost to the CUDA context, NCCL, fragmentation "
                   "(preset: 1GB, at most a tenth of --device-memory)")


def _training_arguments(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: micro-batch x devices)")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per device per forward (default 1)")
    t.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's, else 2048); long ones "
                   "call for context parallelism (cp), which the layouts try")
    t.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, help="default bf16-mixed")
    t.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="sets the optimizer-state bytes (default adamw)")
    t.add_argument("--activation-checkpointing", action="store_true", help="full recomputation of every layer")
    t.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism wherever tp > 1 (otherwise tried with and without)")
    t.add_argument("--flash-attention", action="store_true", help="attention scores are never stored")
    t.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    t.add_argument("--fp32-grads", action="store_true", help="keep gradients in fp32 (as DeepSpeed's ZeRO does)")
    t.add_argument("--autocast", action="store_true",
                   help="mixed precision as torch.amp and shardwise's Trainer run it: fp32 model states, "
                        "16-bit activations")
    t.add_argument("--offload", default="none", choices=OFFLOADS, help="ZeRO-Offload of optimizer (or everything)")
    t.add_argument("--no-sync", action="store_true",
                   help="accumulate unreduced gradients over micro-batches, reduce once per step")
    t.add_argument("--checkpoint-async", action="store_true",
                   help="checkpoints saved in the background (Trainer(checkpoint_async=True)): each rank keeps a "
                        "copy of its checkpoint share in host memory, shown as its own line")


def _output_arguments(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--format", default="table", choices=("table", "json"), help="a table, or JSON for scripts")
    o.add_argument("--strategies", help="comma-separated subset of ddp,zero1,zero2,zero3,fsdp,hsdp")
    o.add_argument("--max-tp", type=int, help="largest tensor-parallel size (default devices per node)")
    o.add_argument("--max-cp", type=int, help="largest context-parallel size, a power of two (default: any that "
                   "splits the sequence into 2 x cp chunks; 1: no context parallelism)")
    o.add_argument("--max-ep", type=int, help="largest expert-parallel size, for a mixture of experts (default: "
                   "any that divides dp x cp and the experts; 1: no expert parallelism)")
    o.add_argument("--cp-modes", default=",".join(CP_MODES),
                   help=f"comma-separated context-parallel attention: {', '.join(CP_MODES)} (default both)")
    o.add_argument("--diloco", type=int, metavar="H", help="also plan DiLoCo: one replica per node (ddp inside "
                   "it), syncing every H inner steps, beside ddp over every device")
    o.add_argument("--top", type=int, default=25, help="rows of the table (0: all)")
    o.add_argument("--width", type=int, help="table width in characters")
    o.add_argument("--explain", type=int, default=3,
                   help="memory breakdown (why it fits or not) of the first N layouts (default 3)")
