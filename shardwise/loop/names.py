"""Accelerate's names on ``sw.setup``: each ``Accelerator(...)`` option a port brings along is taken with its
meaning, or refused with ours (what to write instead), never met by a bare ``unexpected keyword argument``.

:data:`PRECISIONS` maps ``mixed_precision=`` onto ``precision=``; :func:`translate` reads the rest.
"""
from __future__ import annotations

from typing import Any

# Accelerate's mixed_precision= -> shardwise's precision= ("fp8" has none: refused by translate).
PRECISIONS = {"no": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}

GRADIENT_ACCUMULATION = (
    "sw.setup takes no gradient_accumulation_steps: the loop accumulates itself. Cut each rank's batch into k "
    "micro-batches, run the first k-1 forwards and backwards under `with sw.no_sync(model):` and the last "
    "without it, then optimizer.step() once (or loss = model.train_step(x, y, loss_fn, accumulate=k))")
SPLIT_BATCHES = (
    "sw.setup(split_batches=False): sw.prepare_dataloader always splits its batch_size, the GLOBAL batch of a "
    "step, over the data-parallel ranks (Accelerate's split_batches=True); to keep a run that read batch_size "
    "samples on each of N processes, pass batch_size * N to sw.prepare_dataloader")
EVEN_BATCHES = (
    "sw.setup(even_batches=False): a prepared loader gives every rank the same number of batches (the "
    "sampler repeats a few samples to fill the last one) and sw.gather_for_metrics drops the repeats again")
DISPATCH_BATCHES = (
    "sw.setup(dispatch_batches=...): every rank reads its own share of each global batch from the dataset; "
    "no rank reads for the others")
FP8 = "mixed_precision='fp8' has no shardwise precision; use precision='bf16-mixed' (or 'bf16-true')"


def _refused(message: str) -> Any:
    def check(value: Any, out: dict[str, Any]) -> None:
        raise ValueError(message)
    return check


def _accepted_if(wanted: Any, message: str) -> Any:
    def check(value: Any, out: dict[str, Any]) -> None:
        if value != wanted:
            raise ValueError(message)
    return check


def _mixed_precision(value: Any, out: dict[str, Any]) -> None:
    if value == "fp8":
        raise ValueError(FP8)
    if value not in PRECISIONS:
        raise ValueError(f"mixed_precision={value!r}: Accelerate's values are "
                         f"{', '.join(map(repr, [*PRECISIONS, 'fp8']))} (shardwise's precision= takes "
                         "'32', 'bf16-mixed', 'bf16-true' and '16-mixed')")
    if out["precision"] != "32":
        raise ValueError(f"sw.setup got both precision={out['precision']!r} and mixed_precision={value!r}; pass "
                         f"one (mixed_precision={value!r} is precision={PRECISIONS[value]!r})")
    out["precision"] = PRECISIONS[value]


def _log_with(value: Any, out: dict[str, Any]) -> None:
    if out["logger"] is not None:
        raise ValueError("sw.setup got both logger= and log_with=; pass one (log_with is logger=)")
    out["logger"] = value


def _cpu(value: Any, out: dict[str, Any]) -> None:
    if value:
        out["accelerator"] = "cpu"


# Each Accelerate name: how it sets sw.setup's own options (``out``), or why it is refused.
NAMES = {
    "mixed_precision": _mixed_precision,
    "log_with": _log_with,
    "cpu": _cpu,
    "gradient_accumulation_steps": _refused(GRADIENT_ACCUMULATION),
    "split_batches": _accepted_if(True, SPLIT_BATCHES),
    "even_batches": _accepted_if(True, EVEN_BATCHES),
    "dispatch_batches": _refused(DISPATCH_BATCHES),
}


def translate(given: dict[str, Any], precision: str, accelerator: str, logger: Any) -> tuple[str, str, Any]:
    """``(precision, accelerator, logger)`` of ``sw.setup`` once Accelerate's names in ``given`` are read;
    a name neither Accelerate's nor ours is the TypeError Python gives."""
    out = {"precision": precision, "accelerator": accelerator, "logger": logger}
    for name, value in given.items():
        if name not in NAMES:
            raise TypeError(f"setup() got an unexpected keyword argument {name!r}")
        NAMES[name](value, out)
    return out["precision"], out["accelerator"], out["logger"]


__all__ = ["NAMES", "PRECISIONS", "translate"]
