"""Hugging Face causal LMs in the generation engine, through transformers' own cache API.

The engine's paged KV pool is read and written through ``hf_paged.PagedCache``, a
``transformers.Cache`` whose layers' ``cache.update(...)`` write each new token's keys and
values at its pool slot and return each row's blocks gathered in order. With per-row
``position_ids`` and a 4-D attention mask (row ``b``'s token ``t`` sees its own positions
up to its own), one forward (``forward`` over a ``StepBatch``, or the static-shape
``decode_step``) runs every sequence of a step at its own position.

Sliding-window layers (Mistral's, Qwen2's upper layers) keep every position too; their
mask shows each token only the last ``sliding_window`` positions, as transformers' own
sliding-window mask does, and a model whose layers differ gets one mask per layer type.

Tokens are the model's own, from its directory's tokenizer; a model gpuflow trained on
bytes without one has ids 0..255 as the bytes (a larger vocabulary's other ids are never
chosen).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from gpuflow.byte_vocab import BYTE_VOCAB_SIZE
from gpuflow.serve.generate.hf_paged import PagedCache, PagedRows
from gpuflow.serve.generate.lora_slots import LoraSlots
from gpuflow.serve.generate.paged import KVPool, StepBatch, check_context

ATTENTION = ("sdpa", "eager")  # the implementations that take a 4-D custom mask


@dataclass(frozen=True)
class CacheShape:
    """What a sequence's cache holds: layers, key/value heads and dims, and the context; each
    layer's sliding window (None: it sees the whole prefix) and, for a model whose masks
    are keyed by layer type, the types (``config.layer_types``)."""

    layers: int
    heads: int
    key_dim: int
    value_dim: int
    context: int
    windows: tuple[int | None, ...]
    layer_types: tuple[str, ...] | None = None


_shapes: weakref.WeakKeyDictionary[nn.Module, CacheShape | str] = weakref.WeakKeyDictionary()
_LAYERS = {DynamicLayer: False, DynamicSlidingWindowLayer: True}  # layer kind -> sliding


def _parameters(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _probe(model: PreTrainedModel, context: int) -> CacheShape | str:
    """The cache a one-token forward fills in transformers' own ``DynamicCache``: its
    layers, heads, dims and windows; or why it is not one attention cache per layer."""
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  **{_cache_argument(model): cache, "use_cache": True})
    except Exception as exc:  # a model whose forward takes no cache, or no bare input ids
        return f"its forward with a cache failed ({type(exc).__name__}: {exc})"
    kinds = {type(layer) for layer in cache.layers}
    if not cache.layers or not kinds <= set(_LAYERS):
        names = ", ".join(sorted(kind.__name__ for kind in kinds - set(_LAYERS))) or "no"
        return (f"its cache has {names} layers (linear, chunked or shared attention), which "
                "the engine does not hold")
    shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1])
              for layer in cache.layers}
    if len(shapes) != 1:
        return "its layers cache keys and values of different shapes"
    (heads, key_dim, value_dim), = shapes
    windows = tuple(int(layer.sliding_window) if _LAYERS[type(layer)] else None
                    for layer in cache.layers)
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    if len(set(windows)) > 1 and (not layer_types or len(layer_types) != len(windows)):
        return "its layers have different sliding windows and its config names no layer_types"
    return CacheShape(len(cache.layers), heads, key_dim, value_dim, context, windows,
                      tuple(layer_types) if len(set(windows)) > 1 else None)


def _cache_argument(model: nn.Module) -> str:
    """``cache`` in transformers 5, ``past_key_values`` before."""
    return "cache" if "cache" in _parameters(model) else "past_key_values"


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's config allows."""
    text = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def refusal(model: PreTrainedModel, tokenized: bool = False) -> str | None:
    """Why the engine cannot generate with this Hugging Face model, or None if it can;
    without a tokenizer (``tokenized``) its ids 0..255 must be the bytes."""
    config = model.config
    text = config.get_text_config(decoder=True)
    if not model.can_generate() or getattr(config, "is_encoder_decoder", False) \
            or getattr(text, "add_cross_attention", False):
        return f"{type(model).__name__} is not a decoder-only causal language model"
    vocab = getattr(text, "vocab_size", None)
    if not tokenized and (not isinstance(vocab, int) or vocab < BYTE_VOCAB_SIZE):
        return (f"its vocabulary of {vocab} tokens is not bytes (ids 0..255) and it comes "
                "with no tokenizer")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTION:
        return (f"it runs {attention!r} attention, which takes no per-sequence mask; build "
                "it with attn_implementation='sdpa'")
    context = context_length(model)
    if context is None:
        return "its config gives no context length (max_position_embeddings)"
    if model not in _shapes:
        _shapes[model] = _probe(model, context)
    found = _shapes[model]
    return found if isinstance(found, str) else None


class HFCausalLM:
    """A ``transformers`` causal LM (Llama, Qwen2, Mistral, GPT-2 and their kind) over a
    ``KVPool``: per-row positions and per-row 4-D masks."""

    adapters: LoraSlots | None = None  # LoRA adapters' slots (``LlamaDecoder`` alone)

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, tokenized: bool = False,
                 context: int | None = None) -> None:
        why = refusal(model, tokenized)
        if why is not None:
            raise ValueError(f"{type(model).__name__} cannot generate here: {why}")
        shape = _shapes[model]
        assert isinstance(shape, CacheShape)
        if context is not None:
            shape = dataclasses.replace(shape, context=min(context, shape.context))
        self.model, self.dtype, self.shape = model, dtype, shape
        self.context = shape.context
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size if tokenized \
            else BYTE_VOCAB_SIZE
        self._windows = sorted(set(shape.windows), key=lambda w: -1 if w is None else w)
        parameters = _parameters(model)
        self._cache_argument = _cache_argument(model)
        self._keep_last = "logits_to_keep" in parameters
        self._eager = model.config._attn_implementation == "eager"
        self._mask_dtype = next(model.parameters()).dtype

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, span: int, cache: Cache,
                columns: torch.Tensor | int | None) -> torch.Tensor:
        """The model's logits ``[B, T or columns, V]`` of ``tokens[B, T]`` at ``positions``,
        row ``b`` seeing the first ``span`` entries its cache layers return, up to its own
        position; only at ``columns`` (transformers' ``logits_to_keep``) where given."""
        extra: dict[str, Any] = {self._cache_argument: cache, "use_cache": True}
        if columns is not None:
            extra["logits_to_keep"] = columns
        out = self.model(input_ids=tokens, attention_mask=self._mask(positions, span),
                         position_ids=positions, **extra)
        return out.logits

    def new_pool(self, num_blocks: int, block_size: int) -> KVPool:
        shape, device = self.shape, next(self.model.parameters()).device
        return KVPool(shape.layers, num_blocks, shape.heads, block_size, shape.key_dim, device,
                      self.dtype, shape.value_dim)

    def bytes_per_block(self, block_size: int) -> int:
        shape = self.shape
        return KVPool.bytes_per_block(shape.layers, shape.heads, shape.key_dim, block_size,
                                      self.dtype, shape.value_dim)

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        """Logits ``[K, V]`` at ``batch.logits_at`` (see ``paged.PagedLM``), through the
        model's own forward: decode rows, then prefill chunks, each right-padded to
        ``[B, T]`` (``PagedRows.parts``)."""
        check_context(batch, self.context)
        logits = [self._rows_logits(batch, rows, pool) for rows in PagedRows.parts(batch)]
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _rows_logits(self, batch: StepBatch, rows: PagedRows, pool: KVPool) -> torch.Tensor:
        """The logits ``batch.logits_at`` asks of ``rows``' tokens, in its order."""
        first, end = rows.tokens.start, rows.tokens.stop
        at = batch.logits_at
        at = at[(at >= first) & (at < end)] - first
        if rows.padded_at is not None:
            at = rows.padded_at[at]
        columns = None
        if self._keep_last:  # the head over the columns some row wants, not over all
            columns = torch.unique(at % rows.length)
            at = at // rows.length * len(columns) + torch.searchsorted(columns, at % rows.length)
        cache = PagedCache(pool, rows)
        logits = self._logits(rows.padded(batch.tokens), rows.padded(batch.positions),
                              cache.span, cache, columns)
        return logits.flatten(0, 1)[at][..., :self.vocab_size]

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    pool: KVPool) -> torch.Tensor:
        """Logits ``[B, V]`` of one token per row in static shapes: every row attends over
        all of ``block_tables[B, M]`` under its mask."""
        cache = PagedCache(pool, PagedRows(slot_mapping, None, block_tables, 1,
                                             slice(None)))
        logits = self._logits(tokens[:, None], positions[:, None], cache.span, cache,
                              1 if self._keep_last else None)
        return logits[:, -1, :self.vocab_size]

    def _mask(self, positions: torch.Tensor, span: int) -> torch.Tensor | dict[str, Any]:
        """Row ``b``'s token ``t`` sees its own sequence's positions up to its own (within the
        layer's window): ``[B, 1, T, span]``, one per layer type when windows differ."""
        keys = torch.arange(span, device=positions.device)[None, None, :]
        at = positions[:, :, None]
        masks = {window: self._as_mask(((keys <= at) if window is None else
                                        ((keys <= at) & (keys > at - window)))[:, None])
                 for window in self._windows}
        if self.shape.layer_types is None:
            return masks[self.shape.windows[0]]
        return {kind: masks[window]
                for kind, window in zip(self.shape.layer_types, self.shape.windows,
                                        strict=True)}

    def _as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """SDPA takes the boolean mask; eager attention adds its mask to the scores."""
        if not self._eager:
            return visible
        mask = torch.zeros(visible.shape, dtype=self._mask_dtype, device=visible.device)
        return mask.masked_fill_(~visible, torch.finfo(self._mask_dtype).min)

    def written(self, pool: KVPool) -> list[torch.Tensor]:
        """The tensors ``decode_step`` writes into."""
        return [pool.keys, pool.values]

    def prepack(self) -> None:
        """Nothing to lay out: transformers' modules multiply their own weights."""
