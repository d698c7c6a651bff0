"""Exact byte accounting of model state and peak resident memory."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterator

import torch

from shardwise.torch_private import memory_records


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), the CPU stand-in for max_memory_allocated."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return 0


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); silently a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def release_free_heap() -> bool:
    """Give the system back the heap pages freed tensors left behind (glibc's ``malloc_trim``; a no-op elsewhere).

    glibc serves allocations below its mmap threshold (which the first large free raises, up to 32 MiB) from its
    arenas and keeps what is freed there. After two steps of a 100M-parameter Llama under fsdp x 2, each rank
    held 0.6x to 1.0x the model's bytes of such freed heap beside its 0.5x of shards; trimmed, 0.55x in all
    (benchmarks/init_from_memory.py). The benchmarks call it between contenders too, so that what one freed does
    not lower the next one's RSS increase. False where there is no glibc to ask."""
    trim = getattr(_libc(), "malloc_trim", None)  # not glibc: its allocator keeps or returns memory its own way
    return bool(trim(0)) if trim is not None else False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``find_library`` runs ``ldconfig`` in a subprocess; the end of every fit
    and every benchmark contender asks for it)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_cuda_peak(device: torch.device) -> None:
    """Start a new peak for :func:`cuda_peak_bytes` on a CUDA ``device`` (a no-op on any other device)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device) -> dict[str, int]:
    """``cuda_peak_allocated_bytes`` / ``cuda_peak_reserved_bytes`` since :func:`reset_cuda_peak`, on CUDA only.

    Allocated: bytes in live tensors (what the planner predicts); reserved: what
    the caching allocator holds from the driver (allocated plus its cache and
    fragmentation), the number that decides an out-of-memory. An empty dict
    on CPU, so a CPU run's stats keep exactly their keys.
    """
    if device.type != "cuda":
        return {}
    return {"cuda_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}


class AllocatedPeak:
    """Within a ``with`` block: the peak bytes in live CPU tensors above what was live at its start (``peak``), and
    the bytes still live at its end (``end``): the CPU counterpart of ``torch.cuda.max_memory_allocated``.

    Read from the profiler's record of every allocation and free of torch's CPU allocator, summed in order, so it
    is exact and the same from run to run. The peak RSS is not: it also counts what glibc keeps mapped after a
    free (a heap chunk below other live chunks, an arena), which depends on the order of earlier allocations,
    and varied by 5-30% between repetitions of one contender in the zero-bubble pair. A free of a block allocated
    before the block started is not recorded (the profiler does not know its size), so such a free is not
    subtracted: the figure can only be too high, never too low. Slow (the profiler records every operator): for
    a measurement beside timed runs, not inside them.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.end = 0
        self._prof: torch.profiler.profile | None = None

    def __enter__(self) -> AllocatedPeak:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._prof is not None
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        live = peak = 0
        for nbytes in memory_records(self._prof):  # allocations (> 0) and frees (< 0), in time order
            live += nbytes
            peak = max(peak, live)
        self.peak, self.end = peak, live
        self._prof = None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Standard error (the file descriptor: C++ writes there) dropped for the block: torch's profiler writes a
    trace line at every start and stop, on any log level, which would stand between a benchmark's tables."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
