"""Tensor parallelism on a model with a parameter tied under two names.

BertForMaskedLM ties its decoder weight to the word embedding (split by
vocabulary on every rank) and its decoder bias to ``cls.predictions.bias``.
Before, the second name kept the unsplit tensor, never updated: the losses
matched and ``result.state_dict`` held a wrong bias. Every tensor must now
equal single-process training.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import bert_mlm, logits_loss

import shardwise as sw
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def fit(strategy, devices):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        bert_mlm(), CharText(stdlib_text(20_000), 16), logits_loss, ADAMW, batch_size=8, max_steps=3)


def test_bert_mlm_under_tp_equals_single_in_every_tensor(same_run):
    ref = fit("single", 1)
    run = fit("tp", 2)
    # The tie is real in the reference: both names hold one tensor, trained.
    assert torch.equal(ref.state_dict["cls.predictions.bias"], ref.state_dict["cls.predictions.decoder.bias"])
    assert not torch.equal(ref.state_dict["cls.predictions.bias"], bert_mlm().state_dict()["cls.predictions.bias"])
    same_run(ref, run)
