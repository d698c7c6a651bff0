"""Mixed precision: autocast for the forward, fp32 master weights, a loss scaler for fp16.

The parameters stay fp32 (they *are* the master weights, and under ZeRO they
are sharded like everything else); autocast runs matmuls in bf16/fp16 on the
fly (Micikevicius et al. 2018, "Mixed Precision Training"). fp16's narrow
exponent needs the loss scaled so small gradients do not flush to zero; bf16
has fp32's exponent range and needs no scaler.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("32", "bf16-mixed", "16-mixed")


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


def check(precision: str | int) -> str:
    """``precision`` as one of PRECISIONS, its aliases (ALIASES) mapped."""
    name = ALIASES.get(precision, precision) if isinstance(precision, (str, int)) else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
    return name


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The forward's context: autocast to bf16/fp16, or nothing for fp32."""
    if precision == "32":
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

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide gradients by the scale; returns whether any of them is inf/NaN on this rank."""
        found = False
        inv = 1.0 / self.scale
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)
                        found |= not bool(torch.isfinite(p.grad).all())
        return found

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
