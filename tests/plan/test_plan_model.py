"""Model inputs: known shapes against their published parameter counts, guessed shapes, meta-device tracing."""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.models import GPT, MLP, GPTConfig
from shardwise.plan import (
    KNOWN_MODELS,
    ModelSpec,
    known_model,
    trace_factory,
    trace_module,
)
from shardwise.stats import current_rss_bytes

pytestmark = pytest.mark.timeout(60)

# Parameter counts of the released checkpoints (GPT-2: the four OpenAI checkpoints; Llama 2:
# Meta's 7B and 70B), counted from their weights, and GPT-3's 175.0B (Brown et al. 2020, Table 2.1).
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200, "llama2-7b": 6_738_415_616, "llama2-70b": 68_976_648_192}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_known_shapes_give_the_published_counts(name):
    assert KNOWN_MODELS[name].params == PUBLISHED[name]


def test_gpt3_175b():
    m = KNOWN_MODELS["gpt3-175b"]
    assert (m.layers, m.hidden, m.heads, m.seq_len) == (96, 12288, 96, 2048)
    assert m.params == pytest.approx(175.0e9, rel=0.005)


def test_aliases_and_unknown_names():
    assert known_model("Llama-2-7B").params == PUBLISHED["llama2-7b"]
    with pytest.raises(KeyError, match="known"):
        known_model("gpt5")


@pytest.mark.parametrize("params", [125e6, 1.3e9, 7.5e9, 70e9, 175e9, 1e12])
def test_guessed_shape_keeps_the_count_and_splits_eight_ways(params):
    m = ModelSpec.from_params(params)
    assert m.params == int(params) and m.shape_inferred
    assert m.shape_params() == pytest.approx(params, rel=0.06)
    assert m.heads % 8 == 0 and m.hidden == 128 * m.heads
    assert m.stage_params(tp=1, pp=1) == m.params


def test_stage_params_split_the_declared_count():
    m = KNOWN_MODELS["llama2-7b"]
    assert m.stage_params(tp=2) == pytest.approx(m.params / 2, rel=1e-6)
    # The last stage holds 8 blocks plus the untied output layer: more than a quarter.
    assert m.stage_params(pp=4) == 8 * m.layer_params() + m.vocab * m.hidden + m.hidden


def test_from_module_reads_a_gpt_config():
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    spec = ModelSpec.from_module(model)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (2, 64, 4, 128, 32)
    assert spec.shape_params() == spec.params  # the shape formula counts this model exactly
    plain = ModelSpec.from_module(MLP())
    assert not plain.is_transformer and plain.largest_layer_params == 128 * 128 + 128


def test_meta_trace_equals_what_a_real_forward_saves():
    """Activation bytes traced on meta equal those autograd saves in a real CPU forward.

    The meta device runs attention on the math path, so the real run is pinned to it too.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    tr = trace_module(model, (8, 32), torch.long)
    assert tr.batch == 8 and tr.flops > 0 and len(tr.layer_outputs) == 20
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 128, (8, 32)))
    assert tr.saved_bytes == sum(saved.values())
    # Parameters were not touched: the trace ran on a meta copy.
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_traced_flops_match_6_params_tokens():
    """Kaplan et al. 2020: 6 FLOPs per parameter per token (2 forward, 4 backward), less the
    input gradient of the first layer, which nobody asks for."""
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    tr = trace_module(model, (16, 512))
    matmul_params = 2 * 512 * 2048
    assert tr.flops == 6 * matmul_params * 16 - 2 * (512 * 2048) * 16


def test_factory_is_built_on_meta_without_allocating(tmp_path):
    # ~3.3B parameters: 13 GB in fp32 if it were allocated.
    src = tmp_path / "big_model.py"
    src.write_text(textwrap.dedent("""
        from shardwise.models import GPT, GPTConfig

        def make():
            return GPT(GPTConfig(vocab_size=32000, block_size=512, n_layer=16, n_head=32, n_embd=4096))
    """))
    before = current_rss_bytes()
    spec = trace_factory(f"{src}:make", (2, 512), "long")
    assert current_rss_bytes() - before < 1_000_000_000
    expected = ModelSpec.transformer(16, 4096, 32, vocab=32000, seq_len=512, tied_embeddings=False).shape_params()
    assert spec.params == expected > 3e9
    assert spec.trace is not None and spec.trace.batch == 2 and spec.trace.saved_bytes > 0
    assert spec.largest_layer_params == 32000 * 4096


def test_factory_errors(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def make():\n    return 3\n")
    with pytest.raises(FileNotFoundError):
        trace_factory(f"{tmp_path}/missing.py:make", (1, 4))
    with pytest.raises(AttributeError):
        trace_factory(f"{src}:nope", (1, 4))
    with pytest.raises(TypeError):
        trace_factory(f"{src}:make", (1, 4))
    with pytest.raises(ValueError):
        trace_factory("no_colon", (1, 4))
