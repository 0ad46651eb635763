"""Llama, Mistral and Qwen2 decoded by gpuflow's own forward, over their own weights.

The three share one decoder layer: RMSNorm, rotary attention with grouped key/value heads
(Qwen2's projections with a bias), RMSNorm, a gated SiLU MLP. Decoding a batch of one
token per sequence, a small model spends most of its step in the Python of transformers'
modules (hooks, wrappers, keyword plumbing, mask and cache dispatch), not in arithmetic:
this forward calls the same weights through ``torch.nn.functional`` and transformers' own
rotary embedding (so every rope scaling the model's config names is computed as
transformers computes it), and writes and reads the same ``SlotCache``. Its logits equal
transformers' within fp32 rounding (tests compare greedy generations token for token).
Any other architecture runs through transformers' forward (``HFCausalLM``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from gpuflow.serve.generate.hf_models import HFCausalLM, Keep, SlotCache, kept

FAMILY = ("llama", "mistral", "qwen2")


def is_llama_like(model: PreTrainedModel) -> bool:
    """Whether the model is one of the family with the layout this forward reads."""
    inner = getattr(model, "model", None)
    return (getattr(model.config, "model_type", None) in FAMILY
            and getattr(model.config, "hidden_act", None) == "silu"
            and all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm",
                                                      "rotary_emb")))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of the family: in fp32, then the weight in the input's dtype."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


Dense = tuple[torch.Tensor, torch.Tensor | None]  # a linear layer's weight, transposed, and bias
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
MAX_TABLE = 2**22  # cos (and sin) values kept for the whole context at most: 16 MiB in fp32


def _dense(x: torch.Tensor, layer: Dense) -> torch.Tensor:
    """``F.linear`` of a 2-D ``x`` as one matrix product: ``F.linear`` on ``[B, T, D]``
    costs a transpose, a reshape and a view besides, at every call."""
    weight_t, bias = layer
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters, looked up once rather than through its modules'
    attributes at every step; each linear's weight as a transposed view (no copy)."""

    norm1: tuple[torch.Tensor, float]
    q: Dense
    k: Dense
    v: Dense
    o: Dense
    scale: float
    norm2: tuple[torch.Tensor, float]
    gate: Dense
    up: Dense
    down: Dense

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        def linear(module: nn.Linear) -> Dense:
            return module.weight.t(), module.bias

        attention, mlp = layer.self_attn, layer.mlp
        return cls((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                   linear(attention.q_proj), linear(attention.k_proj),
                   linear(attention.v_proj), linear(attention.o_proj), attention.scaling,
                   (layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon),
                   linear(mlp.gate_proj), linear(mlp.up_proj), linear(mlp.down_proj))


class LlamaDecoder(HFCausalLM):
    """``HFCausalLM`` with the family's forward written out (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, tokenized: bool = False,
                 context: int | None = None) -> None:
        super().__init__(model, dtype, tokenized, context)
        inner: Any = model.model
        self._embed, self._rotary = inner.embed_tokens.weight, inner.rotary_emb
        self._layers = [_Layer.of(layer) for layer in inner.layers]
        self._norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self._head = model.lm_head.weight
        config = model.config
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        with torch.no_grad():
            self._cos_sin = self._cos_sin_table()

    def _forward(self, tokens: torch.Tensor, cache: SlotCache, keep: Keep) -> torch.Tensor:
        step = cache.step
        assert step is not None
        batch, length = tokens.shape
        positions = step.starts[:, None] + torch.arange(length, device=tokens.device)
        gqa = self._heads != self._kv_heads
        try:
            mask = self._mask(positions, step.span)
            x = F.embedding(tokens.view(-1), self._embed)  # [B * T, D] from here on
            cos, sin = self._rotation(x, positions)
            for index, layer in enumerate(self._layers):
                h = _rms_norm(x, *layer.norm1)
                q = self._split(_dense(h, layer.q), batch, self._heads)
                k = self._split(_dense(h, layer.k), batch, self._kv_heads)
                v = self._split(_dense(h, layer.v), batch, self._kv_heads)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                keys, values = cache.layers[index].update(k, v)
                layer_mask = mask if not isinstance(mask, dict) else \
                    mask[self.shape.layer_types[index]]  # type: ignore[index]
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=layer_mask,
                                                   scale=layer.scale, enable_gqa=gqa)
                x = x + _dense(y.transpose(1, 2).reshape(batch * length, -1), layer.o)
                h = _rms_norm(x, *layer.norm2)
                x = x + _dense(F.silu(_dense(h, layer.gate)) * _dense(h, layer.up), layer.down)
        finally:
            cache.step = None
        last = kept(x.view(batch, length, -1), keep)
        logits = F.linear(_rms_norm(last, *self._norm), self._head)
        return logits[..., :self.vocab_size]

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` ``[B, T]``, as transformers' rotary embedding
        computes them: read from its table over the whole context where they depend on the
        position alone (and the table is small), else computed for these positions."""
        if self._cos_sin is None:
            return self._rotary(x[None], positions)
        cos, sin = self._cos_sin
        return cos[positions], sin[positions]

    def _cos_sin_table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (getattr(self._rotary, "rope_type", None) not in STATIC_ROPE
                or self.context * self._head_dim > MAX_TABLE):
            return None
        positions = torch.arange(self.context, device=self._embed.device)[None]
        cos, sin = self._rotary(self._embed[:1][None], positions)
        return cos[0], sin[0]

    def _split(self, projected: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
        """``[B * T, heads * head_dim]`` as ``[B, heads, T, head_dim]``."""
        return projected.view(batch, -1, heads, self._head_dim).transpose(1, 2)
