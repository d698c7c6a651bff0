"""What ``sw.save`` keeps of a hand-written loop beside its model and optimizer, and ``sw.load`` restores.

* **Registered objects** (``sw.register_for_checkpointing(obj)``: learning-rate schedulers, your own objects
  with ``state_dict``/``load_state_dict``): rank 0's ``state_dict()`` of each, in registration order, its
  tensors stored as tensors and the rest as JSON (tuples, dicts with other than string keys marked so that
  they come back as they were); anything else is refused rather than pickled.
* **The position of each prepared loader** (:class:`shardwise.loop.data.DeviceLoader`): its sampler's epoch
  and the batches it gave in that epoch, so that the next pass after a resume starts with the batch after the
  checkpoint's, read by index (the skipped batches are not loaded); and each rank's generator of the loader.
* **Each rank's RNGs**: Python's ``random``, numpy's global one, torch's CPU generator and every CUDA
  device's, as tensors of each rank's own (each rank draws its own dropout masks and noise). A rank the saving
  run did not have keeps its own, with a warning.
"""
from __future__ import annotations

import random
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

try:  # numpy is not one of torch's requirements: its RNG is kept where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy is in every environment the tests run in
    np = None  # type: ignore[assignment]

_MARK = "__shardwise__"  # the key of a JSON object that stands for a tensor, a tuple or a dict of other keys


class Stateful(Protocol):
    """What :func:`shardwise.loop.register_for_checkpointing` takes."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class Positioned(Protocol):
    """A prepared loader, as a checkpoint sees it (:class:`shardwise.loop.data.DeviceLoader`)."""

    def position(self) -> dict[str, int]: ...

    def resume_at(self, position: dict[str, int]) -> None: ...

    @property
    def generator(self) -> torch.Generator | None: ...


def encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """``value`` (a state dict) as JSON: tensors go to ``tensors`` under ``where``'s path and are named there."""
    if isinstance(value, torch.Tensor):
        tensors[where] = value.detach().cpu().clone()
        return {_MARK: "tensor", "key": where}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_MARK: "tuple", "items": [encode(v, tensors, f"{where}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _MARK not in value:
            return {k: encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        if all(isinstance(k, (bool, int, float, str)) or k is None for k in value):
            return {_MARK: "dict", "items": [[k, encode(v, tensors, f"{where}.{i}")]
                                             for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"sw.save: {where} is a {type(value).__name__}, which a checkpoint keeps only by pickling; a "
                    "state_dict() that sw.save keeps holds tensors, numbers, strings, None, and lists, tuples and "
                    "dicts of them")


def decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """What :func:`encode` made of a state dict, back (tensors from ``tensors``)."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_MARK)
    if kind == "tensor":
        return tensors[value["key"]]
    if kind == "tuple":
        return tuple(decode(v, tensors) for v in value["items"])
    if kind == "dict":
        return {k: decode(v, tensors) for k, v in value["items"]}
    return {k: decode(v, tensors) for k, v in value.items()}


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors: Python's and numpy's (their integers are below 2**32, exact in
    float64), torch's CPU generator and each CUDA device's."""
    version, words, gauss = random.getstate()
    out = {"rng.python": torch.tensor([version, *words, gauss is not None, gauss or 0.0], dtype=torch.float64),
           "rng.torch": torch.get_rng_state()}
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        out["rng.numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss, cached], dtype=torch.float64)  # type: ignore[attr-defined]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state` captured (a generator it did not capture keeps its state)."""
    if "rng.python" in state:
        v = state["rng.python"].tolist()
        random.setstate((int(v[0]), tuple(int(w) for w in v[1:-2]), v[-1] if v[-2] else None))
    if "rng.numpy" in state and np is not None:
        v = state["rng.numpy"].tolist()
        np.random.set_state(("MT19937", np.array(v[:-3], dtype=np.uint32), int(v[-3]), int(v[-2]), v[-1]))
    if "rng.torch" in state:
        torch.set_rng_state(state["rng.torch"])
    if "rng.cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["rng.cuda"]))


def _name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@dataclass
class Kept:
    """What a checkpoint of one prepared model keeps beside it: the registered objects and the prepared loaders
    (held weakly: a loader the loop dropped is not kept), each in the order it came."""

    objects: list[Stateful] = field(default_factory=list)
    loaders: list[weakref.ref[Any]] = field(default_factory=list)

    def register(self, obj: Any) -> None:
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(f"sw.register_for_checkpointing({type(obj).__name__}): it has no "
                            f"{' or '.join(missing)}; a registered object gives its state with state_dict() and "
                            "takes it back with load_state_dict(state)")
        if not any(o is obj for o in self.objects):
            self.objects.append(obj)

    def live_loaders(self) -> list[Positioned]:
        return [got for got in (r() for r in self.loaders) if got is not None]

    def capture(self, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(JSON for the manifest, rank 0's tensors of the registered objects, this rank's own tensors)."""
        shared: dict[str, torch.Tensor] = {}
        objects = [{"class": _name(o), "state": encode(o.state_dict(), shared, f"loop.object{i}")}
                   for i, o in enumerate(self.objects)]
        loaders = self.live_loaders()
        own = rng_state()
        for i, loader in enumerate(loaders):
            if loader.generator is not None:
                own[f"loader{i}.generator"] = loader.generator.get_state()
        return ({"objects": objects, "loaders": [lo.position() for lo in loaders]}, shared if rank == 0 else {},
                own)

    def restore(self, path: str, saved: dict[str, Any], shared: dict[str, torch.Tensor],
                own: dict[str, torch.Tensor], rank: int) -> None:
        """Give every registered object, prepared loader and RNG of this rank what checkpoint ``path`` keeps."""
        if not saved:  # a checkpoint of the Trainer, or of a loop before format 6: only the model and optimizer
            return
        loaders = self.live_loaders()
        _check_count(path, len(saved["objects"]), len(self.objects), "registered objects",
                     "sw.register_for_checkpointing")
        _check_count(path, len(saved["loaders"]), len(loaders), "prepared loaders", "sw.prepare_dataloader")
        for i, (obj, kept) in enumerate(zip(self.objects, saved["objects"])):
            if kept["class"] != _name(obj):
                raise ValueError(f"checkpoint {path} keeps registered object {i} as a {kept['class']}, this loop "
                                 f"registered a {_name(obj)} there: register the same objects in the same order")
            obj.load_state_dict(decode(kept["state"], shared))
        for i, (loader, position) in enumerate(zip(loaders, saved["loaders"])):
            loader.resume_at(position)
            if loader.generator is not None and f"loader{i}.generator" in own:
                loader.generator.set_state(own[f"loader{i}.generator"])
        if not own:
            warnings.warn(f"checkpoint {path} was written by fewer ranks than this run has: rank {rank} keeps its "
                          "own random generators", stacklevel=3)
        set_rng_state(own)


def _check_count(path: str, saved: int, now: int, what: str, how: str) -> None:
    if saved != now:
        raise ValueError(f"checkpoint {path} keeps {saved} {what}, this loop has {now} ({how}): a resumed loop "
                         f"makes the same ones, in the same order, before sw.load")


__all__ = ["Kept", "Positioned", "Stateful", "decode", "encode", "rng_state", "set_rng_state"]
