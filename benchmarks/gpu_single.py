"""One GPU, GPT-2 small (124M, sequence 1024), bf16-mixed: the Trainer under single, ddp, fsdp and zero2 against
a raw PyTorch loop, and against the planner's predicted step time.

Measures, alternating the contenders over several repetitions (medians):
tokens/s and model FLOPs utilisation (6 x parameters x tokens / peak FLOP/s;
attention's own FLOPs left out, as nanoGPT's estimate without them) of the
Trainer under each strategy (world size 1: on CUDA inside a NCCL group of
one, as under ``shardwise run --nproc 1``) and of a plain loop doing the same
steps, and each one's ratio to the loop; the planner's predicted step time
for the same layout (shardwise.plan.estimate, the device's preset); then the
activation-checkpointing run: peak CUDA memory saved, measured, against what
the planner (shardwise.plan.plan_run) predicts it saves.

    python benchmarks/gpu_single.py --out results/gpu_single.json        # on the GPU machine
    python benchmarks/gpu_single.py --tiny --device cpu                  # smoke test anywhere (seconds)

Written for the lent GPU machine (docs/gpu.md; results in benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss

H100_BF16_DENSE = 989e12  # FLOP/s, H100 SXM bf16 dense (the usual MFU denominator; the H200 has the same chip)
STRATEGIES = ("single", "ddp", "fsdp", "zero2")


class RandomTokens(Dataset):
    """Fixed random token sequences: (x, y) = (tokens[:-1], tokens[1:]), the same every run."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def config(tiny: bool) -> GPTConfig:
    if tiny:
        return GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    # GPT-2 small: 12 layers, 12 heads, 768 wide, the output layer tied to the embedding (124M parameters: the
    # first H200 run, untied, measured 163M); vocabulary padded to 50304 (a multiple of 64).
    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_weights=True)


def make_model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh(device: torch.device) -> int:
    """Free what earlier contenders left (reference cycles, the caching allocator's blocks) and return the CUDA
    bytes still allocated: a peak measured after this is the contender's own plus that baseline. (The first H200
    run measured without it; its peaks rose by about one model's fp32 weights with each contender.)"""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def memory_phases(cfg: GPTConfig, data: RandomTokens, batch: int, device: torch.device, checkpointing: bool) -> dict:
    """Where one raw-loop step's CUDA memory peaks (its second step, after AdamW's state exists): bytes allocated
    before the step and after the forward (what the forward keeps for backward), and the peak within forward,
    backward and the optimizer's step; ``checkpointing`` checkpoints every block as the Trainer's option does."""
    from shardwise.parallel.checkpointing import apply_activation_checkpointing

    fresh(device)  # as every contender: what earlier runs left is freed first (and shows in "before_step")
    model = make_model(cfg).to(device)
    if checkpointing:
        apply_activation_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    out: dict[str, int] = {}

    def mark(name: str, peak: bool = True) -> None:
        sync(device)
        if device.type == "cuda":
            out[name] = torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    for _step in range(2):
        x, y = data.data[:batch, :-1].to(device), data.data[:batch, 1:].to(device)
        mark("before_step", peak=False)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        mark("peak_forward")
        mark("after_forward", peak=False)
        loss.backward()
        mark("peak_backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("peak_optimizer_step")
    return out


def raw_loop(cfg: GPTConfig, data: RandomTokens, batch: int, steps: int, device: torch.device) -> dict:
    """The same steps in plain PyTorch: AdamW, bf16 autocast, no library in between."""
    before = fresh(device)
    model = make_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % len(data)
        sync(device)
        start = time.perf_counter()
        # Inside the timed step, as the Trainer's step time has its batch's fetch and copy (the first H200 run
        # left it out here, which favoured the loop).
        x, y = data.data[idx, :-1].to(device, non_blocking=True), data.data[idx, 1:].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the Trainer reads every step's loss too
        sync(device)
        times.append(time.perf_counter() - start)
    out = {"step_time_s": statistics.median(times[1:] if len(times) > 1 else times),
           "cuda_allocated_before_bytes": before}
    if device.type == "cuda":
        out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def trainer_run(cfg: GPTConfig, data: RandomTokens, batch: int, steps: int, device: torch.device,
                checkpointing: bool = False, strategy: str = "single") -> dict:
    before = fresh(device)
    result = sw.Trainer(strategy, 1, accelerator=device.type, precision="bf16-mixed", progress=False,
                        memory_check="off", activation_checkpointing=checkpointing).fit(
        make_model(cfg), data, lm_loss, functools.partial(torch.optim.AdamW, lr=3e-4), batch_size=batch,
        max_steps=steps)
    s = result.stats[0]
    kept = ("step_time_s", "peak_rss_bytes", "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes",
            "activation_bytes")
    return {"cuda_allocated_before_bytes": before} | {k: s[k] for k in kept if k in s}


def group_of_one(device: torch.device) -> None:
    """A process group of one (NCCL on CUDA, gloo on CPU) that every Trainer run here joins: world size 1, as
    under ``shardwise run --nproc 1``; without it a distributed strategy would form its own group per run."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            timeout=dt.timedelta(minutes=5))


def predicted_step_times(cfg: GPTConfig, batch: int, device: torch.device) -> dict[str, float]:
    """The planner's step time of each strategy for this model, batch and device at world size 1 (its preset for
    the device: H200 or H100; the CPU smoke test borrows the H100's)."""
    from shardwise.plan.estimate import estimate
    from shardwise.plan.model import ModelSpec
    from shardwise.plan.specs import GPU_PRESETS, ClusterSpec, Layout, TrainingSpec

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    preset = "h200-141gb" if "H200" in name else "h100-80gb"
    with torch.device("meta"):
        spec = ModelSpec.from_module(GPT(cfg), seq_len=cfg.block_size, name="gpt2-small")
    cluster = ClusterSpec.with_devices(1, 1, name=preset, **GPU_PRESETS[preset])  # type: ignore[arg-type]
    training = TrainingSpec(global_batch=batch, micro_batch=batch, seq_len=cfg.block_size, precision="bf16-mixed",
                            autocast=True, flash_attention=True)
    # At world size 1 the planner's ddp is the single device (nothing to reduce); its search lists only that
    # layout there, so each strategy's layout is estimated directly.
    out = {s: estimate(spec, cluster, training, Layout("ddp" if s == "single" else s, 1, 1, 1)).step_time_s
           for s in STRATEGIES}
    out["preset"] = preset  # type: ignore[assignment]
    return out


def predicted_activation_bytes(cfg: GPTConfig, batch: int, checkpointing: bool, memory: int) -> int:
    from shardwise.plan import plan_run

    layout = sw.Trainer("single", 1, accelerator="cpu").strategy.describe(1).with_run("bf16-mixed", checkpointing)
    with torch.device("meta"):
        model = GPT(cfg)
    return plan_run(model, layout, memory, batch, "adamw", suggest=False).activation_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT on 32 tokens: checks the script runs")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; tiny 4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per repetition (default 20; tiny 3)")
    ap.add_argument("--reps", type=int, default=None, help="alternating repetitions (default 5; tiny 1)")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help=f"peak FLOP/s of the device for MFU (default on CUDA: {H100_BF16_DENSE:.3g}, H100 bf16)")
    ap.add_argument("--contenders", default=",".join(("raw", *STRATEGIES)),
                    help="comma-separated subset of raw,single,ddp,fsdp,zero2 (default: all; raw is always run)")
    ap.add_argument("--no-memory", action="store_true", help="skip the checkpointing and memory-phase runs")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (use --device cpu --tiny for a smoke test)")
    batch = a.batch or (4 if a.tiny else 8)
    steps = a.steps or (3 if a.tiny else 20)
    reps = a.reps or (1 if a.tiny else 5)
    peak = a.peak_flops or (H100_BF16_DENSE if device.type == "cuda" else None)
    cfg = config(a.tiny)
    data = RandomTokens(batch * steps, cfg.block_size, cfg.vocab_size)
    n_params = sum(p.numel() for p in make_model(cfg).parameters())
    tokens = batch * cfg.block_size

    group_of_one(device)
    warnings.filterwarnings("ignore", message=".*runs one process on one device")  # world size 1 is the point
    chosen = [n for n in a.contenders.split(",") if n]
    unknown = sorted(set(chosen) - {"raw", *STRATEGIES})
    if unknown:
        ap.error(f"--contenders: unknown {', '.join(unknown)} (choose from raw, {', '.join(STRATEGIES)})")
    strategies = [n for n in STRATEGIES if n in chosen]
    runs: dict[str, list[dict]] = {name: [] for name in ("raw", *strategies)}
    for r in range(reps):  # alternating, so drifts (clocks, temperature) hit every contender alike
        for name in runs:
            if name == "raw":
                runs[name].append(raw_loop(cfg, data, batch, steps, device))
            else:
                runs[name].append(trainer_run(cfg, data, batch, steps, device, strategy=name))
        print(f"rep {r}: " + ", ".join(f"{n} {v[-1]['step_time_s'] * 1e3:.1f}" for n, v in runs.items())
              + " ms/step", flush=True)

    predicted = predicted_step_times(cfg, batch, device)

    def summary(name: str) -> dict:
        t = statistics.median(x["step_time_s"] for x in runs[name])
        out = {"step_time_s": t, "step_times_s": [x["step_time_s"] for x in runs[name]], "tokens_per_s": tokens / t,
               "cuda_peak_allocated_bytes": runs[name][-1].get("cuda_peak_allocated_bytes"),
               "cuda_allocated_before_bytes": runs[name][-1]["cuda_allocated_before_bytes"]}
        if peak:
            out["mfu"] = 6 * n_params * tokens / t / peak
        if name != "raw":
            out["predicted_step_time_s"] = predicted[name]
            out["measured_over_predicted"] = t / predicted[name]
            # Each repetition's raw step over this contender's (the two ran back to back), median and quartiles:
            # a drift of the machine that outlasts a repetition cancels, unlike in the ratio of medians.
            ratios = sorted(r["step_time_s"] / c["step_time_s"] for r, c in zip(runs["raw"], runs[name]))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            out["paired_over_raw"] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}
        return out

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "params": n_params, "batch": batch, "seq": cfg.block_size, "steps": steps,
           "reps": reps, "precision": "bf16-mixed", "peak_flops": peak, "planner_preset": predicted["preset"],
           **{name: summary(name) for name in runs}}
    res["trainer_over_raw_tokens_per_s"] = {n: res[n]["tokens_per_s"] / res["raw"]["tokens_per_s"]
                                            for n in strategies}
    if a.no_memory or "single" not in runs:
        return finish(res, a.out)
    ours = runs["single"]

    ck = trainer_run(cfg, data, batch, steps, device, checkpointing=True)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 1 << 40
    pred = {c: predicted_activation_bytes(cfg, batch, c, memory) for c in (False, True)}
    key = "cuda_peak_allocated_bytes" if device.type == "cuda" else "peak_rss_bytes"
    res["checkpointing"] = {
        "memory_key": key,
        "without_bytes": ours[-1].get(key), "with_bytes": ck.get(key),
        "saved_measured_bytes": (ours[-1].get(key) or 0) - (ck.get(key) or 0),
        "saved_predicted_bytes": pred[False] - pred[True],
        "predicted_activation_bytes": {"without": pred[False], "with": pred[True]},
        "step_time_s": ck["step_time_s"],
        "allocated_before_bytes": ck.get("cuda_allocated_before_bytes"),
    }
    res["memory_phases"] = {name: memory_phases(cfg, data, batch, device, ck)
                            for name, ck in (("without", False), ("with", True))}
    return finish(res, a.out)


def finish(res: dict, out: str | None) -> int:
    text = json.dumps(res, indent=2)
    print(text)
    dist.destroy_process_group()
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
