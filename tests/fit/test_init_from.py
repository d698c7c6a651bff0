"""Fine-tuning from pretrained weights: ``init_from=`` reads a Hugging Face directory straight into the
shards of a meta-device model, and the run equals single-device fine-tuning from ``from_pretrained`` (float64)."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import llama, logits_loss

import shardwise as sw
from shardwise import launch
from shardwise.plan import rank_states
from shardwise.strategies.registry import resolve
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
        run = fit(strategy, devices, on_meta(saved), init_from=saved)
        same_run(ref, run)
        if strategy == "fsdp":  # the bytes of tensors each rank holds, counted, are the planner's for the meta model
            planned = rank_states(on_meta(saved), resolve("fsdp").describe(2), ADAMW([torch.nn.Parameter(
                torch.zeros(1))]))
            assert [{k: s[k] for k in p.as_stats()} for s, p in zip(run.stats, planned)] == \
                [p.as_stats() for p in planned]


def test_names_and_shapes_that_do_not_fit_are_refused_before_any_process_starts(saved, no_spawn):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(saved)
    config.vocab_size = 64  # another embedding and head shape
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.layers[0].mlp.add_module("adapter", torch.nn.Linear(32, 4, bias=False))
    with pytest.raises(ValueError) as e:
        fit("fsdp", 2, model, init_from=saved)
    assert str(e.value).splitlines()[:4] == [
        f"init_from={saved}: the weights do not fit the model (3 tensors):",
        f"  model.embed_tokens.weight: {saved} has [128, 32], the model [64, 32]",
        "  model.layers.0.mlp.adapter.weight: in the model [4, 32], not in " + saved,
        f"  lm_head.weight: {saved} has [128, 32], the model [64, 32]"]
    with pytest.raises(ValueError, match=r"^init_from=.*: the weights do not fit the model \(2 tensors\):\n  "
                                         r"model\.embed_tokens\.weight: "):
        fit("fsdp", 2, model, init_from=saved, init_allow_missing=["*.adapter.*"])


def test_a_per_expert_moe_checkpoint_is_refused_with_the_reason(tmp_path, no_spawn):
    from tiny_hf import mixtral

    mixtral().save_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = mixtral()
    with pytest.raises(ValueError) as e:
        fit(sw.Parallel(ep=2), 2, model, init_from=str(tmp_path))
    assert str(e.value) == (
        f"init_from={tmp_path} stores the experts one tensor per expert "
        "(model.layers.0.block_sparse_moe.experts.0.w1.weight), while the model holds them fused in 3-D tensors "
        "(model.layers.0.mlp.experts.gate_up_proj): transformers renames and merges them at load (its conversion "
        "mapping), which shardwise does not apply; load the model with from_pretrained and pass it to fit without "
        "init_from")


def test_a_checkpoint_to_resume_wins_over_init_from(saved, tmp_path, capsys):
    directory = str(tmp_path / "run")
    one = sw.Trainer("single", 1, accelerator="cpu", progress=False, checkpoint_dir=directory)
    data = CharText(stdlib_text(20_000), 16)
    one.fit(on_meta(saved), data, logits_loss, ADAMW, batch_size=8, max_steps=1, init_from=saved)
    capsys.readouterr()
    # The same init_from and a meta model again: step 1's checkpoint is resumed, the file is not read.
    second = one.fit(on_meta(saved), data, logits_loss, ADAMW, batch_size=8, max_steps=2, init_from=saved)
    assert (f"shardwise: init_from={saved} is not read: the run resumes from {directory}/step_00000001, whose "
            "weights are this run's own") in capsys.readouterr().err
    assert len(second.losses) == 2
    # The run of a meta model exports to a directory from_pretrained loads (the config is in the checkpoint).
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import tools

    tools.export(directory, str(tmp_path / "hf"), "hf")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in second.state_dict.items())


def _setup_reads_the_file(rank, device, saved, directory, out):
    model, opt = sw.setup(on_meta(saved), ADAMW, strategy="zero3", accelerator="cpu", init_from=saved)
    full = model.state_dict()  # a collective: every rank gathers
    sw.save(model, opt, directory, step=0)
    # A shardwise checkpoint is a source too: read into another layout's shards (DCP, any layout to any).
    again, _ = sw.setup(on_meta(saved), ADAMW, strategy="fsdp", accelerator="cpu", init_from=directory)
    if rank == 0:
        torch.save([full, again.state_dict()], out)
    else:
        again.state_dict()


def test_sw_setup_reads_init_from_into_zero3_shards(saved, tmp_path):
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "sd.pt")
    launch.spawn(_setup_reads_the_file, 2, args=(saved, str(tmp_path / "ckpt"), out))
    want = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float64).state_dict()
    for got in torch.load(out, weights_only=True):
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k


class LoRA(torch.nn.Linear):
    """A frozen linear layer plus a trainable low-rank update ``x A^T B^T`` (Hu et al. 2021), its weight under its
    own name (so it loads from the pretrained file) and its adapters new."""

    def __init__(self, base: torch.nn.Linear, r: int = 4) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        w = base.weight
        self.lora_a = torch.nn.Parameter(torch.empty(r, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = torch.nn.Parameter(torch.empty(self.out_features, r, dtype=w.dtype, device=w.device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.lora_a.device.type == "meta":
            return
        g = torch.Generator().manual_seed(self.out_features)  # the same adapters however the model was built
        with torch.no_grad():
            self.lora_a.copy_(0.1 * torch.randn(self.lora_a.shape, generator=g))
            self.lora_b.copy_(0.1 * torch.randn(self.lora_b.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_a), self.lora_b)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    return model


def test_lora_on_a_frozen_base_under_fsdp_and_zero3_equals_single_device(saved, same_run):
    from transformers import LlamaForCausalLM

    ref = fit("single", 1, with_lora(LlamaForCausalLM.from_pretrained(saved, dtype=torch.float64)))
    adapters = sum(p.numel() for n, p in with_lora(on_meta(saved)).named_parameters() if ".lora_" in n)
    assert ref.stats[0]["optimizer_bytes"] == 2 * 8 * adapters  # AdamW's two states, for the adapters only
    for strategy in ("fsdp", "zero3"):
        run = fit(strategy, 2, with_lora(on_meta(saved)), init_from=saved, init_allow_missing=["*.lora_?"])
        same_run(ref, run)
        assert sum(s["optimizer_bytes"] for s in run.stats) == 2 * 8 * adapters


def test_a_rectangle_is_read_through_get_slice_in_bounded_chunks_and_converted(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from shardwise.checkpoint import pretrained

    w = torch.randn(6, 4, 3, dtype=torch.float32).to(torch.bfloat16)
    save_file({"a": torch.arange(5.0), "w": w, "s": torch.tensor(7, dtype=torch.int64)},
              str(tmp_path / "x.safetensors"))
    source = pretrained.open_source(str(tmp_path / "x.safetensors"))
    assert source.shapes == {"a": [5], "w": [6, 4, 3], "s": []}
    monkeypatch.setattr(pretrained, "CHUNK_BYTES", 2 * 2 * 3 * 2)  # two rows of the rectangle per read
    reads, read = [], pretrained._slice
    monkeypatch.setattr(pretrained, "_slice", lambda part, box: reads.append(box) or read(part, box))
    out = torch.empty(3, 2, 3, dtype=torch.float64)
    assert pretrained.read_box(source.tensors["w"], (2, 1, 0), out) == 3 * 2 * 3 * 2  # the rectangle's bytes only
    assert reads == [(slice(2, 4), slice(1, 3), slice(0, 3)), (slice(4, 5), slice(1, 3), slice(0, 3))]
    assert torch.equal(out, w[2:5, 1:3].double())
    scalar = torch.empty((), dtype=torch.float32)
    pretrained.read_box(source.tensors["s"], (), scalar)
    assert scalar.item() == 7.0
