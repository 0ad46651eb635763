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


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' RMSNorm of the family: in fp32, then the weight in the input's dtype."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return norm.weight * (x.float() * torch.rsqrt(variance + norm.variance_epsilon)).to(x.dtype)


class LlamaDecoder(HFCausalLM):
    """``HFCausalLM`` with the family's forward written out (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, tokenized: bool = False,
                 context: int | None = None) -> None:
        super().__init__(model, dtype, tokenized, context)
        inner: Any = model.model
        self._embed, self._layers, self._norm = inner.embed_tokens, inner.layers, inner.norm
        self._rotary, self._head = inner.rotary_emb, model.lm_head
        config = model.config
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)

    def _forward(self, tokens: torch.Tensor, cache: SlotCache, keep: Keep) -> torch.Tensor:
        step = cache.step
        assert step is not None
        batch, length = tokens.shape
        positions = step.starts[:, None] + torch.arange(length, device=tokens.device)
        try:
            mask = self._mask(positions, step.span)
            x = self._embed(tokens)
            cos, sin = self._rotary(x, positions)
            for index, layer in enumerate(self._layers):
                attention = layer.self_attn
                h = _rms_norm(x, layer.input_layernorm)
                q = self._split(attention.q_proj, h, self._heads)
                k = self._split(attention.k_proj, h, self._kv_heads)
                v = self._split(attention.v_proj, h, self._kv_heads)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                keys, values = cache.layers[index].update(k, v)
                layer_mask = mask if not isinstance(mask, dict) else \
                    mask[self.shape.layer_types[index]]  # type: ignore[index]
                y = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=layer_mask, scale=attention.scaling,
                    enable_gqa=self._heads != self._kv_heads)
                out = attention.o_proj
                x = x + F.linear(y.transpose(1, 2).reshape(batch, length, -1), out.weight,
                                 out.bias)
                h = _rms_norm(x, layer.post_attention_layernorm)
                mlp = layer.mlp
                x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        finally:
            cache.step = None
        return self._head(_rms_norm(kept(x, keep), self._norm))[..., :self.vocab_size]

    def _split(self, projection: nn.Linear, h: torch.Tensor, heads: int) -> torch.Tensor:
        """``projection(h)`` as ``[B, heads, T, head_dim]``."""
        batch, length, _ = h.shape
        out = F.linear(h, projection.weight, projection.bias)
        return out.view(batch, length, heads, self._head_dim).transpose(1, 2)
