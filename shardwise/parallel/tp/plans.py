"""Tensor-parallel plans: which submodule becomes what, and the built-in plans per model family.

A :class:`Plan` maps module-name patterns to a :class:`Style` (``colwise``,
``rowwise``, ``vocab``), with model-level checks and fix-ups and, for
sequence parallelism, a :class:`SequenceLayout`; the built-in
plans cover :class:`shardwise.models.GPT` and MLP and Hugging Face GPT-2 and
Llama. It is separate from ``tp.py`` (the parallel layers, applying a plan,
the strategy) by role: per-model-family knowledge lives here. It imports
the layers (:mod:`shardwise.parallel.tp.layers`) and nothing from ``tp.py``,
which imports it.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from shardwise.models import GPT, MLP
from shardwise.parallel.tp.layers import ColumnParallelLinear


@dataclass(frozen=True)
class Style:
    """How one module is split: ``colwise``, ``rowwise`` or ``vocab``.

    ``gather_output`` all-gathers a column-parallel output (for heads whose
    logits feed the loss); ``parts`` > 1 splits a fused projection (GPT-2's
    ``c_attn`` holds q|k|v) piece by piece so each rank keeps whole heads of each.
    """

    kind: str
    gather_output: bool = False
    parts: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("colwise", "rowwise", "vocab"):
            raise ValueError(f"unknown tensor-parallel style kind {self.kind!r}; valid: colwise, rowwise, vocab")


STYLES: dict[str, Style] = {
    "colwise": Style("colwise"),
    "rowwise": Style("rowwise"),
    "vocab": Style("vocab"),
    "colwise_gather": Style("colwise", gather_output=True),
    "colwise_qkv": Style("colwise", parts=3),
}


def module_pattern(p: str) -> re.Pattern[str]:
    """A plan's module-name pattern as a regular expression: ``*`` matches one path segment."""
    return re.compile("^" + ".".join("[^.]+" if s == "*" else re.escape(s) for s in p.split(".")) + "$")


def as_style(s: str | Style) -> Style:
    if isinstance(s, Style):
        return s
    if s not in STYLES:
        raise ValueError(f"unknown tensor-parallel style {s!r}; valid: {', '.join(STYLES)} (or a Style object)")
    return STYLES[s]


# ---- where the sequence-parallel region begins and ends ----------------------------
@dataclass(frozen=True)
class SequenceLayout:
    """Where one model family's sequence-parallel region lies (Korthikanti et al. 2022, section 4.2.2).

    Under ``sequence_parallel`` the activations between the tensor-parallel
    layers (norms, residual sums, dropout) are split along the sequence (dim 1
    of (B, S, H)) over the tp group. Every entry is a module-name pattern, as
    in :class:`Plan` (``*`` matches one path segment):

    * ``gather``: the modules whose input is all-gathered along the sequence
      (attention and MLP: their forwards reshape with the length they are given,
      so the whole sequence must arrive at the module, not at its first linear
      layer). The backward reduce-scatters, which replaces the ``f`` of the
      column-parallel layers inside;
    * ``norms``: the modules whose replicated parameters act on this rank's
      tokens only; their gradients are summed over tp in every backward (the
      row-parallel biases are handled by the layers themselves);
    * ``exit``: the module whose output is all-gathered, the region's end (the
      final norm); ``exit_to_head``: that output feeds only a column-parallel
      head, so its gradient is reduce-scattered (else the output is consumed
      replicated, as a bare model's hidden states are, and each rank keeps its slice);
    * the region's start, one of: ``embeddings``, vocabulary-parallel
      embeddings whose all-reduce becomes a reduce-scatter, with
      ``scatter_outputs`` (position embeddings: output split along dim -2, so
      (T, H) and (1, T, H) alike); or ``scatter_inputs``, modules whose input
      is split along the sequence (the first block, for models whose forward
      derives positions and the causal mask from the embedding's length, as
      Hugging Face's do: their embedding keeps its all-reduce);
    * ``stage_safe``: the layout still holds when a pipeline cuts the model
      into stages (False when the pipeline's adapters would derive positions
      from a split sequence).
    """

    gather: tuple[str, ...]
    norms: tuple[str, ...]
    exit: str
    exit_to_head: bool = True
    embeddings: tuple[str, ...] = ()
    scatter_outputs: tuple[str, ...] = ()
    scatter_inputs: tuple[str, ...] = ()
    stage_safe: bool = True

    def __post_init__(self) -> None:
        if bool(self.embeddings or self.scatter_outputs) == bool(self.scatter_inputs):
            raise ValueError("SequenceLayout: the region starts either at the embeddings (embeddings, "
                             "scatter_outputs) or at a block's input (scatter_inputs), exactly one of the two")


# ---- plans ----------------------------------------------------------------------
@dataclass
class Plan:
    """Module-name patterns -> styles, plus model-level checks and fix-ups.

    ``check(model, tp)`` raises before anything is split (head counts);
    ``fixup(model, tp)`` adjusts attributes that depend on local widths.
    ``local_attrs`` is the declarative form of the common fix-up: module-name
    pattern -> integer attributes that count what tp splits (heads, widths),
    each divided by tp on every rank, e.g. ``{"blocks.*.attn": ("n_head",
    "n_embd")}`` for attention whose forward reshapes with ``self.n_head``
    (see docs/model_parallel.md, "Your own model under tp").
    ``sequence``: where the sequence-parallel region lies (None: the plan
    cannot run with ``sequence_parallel``).
    """

    styles: dict[str, str | Style]
    check: Callable[[nn.Module, int], None] | None = None
    fixup: Callable[[nn.Module, int], None] | None = None
    name: str = "custom"
    local_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sequence: SequenceLayout | None = None


def _divisible(what: str, n: int, tp: int, why: str) -> None:
    if n % tp:
        raise ValueError(f"tensor parallel: {what}={n} is not divisible by tp={tp} ({n} % {tp} = {n % tp}): {why}")


_HEADS = "attention is split by heads, so every rank must hold the same whole number of heads"
_VOCAB = "the embedding and output head are split by vocabulary rows, an equal range per rank"
_HIDDEN = "the MLP's hidden features are split evenly over the ranks"


def _check_gpt(model: nn.Module, tp: int) -> None:
    c: Any = model.cfg  # shardwise's GPT: its GPTConfig
    _divisible("n_head", c.n_head, tp, _HEADS)
    _divisible("MLP hidden size 4*n_embd", 4 * c.n_embd, tp, _HIDDEN)
    _divisible("vocab_size", c.vocab_size, tp, _VOCAB)


def _check_hf(model: nn.Module, tp: int) -> None:
    c: Any = model.config  # a Hugging Face PretrainedConfig
    _divisible("num_attention_heads", c.num_attention_heads, tp, _HEADS)
    kv = getattr(c, "num_key_value_heads", None)
    if kv is not None:
        _divisible("num_key_value_heads", kv, tp, _HEADS + " (key/value heads too)")
    inner = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    _divisible("intermediate size", inner, tp, _HIDDEN)
    _divisible("vocab_size", c.vocab_size, tp, _VOCAB)


def _fix_gpt2(model: nn.Module, tp: int) -> None:
    # GPT2Attention splits the fused q|k|v output at ``split_size`` (= hidden
    # size); each rank now holds hidden/tp of each part.
    for m in model.modules():
        if type(m).__name__ == "GPT2Attention" and isinstance(getattr(m, "c_attn", None), ColumnParallelLinear):
            m.split_size = m.embed_dim // tp  # type: ignore[assignment,operator]
            m.num_heads = m.num_heads // tp  # type: ignore[assignment,operator]


def gpt_plan(moe: bool = False) -> Plan:
    """For :class:`shardwise.models.GPT`; ``moe``: its blocks hold mixture-of-experts layers, which stay whole
    on every tp rank (each runs its experts on the same tokens; expert parallelism splits experts instead), and
    sequence parallelism is not offered (a replicated layer inside the sequence region would need its own
    scatter)."""
    # GPT.forward takes positions from the token ids, not from the embedding: the region starts at the
    # embedding (its all-reduce becomes a reduce-scatter), and each rank adds its own rows of the positions.
    seq = SequenceLayout(gather=("blocks.*.attn", "blocks.*.mlp"), norms=("blocks.*.ln1", "blocks.*.ln2", "ln_f"),
                         exit="ln_f", embeddings=("tok_emb",), scatter_outputs=("pos_emb",))
    styles: dict[str, str | Style] = {"tok_emb": "vocab", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
                                      "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
                                      "head": "colwise_gather"}
    if not moe:
        styles.update({"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"})
    return Plan(styles, _check_gpt, None, "gpt", sequence=None if moe else seq)


def _hf_sequence(base: str, blocks: str, attn: str, norms: tuple[str, str], final: str,
                 head: bool) -> SequenceLayout:
    # Hugging Face forwards derive position ids and the causal mask from the embedding output's length, so
    # the embedding keeps its all-reduce and the region starts at the first block's input; the pipeline's
    # block adapters derive positions from their input's length, which the split would make wrong.
    b = base + blocks + ".*."
    return SequenceLayout(gather=(b + attn, b + "mlp"), norms=(b + norms[0], b + norms[1], base + final),
                          exit=base + final, exit_to_head=head, scatter_inputs=(base + blocks + ".0",),
                          stage_safe=False)


def gpt2_plan(prefix: str = "transformer.") -> Plan:
    """For Hugging Face ``GPT2LMHeadModel`` (``prefix=""`` for a bare ``GPT2Model``)."""
    h = prefix + "h.*."
    styles: dict[str, str | Style] = {prefix + "wte": "vocab", h + "attn.c_attn": "colwise_qkv",
                                      h + "attn.c_proj": "rowwise", h + "mlp.c_fc": "colwise",
                                      h + "mlp.c_proj": "rowwise"}
    if prefix:
        styles["lm_head"] = "colwise_gather"
    return Plan(styles, _check_hf, _fix_gpt2, "gpt2",
                sequence=_hf_sequence(prefix, "h", "attn", ("ln_1", "ln_2"), "ln_f", bool(prefix)))


def llama_plan(prefix: str = "model.", moe: bool = False) -> Plan:
    """For Hugging Face ``LlamaForCausalLM`` (``prefix=""`` for a bare ``LlamaModel``) and the decoders of its
    layout (Mistral, Qwen2; ``moe``: Mixtral, whose ``mlp`` is a mixture of experts left whole on every tp
    rank, as in :func:`gpt_plan`)."""
    L = prefix + "layers.*."
    styles: dict[str, str | Style] = {prefix + "embed_tokens": "vocab"}
    for n in ("q_proj", "k_proj", "v_proj"):
        styles[L + "self_attn." + n] = "colwise"
    styles[L + "self_attn.o_proj"] = "rowwise"
    if not moe:
        styles[L + "mlp.gate_proj"] = "colwise"
        styles[L + "mlp.up_proj"] = "colwise"
        styles[L + "mlp.down_proj"] = "rowwise"
    if prefix:
        styles["lm_head"] = "colwise_gather"
    return Plan(styles, _check_hf, None, "llama", sequence=None if moe else _hf_sequence(
        prefix, "layers", "self_attn", ("input_layernorm", "post_attention_layernorm"), "norm", bool(prefix)))


def _fix_bert(model: nn.Module, tp: int) -> None:
    # Older transformers reshape q/k/v with the full head count (``num_attention_heads``,
    # ``all_head_size``); each rank holds heads/tp of them (5.x infers it with -1, and this is a no-op).
    for m in model.modules():
        if type(m).__name__.endswith("SelfAttention") and isinstance(getattr(m, "query", None), ColumnParallelLinear):
            if hasattr(m, "num_attention_heads"):
                m.num_attention_heads = m.num_attention_heads // tp  # type: ignore[assignment,operator]
            if hasattr(m, "all_head_size"):
                m.all_head_size = m.all_head_size // tp  # type: ignore[assignment,operator]


def bert_plan(prefix: str = "bert.") -> Plan:
    """For Hugging Face ``BertForMaskedLM`` (``prefix=""`` for a bare ``BertModel``): Megatron pairs in every
    layer, the vocabulary-parallel embedding and, with the MLM head, the decoder tied to it (its bias is tied
    to ``cls.predictions.bias`` as well: both names hold the same slice)."""
    L = prefix + "encoder.layer.*."
    styles: dict[str, str | Style] = {prefix + "embeddings.word_embeddings": "vocab"}
    for n in ("query", "key", "value"):
        styles[L + "attention.self." + n] = "colwise"
    styles[L + "attention.output.dense"] = "rowwise"
    styles[L + "intermediate.dense"] = "colwise"
    styles[L + "output.dense"] = "rowwise"
    if prefix:
        styles["cls.predictions.decoder"] = "colwise_gather"
    return Plan(styles, _check_hf, _fix_bert, "bert")


def mlp_plan(model: nn.Module) -> Plan:
    """For :class:`shardwise.models.MLP`: hidden Linear layers in Megatron pairs, column- then row-parallel.

    A pair costs one all-reduce in forward and one in backward (the ReLU between
    them is element-wise, so it runs on the column shards). The classifier head
    and an unpaired last hidden layer stay replicated.
    """
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:-1]
    styles: dict[str, str | Style] = {}
    for col, row in zip(linears[0::2], linears[1::2]):
        styles[col], styles[row] = "colwise", "rowwise"
    return Plan(styles, None, None, "mlp")


def plan_for(model: nn.Module) -> Plan:
    """The built-in plan for ``model``'s type."""
    kind = type(model).__name__
    if isinstance(model, GPT):
        return gpt_plan(moe=bool(model.cfg.n_experts))
    if isinstance(model, MLP):
        return mlp_plan(model)
    if kind in ("GPT2LMHeadModel", "GPT2Model"):
        return gpt2_plan("transformer." if kind == "GPT2LMHeadModel" else "")
    if kind in ("LlamaForCausalLM", "LlamaModel"):
        return llama_plan("model." if kind == "LlamaForCausalLM" else "")
    if kind in ("MixtralForCausalLM", "MixtralModel"):
        return llama_plan("model." if kind == "MixtralForCausalLM" else "", moe=True)
    if kind in ("BertForMaskedLM", "BertModel"):
        return bert_plan("bert." if kind == "BertForMaskedLM" else "")
    raise ValueError(f"no built-in tensor-parallel plan for {kind}; pass plan={{'<module pattern>': "
                     "'colwise' | 'rowwise' | 'vocab' | 'colwise_gather', ...}")


def resolve_plan(plan: Plan | dict[str, str | Style] | str | None, model: nn.Module) -> Plan:
    if plan is None or plan == "auto":
        return plan_for(model)
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        table = {"gpt": gpt_plan, "gpt2": gpt2_plan, "llama": llama_plan, "bert": bert_plan}
        if plan not in table:
            raise ValueError(f"unknown built-in plan {plan!r}; valid: auto, {', '.join(table)}")
        return table[plan]()  # type: ignore[no-any-return,operator]
    return Plan(dict(plan))
