"""Train a Hugging Face GPT-2 (built from a small config, nothing downloaded) with sw.Trainer.

The model is ``transformers.GPT2LMHeadModel(GPT2Config(...))``: shardwise
takes any ``nn.Module``, so the data-parallel and sharded strategies apply to
it unchanged (tensor and pipeline parallelism need a plan for the model's
layer names; ``examples/char_gpt.py`` shows those on shardwise's own GPT).
The corpus is the source text of Python's standard library, tokenized at byte
level (each UTF-8 byte is a token, vocabulary 256), so no tokenizer files are
needed either:

    HF_HUB_OFFLINE=1 python examples/hf_gpt2.py                       # ddp on 2 processes, 200 steps
    HF_HUB_OFFLINE=1 python examples/hf_gpt2.py --strategy zero3 --precision bf16-mixed
    HF_HUB_OFFLINE=1 python examples/hf_gpt2.py --strategy fsdp --activation-checkpointing
    HF_HUB_OFFLINE=1 python examples/hf_gpt2.py --accelerator cpu --devices 4   # default auto: CUDA when present

Rank 0 prints the first and final training loss, the held-out loss and the
throughput in tokens per second.
"""
from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build from a config; never reach the network

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import shardwise as sw
from shardwise.workloads import stdlib_text


class ByteText(Dataset):
    """Next-byte windows over UTF-8 text: token ids 0..255, ``block`` tokens per sample."""

    def __init__(self, text: str, block: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block:(i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


def lm_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a Hugging Face ``CausalLMOutput`` (its ``.logits``), or on the plain logits
    tensor that a pipeline's last stage returns (``pp``: the stages run the model's layers, not its forward)."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def make_model(a: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=a.block, n_embd=a.embd, n_layer=a.layers, n_head=a.heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)  # byte vocabulary: GPT-2's 50256 does not exist
    torch.manual_seed(0)  # same initial weights for every strategy and device count
    return GPT2LMHeadModel(cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, zero3, fsdp, single, ...")
    p.add_argument("--accelerator", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "2")),
                   help="processes, one per device (under torchrun: its world size)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="GLOBAL batch (sequences per optimizer step)")
    p.add_argument("--block", type=int, default=64, help="context length in bytes")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chars", type=int, default=100_000, help="characters of training text")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed"])
    p.add_argument("--activation-checkpointing", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    text = stdlib_text(a.chars + 10_000)
    train, held_out = ByteText(text[:a.chars], a.block), ByteText(text[a.chars:], a.block)
    model = make_model(a)
    trainer = sw.Trainer(strategy=a.strategy, devices=a.devices, accelerator=a.accelerator, precision=a.precision,
                         activation_checkpointing=a.activation_checkpointing)
    result = trainer.fit(model, train, lm_loss, optimizer=functools.partial(torch.optim.AdamW, lr=a.lr),
                         batch_size=a.batch, max_steps=a.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    model = make_model(a)
    model.load_state_dict(result.state_dict)
    model.eval()
    with torch.no_grad():
        n = min(len(held_out), 64)
        x = torch.stack([held_out[i][0] for i in range(n)])
        y = torch.stack([held_out[i][1] for i in range(n)])
        test = float(lm_loss(model(x), y))
    step = max(s["step_time_s"] for s in result.stats)  # the slowest rank sets the pace
    print(f"first loss {result.losses[0]:.4f}")
    print(f"final loss {result.losses[-1]:.4f}, held-out loss {test:.4f}, "
          f"{a.batch * a.block / step:,.0f} tokens/s ({a.strategy} on {a.devices} device(s), "
          f"median step {1e3 * step:.1f} ms)")


if __name__ == "__main__":
    main()
