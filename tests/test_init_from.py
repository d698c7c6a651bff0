"""Fine-tuning from pretrained weights (issue 46): ``init_from=`` reads a Hugging Face directory straight into the
shards of a meta-device model, and the run equals single-device fine-tuning from ``from_pretrained`` (float64)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import llama, logits_loss

import shardwise as sw
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny GQA Llama in float64, saved as sharded safetensors with an index."""
    path = str(tmp_path_factory.mktemp("llama"))
    torch.set_default_dtype(torch.float64)
    try:
        model = llama()
        torch.manual_seed(46)  # weights no initialisation reproduces: what the runs train came from the file
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        model.save_pretrained(path, max_shard_size="20KB")
    finally:
        torch.set_default_dtype(torch.float32)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return path


def on_meta(path: str) -> torch.nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(AutoConfig.from_pretrained(path)).to(torch.float64)


def fit(strategy, devices: int, model, **kw) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        model, CharText(stdlib_text(20_000), 16), logits_loss, ADAMW, batch_size=8, max_steps=2, **kw)


def test_meta_model_from_hf_shards_equals_single_device_fine_tuning(saved, same_run):
    from transformers import LlamaForCausalLM

    ref = fit("single", 1, LlamaForCausalLM.from_pretrained(saved, dtype=torch.float64))
    for strategy, devices in [("fsdp", 2), ("tp", 2), ("pp", 2), (sw.Parallel(dp=2, tp=2, zero=3), 4)]:
        same_run(ref, fit(strategy, devices, on_meta(saved), init_from=saved))
