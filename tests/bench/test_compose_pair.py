"""The ``fsdp-tp`` benchmark pair compares like with like: PyTorch's FSDP2 + DTensor TP side trains
the same model to the same losses as our ``Parallel(dp=2, tp=2)``, and our bytes match the formula."""
from __future__ import annotations

import pytest
import torch

from shardwise.bench.compose import compare_losses, expected_sent, gpt
from shardwise.models import GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.timeout(120)
def test_torch_fsdp_tp_trains_like_ours():
    ranks = compare_losses(TINY, steps=3, batch=8)
    assert len(ranks) == 4
    for r in ranks:
        assert len(r["ours"]) == len(r["torch"]) == 3
        torch.testing.assert_close(torch.tensor(r["torch"]), torch.tensor(r["ours"]), rtol=1e-4, atol=1e-4)
        assert r["ours"][-1] < r["ours"][0]  # it trains
        assert r["ours_sent"] == expected_sent(gpt(TINY), dp=2, tp=2, batch=8)
    # tp ranks of one replica read the same dp shard; the two replicas read different ones
    assert ranks[0]["ours"] == ranks[1]["ours"] and ranks[0]["ours"] != ranks[2]["ours"]
