"""The CUDA side-stream helpers are inert off CUDA: the CPU path calls no torch.cuda function and copies as before."""
from __future__ import annotations

import torch

from shardwise.comm.streams import SideStream, pinned_like


def test_side_stream_is_inert_on_cpu(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a torch.cuda call on the CPU path")
    monkeypatch.setattr(torch.cuda, "Stream", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    side = SideStream(torch.device("cpu"))
    assert not side.active
    t = torch.ones(3)
    with side.enter(t):
        t.add_(1)
    side.join()
    assert torch.equal(t, torch.full((3,), 2.0))
    assert SideStream.shared(torch.device("cpu"), "x") is SideStream.shared(torch.device("cpu"), "x")


def test_pinned_like_is_a_plain_copy_off_cuda():
    t = torch.arange(4.0)
    host = pinned_like(t, torch.device("cpu"), torch.device("cpu"))
    assert torch.equal(host, t) and host.data_ptr() != t.data_ptr() and not host.is_pinned()
