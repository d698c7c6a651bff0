"""Mixed precision: autocast for the forward, fp32 master weights, a loss scaler for fp16.

The parameters stay fp32 (they *are* the master weights, and under ZeRO they
are sharded like everything else); autocast runs matmuls in bf16/fp16 on the
fly (Micikevicius et al. 2018, "Mixed Precision Training"). fp16's narrow
exponent needs the loss scaled so small gradients do not flush to zero; bf16
has fp32's exponent range and needs no scaler.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.optim.wrapped import WrappedOptimizer
from shardwise.torch_private import UNSCALE_AND_CHECK

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
# "true" precisions keep the weights, gradients and optimizer states themselves in this dtype: no fp32 master
# copy, half the model-state bytes of fp32 (Lightning's "bf16-true"). The batch's floating tensors follow.
TRUE_DTYPES = {"bf16-true": torch.bfloat16}


def default_dtype_name() -> str:
    """The default dtype as its name in ``torch`` ("float32"): what rank processes are given, so that a model or
    data a rank builds itself has the caller's dtype (launch.spawn, the worker pool)."""
    return str(torch.get_default_dtype()).removeprefix("torch.")


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype losses, norms and metrics are summed in: float32 for half precision (whose sums
    lose digits), float64 left as it is (a float64 model's loss must not be rounded to float32)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# The names Lightning users type, to ours: 16 / "16" -> "16-mixed", "bf16" -> "bf16-mixed", 32 / "32-true" -> "32".
ALIASES: dict[object, str] = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed", 32: "32", "32-true": "32"}


def cast_model(precision: str, model: nn.Module) -> nn.Module:
    """Under a "true" precision, the model's floating parameters and buffers in its dtype (in place)."""
    dtype = TRUE_DTYPES.get(precision)
    return model.to(dtype) if dtype is not None else model


def cast_batch(precision: str, x: Any) -> Any:
    """Under a "true" precision, the batch's floating tensors in its dtype (Lightning converts them alike)."""
    dtype = TRUE_DTYPES.get(precision)
    if dtype is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(cast_batch(precision, v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, cast_batch(precision, v)) for k, v in x.items())
    return x


def widened_output(x: Any) -> Any:
    """A model's output with its half-precision tensors in float32 (tuples, lists, mappings such as a Hugging
    Face ``ModelOutput``, updated in place): what a hand-written loop's loss then sees, as the Trainer's loss sees
    it under autocast (Fabric and Accelerate convert outputs likewise). An fp16 loss would overflow once scaled."""
    if isinstance(x, torch.Tensor):
        return widened(x) if x.is_floating_point() else x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(widened_output(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(widened_output(v) for v in x)
    if isinstance(x, MutableMapping):
        for k in list(x):
            x[k] = widened_output(x[k])
    return x


def check(precision: str | int) -> str:
    """``precision`` as one of PRECISIONS, its aliases (ALIASES) mapped."""
    name = ALIASES.get(precision, precision) if isinstance(precision, (str, int)) else precision
    if name == "16-true":
        raise ValueError("precision='16-true' is not supported: with the weights and optimizer states themselves in "
                         "fp16 and no fp32 copy, Adam's default eps=1e-8 rounds to 0 (fp16's smallest value is "
                         "6e-8) and any update under 1/2048 of a weight is lost; use '16-mixed' (fp32 master "
                         "weights and a loss scaler) or 'bf16-true' (bf16's exponent range, no scaler needed)")
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
    return name


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The forward's context: autocast to bf16/fp16, or nothing for fp32."""
    if precision == "32" or precision in TRUE_DTYPES:  # a "true" precision's model is already in its dtype
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after a clean run.

    Operates on the gradients the optimizer will read (``optimizer.param_groups``),
    so it works unchanged when those are shards; ``found_inf`` is agreed across
    ranks by the caller so that every rank skips the same steps.
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    _clean: int = 0

    def unscale_flag(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide gradients by the scale in one fused pass per device and dtype (torch.amp.GradScaler's kernel)
        and return, without waiting for the device, a 1-element float32 tensor on the first gradient's device:
        > 0 when any gradient of this rank is inf/NaN. The caller agrees it across ranks, then reads it once:
        one host sync per step instead of one per parameter."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return unscale_grads(grads, 1.0 / self.scale)

    def as_tensor(self) -> torch.Tensor:
        """(scale, clean steps since the last change), for a checkpoint."""
        return torch.tensor([self.scale, float(self._clean)], dtype=torch.float64)

    def load_tensor(self, t: torch.Tensor) -> None:
        self.scale, self._clean = float(t[0]), int(t[1])

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2.0
            self._clean = 0
        else:
            self._clean += 1
            if self._clean % self.growth_interval == 0:
                self.scale *= 2.0


def unscale_grads(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; a 1-element flag tensor, > 0 when any is not finite."""
    by_place: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_place.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (device, _), group in by_place.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        UNSCALE_AND_CHECK(group, found, torch.full((1,), inv_scale, dtype=torch.float32, device=device))
        flags.append(found)
    if not flags:
        return torch.zeros(1, dtype=torch.float32)
    first = flags[0].device
    return torch.stack([f.to(first) for f in flags]).sum(0)


class ScaledOptimizer(WrappedOptimizer):
    """The optimizer of an fp16 hand-written loop (``sw.setup(precision="16-mixed")``).

    ``model.backward(loss)`` scales the loss; :meth:`unscale_` (called by the global clip, or by :meth:`step`)
    unscales the gradients once per step in one fused pass and agrees across ranks (``agree``: an all-reduce
    sum of the 1-element flag) whether any overflowed; :meth:`step` then steps, or skips the step on every rank,
    and updates the scale, as the Trainer's fp16 loop does.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler,
                 agree: Callable[[torch.Tensor], None]) -> None:
        super().__init__(optimizer)
        self.scaler, self.agree = scaler, agree
        self.scaled = False  # set by the model's backward(loss): the gradients hold the scaled loss's
        self._skip: bool | None = None

    def unscale_(self) -> bool:
        """Unscale this step's gradients (once); returns whether the step is skipped (an overflow on any rank)."""
        if self._skip is None:
            if not self.scaled:
                raise RuntimeError("precision='16-mixed' scales the loss so that small fp16 gradients survive: "
                                   "call model.backward(loss) instead of loss.backward() (or model.train_step), "
                                   "then optimizer.step()")
            flag = self.scaler.unscale_flag(self.optimizer)
            self.agree(flag)
            self._skip = float(flag) > 0
            self.scaler.update(self._skip)
        return self._skip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise TypeError("the fp16 optimizer of sw.setup takes no closure")
        if not self.unscale_():
            self.optimizer.step()
        self.scaled, self._skip = False, None
        return None
