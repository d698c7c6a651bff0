"""A model as a list of layers: the adapters that let a pipeline cut a model into stages.

:func:`pipeline_layers` flattens a model into ``[(name, layer)]`` whose
composition is its forward (tensor in, tensor out): ``nn.Sequential``,
shardwise's MLP and GPT, Hugging Face GPT-2 and Llama (wrapped in the small
adapter modules below), or whatever a model's own ``pipeline_layers()``
returns. Per-model-family knowledge lives here; ``pipeline.py`` partitions
the layers into stages and ``pipeline_run.py`` runs them.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from shardwise.models import GPT, MLP


# ---- a model as a list of layers -------------------------------------------------
# The adapters that place tokens take ``position_ids`` as the whole models do: the
# first T positions by default, a rank's own under context parallelism.
def _positions(x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    pos = torch.arange(x.shape[1], device=x.device) if position_ids is None else position_ids
    return pos.reshape(1, -1) if pos.dim() == 1 else pos


class _GPTEmbed(nn.Module):
    def __init__(self, tok_emb: nn.Module, pos_emb: nn.Module) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(_positions(idx, position_ids))  # type: ignore[no-any-return]


class _Head(nn.Module):
    """Final norm then output projection (shardwise GPT, GPT-2, Llama alike)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class _GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(_positions(ids, position_ids)))  # type: ignore[no-any-return]


def _causal_mask(layer: nn.Module, config: Any, h: torch.Tensor, pos: torch.Tensor) -> Any:
    # The mask helper of the model's own modeling file, called as the model's
    # forward calls it (None for SDPA's is_causal fast path).
    make = sys.modules[type(layer).__module__].create_causal_mask
    return make(config=config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)


class _HFBlock(nn.Module):
    """A Hugging Face decoder layer as a tensor -> tensor layer (causal mask, positions, rotary)."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.config = config

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = _positions(h, position_ids)
        kw: dict[str, Any] = {"attention_mask": _causal_mask(self.layer, self.config, h, pos), "position_ids": pos,
                              "past_key_values": None, "use_cache": False}
        if self.rotary is not None:
            kw["position_embeddings"] = self.rotary(h, position_ids=pos)
        out = self.layer(h, **kw)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model`` as ``[(name, layer)]`` whose composition is ``model``'s forward (tensor in, tensor out)."""
    if hasattr(model, "pipeline_layers"):
        return list(model.pipeline_layers())  # type: ignore[operator]
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, MLP):
        return [(f"net.{n}", m) for n, m in model.net.named_children()]
    if isinstance(model, GPT):
        return ([("embed", _GPTEmbed(model.tok_emb, model.pos_emb))]
                + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
                + [("head", _Head(model.ln_f, model.head))])
    kind = type(model).__name__
    hf: Any = model  # a Hugging Face model, read by the attribute names of its own modeling file
    layers: list[tuple[str, nn.Module]]
    if kind == "GPT2LMHeadModel":
        t = hf.transformer
        layers = [("embed", _GPT2Embed(t.wte, t.wpe, t.drop))]
        return (layers + [(f"h.{i}", _HFBlock(b, hf.config)) for i, b in enumerate(t.h)]
                + [("head", _Head(t.ln_f, hf.lm_head))])
    if kind in ("LlamaForCausalLM", "MixtralForCausalLM"):  # Mixtral: Llama's layout, experts as its MLP
        m = hf.model
        return ([("embed", m.embed_tokens)]
                + [(f"layers.{i}", _HFBlock(b, hf.config, m.rotary_emb)) for i, b in enumerate(m.layers)]
                + [("head", _Head(m.norm, hf.lm_head))])
    raise ValueError(f"cannot split a {kind} into pipeline stages: use nn.Sequential, shardwise's MLP or GPT, "
                     "GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM, or give the model a pipeline_layers() "
                     "method returning [(name, module)] whose composition is its forward")


WHOLE = "(whole model)"


def stage_layers(model: nn.Module, parts: int) -> list[tuple[str, nn.Module]]:
    """The layers to cut into ``parts`` model chunks: :func:`pipeline_layers`, or, when nothing is cut
    (one stage, one chunk: dp x tp without pp), the whole model as its one layer, so that a model whose
    forward is not a sequence (a CNN, anything) composes tensor with data parallelism."""
    return [(WHOLE, model)] if parts == 1 else pipeline_layers(model)
