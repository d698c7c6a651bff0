"""The ``cp`` benchmark pair on a tiny GPT: our bytes equal the formula column, and the saved activations
follow the exact relation derived below (a ring rank saves exactly ``1/C`` of a whole sequence's
activations; Ulysses one copy of the attention output per layer more).

Where the saved bytes of one forward come from (saved-tensor hooks, each storage once, no parameters, no
batch): per token, the same storages under dp and cp (layer-norm inputs and statistics, linear inputs,
q/k/v, the attention output and its log-sum-exp, the GELU input, the log-softmax output), ``a`` bytes;
the position ids, 8 B per position held (a ``(1, T)`` int64 tensor, one per rank, not one per sequence);
the cross entropy's ``total_weight``, one fp32 scalar (4 B). Two differences under cp:

* under Ulysses the attention output is saved twice: CPU SDPA (and the ring) write their output laid out
  ``(B, T, H, d)``, so the model's ``transpose(1, 2).reshape`` is a view of what the attention saved, while
  Ulysses' re-sharded output is laid out ``(B, H, T, d)`` and the reshape copies it for ``proj`` to save:
  ``L·D·e`` more per token;
* Ulysses' all-to-alls put the head-tail chunks back in order with ``index_select``, which saves its index
  (``2C`` int64) for backward: 4 per layer (q, k, v in, the output back).
"""
from __future__ import annotations

import pytest

from shardwise.bench.cp import BASELINE, cp_table, expected_sent, gpt, grad_bytes, run_cp, summarize
from shardwise.models import GPTConfig
from shardwise.parallel.cp.attention import RING, ULYSSES

TINY = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
SEQUENCES = 4
E, ID = 4, 8  # fp32 activations, int64 ids


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_cp_pair_bytes_and_saved_activations(n):
    model = gpt(TINY)
    ranks = run_cp(model, n, SEQUENCES, reps=1, warmup=0, steps=1)
    assert len(ranks) == n
    s, c, layers, d = TINY.block_size, n, TINY.n_layer, TINY.n_embd
    for r in ranks:
        # bytes: what our Comm counted in the timed step is the formula, exactly
        for key, mode in ((RING, RING), (ULYSSES, ULYSSES), (BASELINE, None)):
            assert r[key]["sent"] == [expected_sent(TINY, mode, n, r[key]["sequences"], grad_bytes(model))]
        assert r[RING]["sequences"] == SEQUENCES and r[BASELINE]["sequences"] == SEQUENCES // n

        # the data-parallel figure over one whole sequence gives a, the bytes per token
        base_one = r[BASELINE]["saved_one"]
        a, rest = divmod(base_one - ID * s - E, s)
        assert rest == 0 and a > 0
        assert r[BASELINE]["saved"] == (SEQUENCES // n) * s * a + ID * s + E  # its batch: B/N whole sequences

        copy = layers * d * E  # the attention output's copy, per token
        index = layers * 4 * 2 * c * ID  # Ulysses' saved chunk orders
        ring_one = (s // c) * a + ID * (s // c) + E
        ring_rank = SEQUENCES * (s // c) * a + ID * (s // c) + E  # every sequence, S/C tokens each
        assert r[RING]["saved_one"] == ring_one
        assert r[RING]["saved"] == ring_rank
        tokens = s // c
        assert r[ULYSSES]["saved_one"] == ring_one + tokens * copy + index
        assert r[ULYSSES]["saved"] == ring_rank + SEQUENCES * tokens * copy + index
        # per sequence, ring: exactly 1/C of the whole sequence's figure (the loss's scalar aside)
        assert (ring_one - E) * c == base_one - E

    table = cp_table(summarize(ranks), TINY, n, SEQUENCES, grad_bytes(model))
    assert table.row_count == 3
