"""Memory accounting: the exact tensor peak read from torch's allocator records."""
from __future__ import annotations

import os

import pytest
import torch

from shardwise.stats import AllocatedPeak

pytestmark = pytest.mark.timeout(60)


def test_allocated_peak_is_exact():
    with AllocatedPeak() as a:
        x = torch.empty(1000, dtype=torch.float64)  # 8,000 B
        y = torch.empty(500, dtype=torch.float32)   # 2,000 B: the peak, 10,000 B, is here
        del x
        z = torch.empty(10, dtype=torch.int64)      # 80 B
        w = torch.empty(1500, dtype=torch.float32)  # 6,000 B: 8,080 B live, under the peak
    assert (a.peak, a.end) == (10_000, 8_080)
    del y, z, w


def test_a_block_allocated_before_is_never_subtracted():
    before = torch.empty(4000, dtype=torch.float64)
    with AllocatedPeak() as a:
        del before  # its 32,000 B were allocated outside: the profiler does not know its size
        t = torch.empty(100, dtype=torch.float64)
    assert (a.peak, a.end) == (800, 800)
    del t


def test_the_profilers_trace_lines_are_dropped_and_stderr_comes_back(capfd):
    with AllocatedPeak():
        torch.empty(1)
    os.write(2, b"still here\n")
    assert capfd.readouterr().err == "still here\n"
