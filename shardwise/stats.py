"""Exact byte accounting of model state and peak resident memory."""
from __future__ import annotations

import torch


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
