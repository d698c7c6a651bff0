"""Host memory of each rank while ``init_from`` fine-tunes a ~100M-parameter Llama under fsdp x 2.

Each rank samples its anonymous resident memory (``RssAnon`` of /proc/self/status: file pages mapped for
reading do not count) every millisecond from just before the model is built, on the meta device, to the end
of ``fit``, and reports the peak above that baseline in three phases:

* load: building the meta model, the strategy's setup (FSDP materialises one module at a time into its
  shards) and reading the safetensors shards into them, up to ``on_fit_start``;
* train: the optimizer steps (shards, gradients, one unit gathered at a time);
* end: after the last step to ``on_fit_end``, the full state dict gathered or not (``--state-dict``).

Run: ``PYTHONPATH=. python benchmarks/init_from_memory.py [--layers 12] [--steps 2] [--state-dict]``.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import tempfile
import threading
import time

import torch

from shardwise import launch
from shardwise.models import lm_loss

MIB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def logits_loss(out, y):
    return lm_loss(out.logits, y)


class Sampler(threading.Thread):
    """The peak of :func:`rss_anon` since the last :meth:`take`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = rss_anon(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def take(self) -> int:
        peak, self.peak = max(self.peak, rss_anon()), rss_anon()
        return peak


class Phases:
    """Callback hooks that close each phase: the peak since the previous one."""

    def __init__(self, sampler: Sampler, steps: int) -> None:
        self.sampler, self.steps, self.peaks = sampler, steps, {}

    def on_fit_start(self, info) -> None:
        self.peaks["load"] = self.sampler.take()

    def on_step_end(self, info) -> None:
        if info.step == self.steps:
            self.peaks["train"] = self.sampler.take()
            self.peaks["level"] = rss_anon()  # what the steps leave: the end of fit is measured above it

    def on_fit_end(self, info) -> None:
        self.peaks["end"] = self.sampler.take()
        self.peaks["held at the end"] = rss_anon()


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=64,
                       bos_token_id=0, eos_token_id=0)


def rank_main(rank: int, device: torch.device, path: str, layers: int, steps: int, state_dict: bool,
              out: str) -> None:
    import torch.distributed.checkpoint  # noqa: F401 - imported before the baseline: not the model's memory
    from transformers import LlamaForCausalLM

    import shardwise as sw
    from shardwise.workloads import CharText, stdlib_text

    data = CharText(stdlib_text(4_000), 16)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = rss_anon()
    sampler = Sampler()
    sampler.start()
    phases = Phases(sampler, steps)
    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers))
    result = sw.Trainer("fsdp", 2, accelerator="cpu", progress=False, memory_check="off", callbacks=[phases]).fit(
        model, data, logits_loss, functools.partial(torch.optim.SGD, lr=1e-3), batch_size=2, max_steps=steps,
        init_from=path, return_state_dict=state_dict)
    sampler.running = False
    mine = {"rank": rank, "baseline": base, **{k: v - base for k, v in phases.peaks.items()},
            "params_bytes": result.stats[rank]["params_bytes"], "grads_bytes": result.stats[rank]["grads_bytes"]}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(mine, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--state-dict", action="store_true", help="fit(return_state_dict=True): gather it at the end")
    a = p.parse_args()
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM(config(a.layers))
        n = sum(t.numel() for t in model.state_dict().values())
        full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(tmp, max_shard_size="100MB")
        del model
        out = os.path.join(tmp, "result.json")
        launch.spawn(rank_main, 2, args=(tmp, a.layers, a.steps, a.state_dict, out),
                     timeout=datetime.timedelta(minutes=20))
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    print(f"model: Llama, {n / 1e6:.1f}M parameters, {full / MIB:.1f} MiB in float32; fsdp x 2, "
          f"{a.steps} SGD steps, state dict {'gathered' if a.state_dict else 'not gathered'}")
    for r in ranks:
        r["end above the last step"] = r["end"] - r["level"]
        shown = ", ".join(f"{k} {r[k] / MIB:.1f} MiB ({r[k] / full:.2f}x)"
                          for k in ("load", "train", "end", "end above the last step", "held at the end"))
        print(f"rank {r['rank']}: peak RssAnon above baseline ({r['baseline'] / MIB:.0f} MiB): {shown}; "
              f"holds params {r['params_bytes'] / MIB:.1f} MiB, grads {r['grads_bytes'] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
