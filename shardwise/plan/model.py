"""Model descriptions: a parameter count, a transformer shape, a known shape or a traced module."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch import nn

from shardwise.parallel.ep import EXPERT_WEIGHTS, expert_modules, expert_parameter_count
from shardwise.plan.known import ALIASES, SHAPES


@dataclass(frozen=True)
class Trace:
    """What tracing a module on the meta device found (see :mod:`shardwise.plan.trace`).

    Byte counts are for the traced input (``batch`` samples) at the traced
    dtype (normally fp32). ``saved_bytes`` is what autograd keeps for the
    backward pass, parameters excluded; ``layer_outputs`` is each leaf
    module's output size; ``flops`` counts forward plus backward.
    """

    input_shape: tuple[int, ...]
    input_dtype: str
    batch: int
    saved_bytes: int
    saved_float_bytes: int
    layer_outputs: tuple[tuple[str, int], ...]
    flops: float


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it.

    ``params`` is authoritative. A transformer shape (``layers``, ``hidden``,
    ``heads``...) is what activations, tensor-parallel traffic and stage
    splits are computed from; without one only the data-parallel family of
    layouts applies. ``shape_inferred`` marks a shape guessed from the
    parameter count. ``largest_layer_params`` is the largest unit ZeRO-3 /
    FSDP gathers at once. ``param_numels`` (filled for real modules) lets
    shards be padded per parameter, exactly as our ZeRO and FSDP lay them out.

    A mixture of experts (``experts`` > 0): every block's MLP is ``experts``
    SiLU-gated MLPs of width ``moe_ffn_hidden`` (Mixtral's 3-D ``gate_up_proj``
    (E, 2I, h) and ``down_proj`` (E, h, I), 3 E h I per layer) behind a router
    (E x h) that sends each token to ``top_k`` of them. ``expert_params`` is
    the experts' total over all layers (the part expert parallelism divides by
    ep); :attr:`active_params` is what one token runs through. For a real
    module ``param_experts`` marks, parameter by parameter, the expert weights.

    ``fused_attention``: the model's attention keeps no score matrix for backward (a fused kernel: torch's
    ``scaled_dot_product_attention``, as shardwise's GPT and Hugging Face's ``attn_implementation="sdpa"``
    or FlashAttention use), so activations are counted as with ``TrainingSpec(flash_attention=True)``.
    """

    name: str
    params: int
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    seq_len: int = 0
    ffn_hidden: int = 0
    kv_heads: int = 0
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True
    norm: str = "layernorm"
    bias: bool = True
    largest_layer_params: int = 0
    param_numels: tuple[int, ...] = ()
    shape_inferred: bool = False
    trace: Trace | None = None
    experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    expert_params: int = 0
    param_experts: tuple[bool, ...] = ()
    fused_attention: bool = False

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ValueError("a model needs at least one parameter")
        if self.is_transformer and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")
        if not 0 <= self.expert_params < self.params:
            raise ValueError(f"expert_params={self.expert_params} must be below params={self.params}")
        if self.param_experts and len(self.param_experts) != len(self.param_numels):
            raise ValueError("param_experts must mark every entry of param_numels")

    # ---- shape-derived quantities ------------------------------------
    @property
    def is_transformer(self) -> bool:
        return self.layers > 0 and self.hidden > 0 and self.heads > 0

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def unit_params(self) -> int:
        """Parameters of the largest unit ZeRO-3/FSDP gathers (a block, or the embedding)."""
        if self.largest_layer_params:
            return self.largest_layer_params
        if self.is_transformer:
            return max(self.layer_params(), self.vocab * self.hidden)
        return self.params

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """Key/value heads one of ``tp`` ranks holds (grouped-query attention: one replicated head when fewer
        than tp)."""
        return -(-(self.kv_heads or self.heads) // tp)

    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP or router and every expert, two norms)."""
        h, f = self.hidden, self.ffn
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        attn = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if self.bias else 0)
        if self.is_moe:
            return attn + self.experts * h + self.expert_layer_params() + 2 * self._norm_params()
        mlp = (3 if self.gated_mlp else 2) * h * f + ((2 if self.gated_mlp else 1) * f + h if self.bias else 0)
        return attn + mlp + 2 * self._norm_params()

    # ---- a mixture of experts ------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_ffn(self) -> int:
        """One expert's inner width (Mixtral's intermediate_size; our GPT's default 2 h)."""
        return self.moe_ffn_hidden or self.ffn

    def expert_layer_params(self) -> int:
        """The experts of one MoE layer: E SiLU-gated MLPs, 3 h I each (no biases, as Mixtral's)."""
        return self.experts * 3 * self.hidden * self.moe_ffn if self.is_moe else 0

    @property
    def dense_params(self) -> int:
        """Everything but the experts: what every rank of an ep group holds whole."""
        return self.params - self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: the dense part and ``top_k`` of each layer's ``experts``."""
        if not self.is_moe:
            return self.params
        return self.dense_params + self.expert_params * self.top_k // self.experts

    def params_per_rank(self, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[int, int]:
        """(total, active) parameters of one device of the heaviest pipeline stage: it holds the dense part
        split tp ways and 1/ep of the stage's experts (never tp-split: every tp rank runs them whole); a token
        runs through the dense part and top_k of each layer's E experts, wherever they are (the active count
        does not shrink with ep, the experts just live on other ranks)."""
        dense, expert = self.stage_split(tp, pp, ep)
        active = expert * ep * self.top_k // self.experts if self.is_moe else 0
        return dense + expert, dense + active

    def local_numels(self, ep: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(dense, expert) parameter sizes of a real module as a rank holds them without tp or pp: every
        expert weight keeps E / ep of its E rows (:func:`shardwise.parallel.ep.apply_expert_parallel`)."""
        marks = self.param_experts or (False,) * len(self.param_numels)
        dense = tuple(n for n, e in zip(self.param_numels, marks) if not e)
        return dense, tuple(n // ep for n, e in zip(self.param_numels, marks) if e)

    def _norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def shape_params(self) -> int:
        """The parameter count the shape implies.

        Narayanan et al. 2021's 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)) for GPT,
        generalised to other MLP widths, gated MLPs, grouped-query attention,
        RMSNorm, no biases and untied output layers.
        """
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.embedding_params() + head + self._norm_params()

    def stage_params(self, tp: int = 1, pp: int = 1) -> int:
        """Parameters held by one device of the heaviest pipeline stage, split tp ways.

        The first stage holds the embeddings, the last the final norm and the
        output layer; with tied embeddings and pp > 1 the last stage keeps its
        own copy (as Megatron-LM does). Matrices split tp ways; the small norm
        vectors are replicated, which we ignore. Scaled to ``params`` so that
        a guessed shape never changes the declared count.
        """
        if not self.is_moe:
            return self.stage_split(tp, pp)[0]
        return sum(self.stage_split(tp, pp))

    def stage_split(self, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[int, int]:
        """(dense, expert) parameters held by one device of the heaviest pipeline stage (see
        :meth:`stage_params`): the dense part split tp ways, the experts ep ways and never tp ways (our tp
        plans leave experts whole), every block being an MoE layer (Mixtral's, our GPT's)."""
        dense = self.dense_params
        if not self.is_transformer or (tp == 1 and pp == 1):
            return math.ceil(dense / (tp * pp)), math.ceil(self.expert_params / (pp * ep))
        expert_layer = self.expert_layer_params()
        per_stage = math.ceil(self.layers / pp) * (self.layer_params() - expert_layer)
        head = self.vocab * self.hidden if (not self.tied_embeddings or pp > 1) else 0
        first = per_stage + self.embedding_params() + (head + self._norm_params() if pp == 1 else 0)
        last = per_stage + head + self._norm_params()
        heaviest = max(first, last) if pp > 1 else first
        shape = self.shape_params()
        shape_dense = shape - self.layers * expert_layer
        # Scaled to the declared counts, so that a guessed (or slightly different) shape never changes them.
        experts = math.ceil(self.expert_params * math.ceil(self.layers / pp) / self.layers / ep) if self.is_moe else 0
        return math.ceil(dense * heaviest / shape_dense / tp), experts

    def stage_flops_share(self, pp: int = 1) -> float:
        """Fraction of the model's FLOPs that the busiest of ``pp`` pipeline stages does.

        Blocks cost the same each; the output layer's matrix multiply (V x h)
        runs on the last stage; the input embedding is a lookup and costs nothing.
        """
        if pp == 1:
            return 1.0
        if not self.is_transformer:
            return 1 / pp
        layer = self.active_layer_params()
        blocks = self.layers * layer
        head = self.vocab * self.hidden
        return (math.ceil(self.layers / pp) * layer + head) / (blocks + head)

    def active_layer_params(self) -> int:
        """Parameters of one block that one token runs through (top_k of its experts in an MoE layer)."""
        if not self.is_moe:
            return self.layer_params()
        return self.layer_params() - self.expert_layer_params() + self.top_k * self.expert_layer_params() \
            // self.experts

    def replace(self, **kw: object) -> ModelSpec:
        return replace(self, **kw)  # type: ignore[arg-type]

    # ---- constructors --------------------------------------------------
    @classmethod
    def transformer(cls, layers: int, hidden: int, heads: int, vocab: int = 50257, seq_len: int = 2048,
                    name: str | None = None, params: int | None = None, **shape: object) -> ModelSpec:
        """A decoder-only transformer; ``params`` defaults to the count its shape implies."""
        given = shape.pop("expert_params", None)
        probe = cls(name="", params=1, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len,
                    **shape)  # type: ignore[arg-type]
        total = params if params is not None else probe.shape_params()
        # The experts' share of a declared count is the shape's share (exact when the count is the shape's).
        experts = probe.layers * probe.expert_layer_params()
        if experts and params is not None:
            experts = experts * params // probe.shape_params()
        return replace(
            probe,
            name=name or f"transformer l{layers} h{hidden}",
            params=total,
            expert_params=int(given) if given is not None else experts,  # type: ignore[call-overload]
        )

    @classmethod
    def from_params(cls, params: float, seq_len: int = 2048, name: str | None = None,
                    infer_shape: bool = True) -> ModelSpec:
        """A model known only by its parameter count.

        With ``infer_shape`` a GPT-style shape is guessed so that activations
        and tensor/pipeline layouts can be estimated: head size 128 and the
        width/depth ratio of GPT-3 and Llama (hidden ~ 128 x layers), the
        hidden size rounded to a multiple of 1024 (8 heads, so tp up to 8
        divides them), the depth then chosen to match the count.
        """
        n = int(round(params))
        label = name or f"{short_count(n)} params"
        if not infer_shape:
            return cls(name=label, params=n)
        vocab = 50257
        ideal_h = 128 * (n / 196608) ** (1 / 3)  # 12 l h^2 = n with h = 128 l
        step = 1024 if ideal_h >= 1024 else 128
        h = max(128, int(round(ideal_h / step)) * step)
        if vocab * h > n / 2:  # small models: an embedding would dwarf the blocks
            vocab = 0
        layers = max(1, int(round((n - vocab * h) / (12 * h * h + 13 * h))))
        return cls(name=label, params=n, layers=layers, hidden=h, heads=max(1, h // 128), vocab=vocab,
                   seq_len=seq_len, shape_inferred=True)

    @classmethod
    def from_module(cls, model: nn.Module, seq_len: int | None = None, name: str | None = None) -> ModelSpec:
        """Exact parameter count of ``model``, and its transformer shape when its config names one.

        Recognised configs: ``model.cfg`` / ``model.config`` with GPT-2 names
        (n_layer, n_embd, n_head) or Llama names (num_hidden_layers,
        hidden_size, num_attention_heads, intermediate_size).
        """
        numels = tuple(p.numel() for p in model.parameters())
        params = sum(numels)
        largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
        label = name or type(model).__name__
        cfg = getattr(model, "cfg", None)
        cfg = getattr(model, "config", None) if cfg is None else cfg
        moe = _experts_of(model, cfg)
        shape = _shape_from_config(cfg) if cfg is not None else None
        if shape is None:
            return cls(name=label, params=params, largest_layer_params=largest, param_numels=numels,
                       **moe)  # type: ignore[arg-type]
        if seq_len:
            shape["seq_len"] = seq_len
        return cls(name=label, params=params, largest_layer_params=largest, param_numels=numels,
                   **shape, **moe)  # type: ignore[arg-type]


def _experts_of(model: nn.Module, cfg: object) -> dict[str, object]:
    """The mixture of experts of a real module, from its experts modules (the ones expert parallelism splits,
    :func:`shardwise.parallel.ep.expert_modules`): E from their weights, top_k from a router or the config."""
    found = [m for _, m in expert_modules(model)]
    if not found:
        return {}
    ids = {id(getattr(m, w)) for m in found for w in EXPERT_WEIGHTS}
    first = found[0].gate_up_proj
    top_k = next((int(m.top_k) for m in model.modules() if isinstance(getattr(m, "top_k", None), int)), 0)  # type: ignore[arg-type]
    for name in ("top_k", "num_experts_per_tok"):  # our GPTConfig, Mixtral's and Qwen2-MoE's configs
        top_k = top_k or int(getattr(cfg, name, 0) or 0)
    return dict(
        experts=int(first.shape[0]),  # type: ignore[index]
        top_k=top_k or 1,
        moe_ffn_hidden=int(first.shape[1]) // 2,  # type: ignore[index]
        expert_params=expert_parameter_count(model),
        param_experts=tuple(id(p) in ids for p in model.parameters()),
    )


def _shape_from_config(cfg: object) -> dict[str, object] | None:
    def get(*names: str) -> int:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and v > 0:
                return v
        return 0

    layers = get("n_layer", "num_hidden_layers", "num_layers")
    hidden = get("n_embd", "hidden_size", "d_model")
    heads = get("n_head", "num_attention_heads")
    if not (layers and hidden and heads) or hidden % heads:
        return None
    kind = type(cfg).__name__.lower()
    llama_like = "llama" in kind or "mixtral" in kind  # RoPE, RMSNorm, SwiGLU, no biases
    tied = getattr(cfg, "tie_weights", getattr(cfg, "tie_word_embeddings", True))
    return dict(layers=layers, hidden=hidden, heads=heads, vocab=get("vocab_size"),
                seq_len=get("block_size", "n_positions", "max_position_embeddings") or 2048,
                ffn_hidden=get("n_inner", "intermediate_size"), kv_heads=get("num_key_value_heads"),
                gated_mlp=llama_like, learned_positions=not llama_like, bias=not llama_like,
                norm="rmsnorm" if llama_like else "layernorm", tied_embeddings=bool(tied),
                fused_attention=fused_attention(cfg))


# Hugging Face attention implementations that keep no (heads x s x s) scores for backward: SDPA (its flash and
# memory-efficient kernels, and on CPU its flash kernel), FlashAttention 2/3, flex attention.
FUSED_ATTENTION = frozenset({"sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"})


def fused_attention(cfg: object) -> bool:
    """Whether the model of ``cfg`` computes attention with a fused kernel (no score matrix kept for backward):
    Hugging Face models whose config's ``_attn_implementation`` is one of :data:`FUSED_ATTENTION`, and
    shardwise's GPT, whose config names "sdpa" the same way. Measured: the H200's GPT-2 small step kept 5.82 GB
    for backward where the score-keeping formula counted 10.28 GB (benchmarks/results/gpu/NOTES.md)."""
    return getattr(cfg, "_attn_implementation", None) in FUSED_ATTENTION


def known_model(name: str) -> ModelSpec:
    """One of :data:`KNOWN_MODELS` by name (or a common alias)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SHAPES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SHAPES)}")
    return ModelSpec.transformer(name=key, **SHAPES[key])  # type: ignore[arg-type]


def short_count(n: float) -> str:
    """7.5e9 -> "7.5B"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


KNOWN_MODELS: dict[str, ModelSpec] = {k: known_model(k) for k in SHAPES}
