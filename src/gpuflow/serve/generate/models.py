"""The models the generation engine can drive, behind its ``CachedLM`` interface: gpuflow's
GPT here, Hugging Face causal LMs in ``hf_models`` (imported only for one, as it imports
``transformers``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gpuflow.hf import is_hf_model
from gpuflow.models.gpt import GPT, KVCache

if TYPE_CHECKING:
    from gpuflow.serve.generate.hf_models import HFCausalLM


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


def refusal(model: nn.Module) -> str | None:
    """Why the engine cannot generate with ``model`` (the server's 404 says it), or None
    if it can: gpuflow's GPT over bytes, and Hugging Face causal LMs whose tokens 0..255
    are bytes."""
    if isinstance(model, GPT):
        if model.config.vocab_size == 256:
            return None
        return (f"its vocabulary of {model.config.vocab_size} tokens is not bytes and "
                "gpuflow has no tokenizer for it")
    if is_hf_model(model):
        from gpuflow.serve.generate import hf_models  # imports transformers

        return hf_models.refusal(model)  # type: ignore[arg-type]
    return f"{type(model).__name__} is not a causal language model"


def cached_lm(model: nn.Module, dtype: torch.dtype) -> GPTDecoder | HFCausalLM | None:
    """The engine's view of ``model``, or None for a model it cannot generate with (one
    whose tokens are not bytes, or that is no causal LM; ``refusal`` says why)."""
    if refusal(model) is not None:
        return None
    if isinstance(model, GPT):
        return GPTDecoder(model, dtype)
    from gpuflow.serve.generate.hf_models import HFCausalLM

    return HFCausalLM(model, dtype)  # type: ignore[arg-type]
