"""Train a character-level GPT on Python's own standard library, then let it write some code.

The corpus is the source of the standard library of the Python that runs
this script (nothing is downloaded); each byte is a token (vocabulary 128).
The model is shardwise's own GPT (shardwise.models.GPT), so every strategy
applies, tensor and pipeline parallelism included:

    python examples/char_gpt.py                                   # ddp on 2 processes, 300 steps
    python examples/char_gpt.py --strategy zero2 --devices 2 --steps 100
    python examples/char_gpt.py --strategy pp --devices 2
    shardwise run --nproc 2 examples/char_gpt.py --strategy fsdp  # under torchrun: every rank trains
    python examples/char_gpt.py --accelerator cpu --devices 4     # default accelerator auto: CUDA when present

At the end rank 0 prints the first and final training loss, the loss on held-out text
(the characters after the training text), the throughput in tokens per second
(global batch x context / median step time of the slowest rank) and a greedy
continuation of ``--prompt`` computed from ``result.state_dict``.
"""
from __future__ import annotations

import argparse
import functools
import os

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.workloads import CharText, stdlib_text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="ddp", help="any name sw.Trainer accepts (ddp, zero3, tp, pp, ...)")
    p.add_argument("--accelerator", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "2")),
                   help="processes, one per device (under torchrun: its world size)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="GLOBAL batch (sequences per optimizer step)")
    p.add_argument("--block", type=int, default=64, help="context length in characters")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chars", type=int, default=200_000, help="characters of training text")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--prompt", default="def __init__(self")
    p.add_argument("--sample", type=int, default=120, help="characters to generate at the end")
    return p.parse_args(argv)


@torch.no_grad()
def greedy(model: GPT, prompt: str, n: int) -> str:
    """Append ``n`` characters to ``prompt``, each time the most likely next one (argmax)."""
    model.eval()
    block = model.cfg.block_size
    ids = torch.tensor([[min(b, 127) for b in prompt.encode("ascii", "ignore")]], dtype=torch.long)
    for _ in range(n):
        logits = model(ids[:, -block:])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return bytes(ids[0].tolist()).decode("ascii", "replace")


@torch.no_grad()
def held_out_loss(model: GPT, data: CharText, batches: int = 8, batch: int = 32) -> float:
    """Mean next-character loss over the first ``batches`` x ``batch`` windows of ``data``."""
    model.eval()
    n = min(len(data), batches * batch)
    x = torch.stack([data[i][0] for i in range(n)])
    y = torch.stack([data[i][1] for i in range(n)])
    return float(lm_loss(model(x), y))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    cfg = GPTConfig(vocab_size=128, block_size=a.block, n_layer=a.layers, n_head=a.heads, n_embd=a.embd)
    text = stdlib_text(a.chars + 20_000)
    train, held_out = CharText(text[:a.chars], a.block), CharText(text[a.chars:], a.block)
    torch.manual_seed(0)  # same initial weights for every strategy and device count
    trainer = sw.Trainer(strategy=a.strategy, devices=a.devices, accelerator=a.accelerator)
    result = trainer.fit(GPT(cfg), train, lm_loss, optimizer=functools.partial(torch.optim.AdamW, lr=a.lr),
                         batch_size=a.batch, max_steps=a.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    model = GPT(cfg)
    model.load_state_dict(result.state_dict)
    step = max(s["step_time_s"] for s in result.stats)  # the slowest rank sets the pace
    tokens_per_s = a.batch * a.block / step if step > 0 else float("nan")
    print(f"first loss {result.losses[0]:.4f}")
    print(f"final loss {result.losses[-1]:.4f}, held-out loss {held_out_loss(model, held_out):.4f}, "
          f"{tokens_per_s:,.0f} tokens/s ({a.strategy} on {a.devices} device(s), median step {1e3 * step:.1f} ms)")
    print("sample:", repr(greedy(model, a.prompt, a.sample)))


if __name__ == "__main__":
    main()
