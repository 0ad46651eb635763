"""The models the generation engine can drive, behind its ``CachedLM`` interface."""

from __future__ import annotations

import torch
from torch import nn

from gpuflow.models.gpt import GPT, KVCache


class GPTDecoder:
    """gpuflow's GPT (``textlm``): byte tokens, its own ``KVCache`` and ``decode``."""

    def __init__(self, model: GPT, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.context = model.config.seq_len
        self.vocab_size = model.config.vocab_size

    def new_cache(self, slots: int) -> KVCache:
        device = next(self.model.parameters()).device
        return KVCache(self.model.config, slots, device, self.dtype)

    def bytes_per_slot(self) -> int:
        return KVCache.bytes_per_slot(self.model.config, self.dtype)

    def logits(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor,
               starts: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens, cache, slots, starts)

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def cached_lm(model: nn.Module, dtype: torch.dtype) -> GPTDecoder | None:
    """The engine's view of ``model``, or None for a model it cannot generate with (one
    whose tokens are not bytes)."""
    if isinstance(model, GPT) and model.config.vocab_size == 256:
        return GPTDecoder(model, dtype)
    return None
