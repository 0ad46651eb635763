"""Llama, Mistral and Qwen2 decoded by gpuflow's own forward, over their own weights.

The three share one decoder layer: RMSNorm, rotary attention with grouped key/value heads
(Qwen2's projections with a bias), RMSNorm, a gated SiLU MLP. Decoding a batch of one
token per sequence, a small model spends most of its step in the Python of transformers'
modules (hooks, wrappers, keyword plumbing, mask and cache dispatch), not in arithmetic:
this forward calls the same weights through ``torch.nn.functional`` and transformers' own
rotary embedding (so every rope scaling the model's config names is computed as
transformers computes it), and writes and reads the engine's paged ``KVPool`` on flat
tokens, each layer's sliding window honoured. Each layer's query, key and value
projections run as one matrix product, as do its gate and up projections (``fused.py``),
and its queries and keys rotate as one tensor: fewer operators a step, each a kernel
launch on a GPU. Its logits equal transformers' within fp32 rounding (tests compare greedy
generations token for token).
LoRA adapters (``attach_adapters``) add their products to each layer's projections, every
token its own adapter's, or none (``lora_slots.py``).
Any other architecture runs through transformers' forward (``HFCausalLM``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import PreTrainedModel

from gpuflow.serve.generate.adapter_files import BaseLayout
from gpuflow.serve.generate.attention import decode_attention, paged_attention
from gpuflow.serve.generate.fused import fuse, input_major_for, prepacked
from gpuflow.serve.generate.hf_models import HFCausalLM
from gpuflow.serve.generate.lora_slots import LoraSlots, LoraStep
from gpuflow.serve.generate.paged import (
    KVPool,
    StepBatch,
    check_context,
    slot_index,
    write_kv,
)

FAMILY = ("llama", "mistral", "qwen2")


def is_llama_like(model: PreTrainedModel) -> bool:
    """Whether the model is one of the family with the layout this forward reads."""
    inner = getattr(model, "model", None)
    return (getattr(model.config, "model_type", None) in FAMILY
            and getattr(model.config, "hidden_act", None) == "silu"
            and all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm",
                                                      "rotary_emb")))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of the family: in fp32, then the weight in the input's dtype.
    An fp32 input goes through torch's own RMSNorm, one operator for six (the same values
    on the CPU, bit for bit; tests compare with transformers)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of ``x[N, heads, head_dim]`` (``cos``, ``sin``:
    ``[N, 1, head_dim]``), as ``apply_rotary_pos_emb`` computes it, for the queries and
    keys of a layer at once."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# Attention of one layer: rotated q, k and v [N, heads, head_dim], the layer, its scale.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
MAX_TABLE = 2**22  # cos (and sin) values kept for the whole context at most: 16 MiB in fp32


@dataclass
class Product:
    """A linear layer as the forward multiplies it: its weight transposed (a view of the
    module's) and bias, and once ``LlamaDecoder.prepack`` ran where it pays, the weight
    prepacked for oneDNN (``fused.prepacked``), which products of more than one row take."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = prepacked(self.weight_t.t())


# A linear layer: its ``Product``, or the layer itself when its weight is a tensor subclass
# (a torchao quantized one, ``--quantize``), whose own ``F.linear`` multiplies.
Dense = Product | nn.Linear


def _dense(x: torch.Tensor, layer: Dense) -> torch.Tensor:
    """``F.linear`` of a 2-D ``x`` as one matrix product: ``F.linear`` on ``[B, T, D]``
    costs a transpose, a reshape and a view besides, at every call."""
    if isinstance(layer, nn.Linear):
        return layer(x)
    if layer.packed is not None and x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    if layer.bias is None:
        return torch.mm(x, layer.weight_t)
    return torch.addmm(layer.bias, x, layer.weight_t)


def _project(x: torch.Tensor, layers: tuple[Dense, ...]) -> torch.Tensor:
    """The outputs of linear layers that read ``x``, side by side: one product when they
    are fused."""
    if len(layers) == 1:
        return _dense(x, layers[0])
    return torch.cat([_dense(x, layer) for layer in layers], dim=-1)


def _linears(modules: list[nn.Linear], input_major: bool) -> tuple[Dense, ...]:
    """The modules as one fused ``Dense`` (``fused.fuse``, its weight input-major where
    asked), or each its own where they cannot be fused (a quantized weight multiplies
    through its own module)."""
    fused = fuse(modules, input_major)
    if fused is not None:
        weight, bias = fused
        return (Product(weight.t(), bias),)
    return tuple(module if is_traceable_wrapper_subclass(module.weight)
                 else Product(module.weight.t(), module.bias) for module in modules)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters, looked up once rather than through its modules'
    attributes at every step; each linear's weight as a transposed view (no copy)."""

    norm1: tuple[torch.Tensor, float]
    qkv: tuple[Dense, ...]
    o: Dense
    scale: float
    norm2: tuple[torch.Tensor, float]
    gate_up: tuple[Dense, ...]
    down: Dense

    @classmethod
    def of(cls, layer: nn.Module, input_major: bool) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        [o] = _linears([attention.o_proj], input_major)
        [down] = _linears([mlp.down_proj], input_major)
        return cls((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                   _linears([attention.q_proj, attention.k_proj, attention.v_proj],
                            input_major),
                   o, attention.scaling,
                   (layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon),
                   _linears([mlp.gate_proj, mlp.up_proj], input_major), down)

    def products(self) -> list[Product]:
        return [d for d in (*self.qkv, self.o, *self.gate_up, self.down)
                if isinstance(d, Product)]


class LlamaDecoder(HFCausalLM):
    """``HFCausalLM`` with the family's forward written out (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, tokenized: bool = False,
                 context: int | None = None) -> None:
        super().__init__(model, dtype, tokenized, context)
        inner: Any = model.model
        input_major = input_major_for(inner.embed_tokens.weight)
        self._layers = [_Layer.of(layer, input_major) for layer in inner.layers]
        tied = model.lm_head.weight is inner.embed_tokens.weight
        [self._head] = _linears([model.lm_head], input_major)
        if tied:  # the embedding reads the head's weight, in its layout (a row gather)
            inner.embed_tokens.weight = model.lm_head.weight
        self._embed, self._rotary = inner.embed_tokens.weight, inner.rotary_emb
        self._norm = (inner.norm.weight, inner.norm.variance_epsilon)
        config = model.config
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self._intermediate = config.intermediate_size
        with torch.no_grad():
            self._cos_sin = self._cos_sin_table()

    def attach_adapters(self, slots: int, rank: int) -> LoraSlots:
        """Slots for ``slots`` LoRA adapters of rank up to ``rank``, beside the weights."""
        self.adapters = LoraSlots(BaseLayout.of(self.model), slots, rank, self._embed.dtype,
                                  self._embed.device)
        return self.adapters

    def prepack(self) -> None:
        """Every product's weight prepacked where that pays (``fused.prepacked``)."""
        for product in [p for layer in self._layers for p in layer.products()] + (
                [self._head] if isinstance(self._head, Product) else []):
            product.prepack()

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        """Logits ``[K, V]`` at ``batch.logits_at`` (see ``paged.PagedLM``)."""
        check_context(batch, self.context)

        at = slot_index(batch.slot_mapping, pool.block_size)  # once a step, not a layer

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int,
                   scale: float) -> torch.Tensor:
            write_kv(pool, index, k, v, batch.slot_mapping, at)
            return paged_attention(q, pool, index, batch, scale, self.shape.windows[index])

        lora = None
        if self.adapters is not None and batch.lora:
            lora = self.adapters.segmented(batch.lora)
        x = self._layers_over(batch.tokens, batch.positions, attend, lora)
        return self._head_over(x[batch.logits_at])

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    pool: KVPool, adapters: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` of one token per row in static shapes (see ``paged``);
        ``adapters[B]``: each row's adapter slot, with adapters attached."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int,
                   scale: float) -> torch.Tensor:
            write_kv(pool, index, k, v, slot_mapping)
            return decode_attention(q, pool, index, positions, block_tables, scale,
                                    self.shape.windows[index])

        lora = None
        if self.adapters is not None and adapters is not None:
            lora = self.adapters.masked(adapters)
        return self._head_over(self._layers_over(tokens, positions, attend, lora))

    def _layers_over(self, tokens: torch.Tensor, positions: torch.Tensor,
                     attend: Attend, lora: LoraStep | None = None) -> torch.Tensor:
        """The decoder layers over flat ``tokens[N]`` at ``positions[N]``: the last hidden
        states ``[N, D]``; ``attend(q, k, v, layer, scale)`` takes each layer's rotated
        queries and keys and its values ``[N, heads, head_dim]``, keeps the keys and
        values, and returns the attention ``[N, heads, head_dim]``; ``lora``: the step's
        adapters, added to each projection group's product."""
        heads, kv_heads, inner = self._heads, self._kv_heads, self._intermediate
        x = F.embedding(tokens, self._embed)
        cos, sin = (t[0][:, None] for t in self._rotation(x, positions[None]))  # [N, 1, d]
        for index, layer in enumerate(self._layers):
            h = _rms_norm(x, *layer.norm1)
            qkv = _project(h, layer.qkv)
            if lora is not None:
                qkv = lora.add(qkv, h, index, 0)
            qkv = qkv.view(-1, heads + 2 * kv_heads, self._head_dim)
            qk = _rotated(qkv[:, :heads + kv_heads], cos, sin)
            attended = attend(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], index,
                              layer.scale).flatten(1)
            out = _dense(attended, layer.o)
            x = x + (out if lora is None else lora.add(out, attended, index, 1))
            h = _rms_norm(x, *layer.norm2)
            gate_up = _project(h, layer.gate_up)
            if lora is not None:
                gate_up = lora.add(gate_up, h, index, 2)
            inner_h = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
            down = _dense(inner_h, layer.down)
            x = x + (down if lora is None else lora.add(down, inner_h, index, 3))
        return x

    def _head_over(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _dense(_rms_norm(hidden, *self._norm), self._head)
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
