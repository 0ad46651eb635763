"""The models the generation engine can drive, behind its ``PagedLM`` interface (a pool of
KV blocks, ``paged``): gpuflow's GPT here, Hugging Face causal LMs in ``hf_models``
(imported only for one, as it imports ``transformers``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from gpuflow.byte_vocab import BYTE_VOCAB_SIZE
from gpuflow.hf import is_hf_model
from gpuflow.models.gpt import GPT
from gpuflow.serve.generate.attention import decode_attention, paged_attention
from gpuflow.serve.generate.paged import (
    KVPool,
    StepBatch,
    check_context,
    write_kv,
)

if TYPE_CHECKING:
    from gpuflow.serve.generate.hf_models import HFCausalLM


class GPTDecoder:
    """gpuflow's GPT (``textlm``): byte tokens, its layers' own modules over the pool."""

    adapters = None  # LoRA adapters are served on the Llama family's forward alone

    def __init__(self, model: GPT, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.context = model.config.seq_len
        self.vocab_size = model.config.vocab_size

    def written(self, pool: KVPool) -> list[torch.Tensor]:
        """The tensors ``decode_step`` writes into."""
        return [pool.keys, pool.values]

    def prepack(self) -> None:
        """Nothing to lay out: the GPT's modules multiply their own weights."""

    def new_pool(self, num_blocks: int, block_size: int) -> KVPool:
        config = self.model.config
        device = next(self.model.parameters()).device
        return KVPool(config.layers, num_blocks, config.heads, block_size,
                      config.dim // config.heads, device, self.dtype)

    def bytes_per_block(self, block_size: int) -> int:
        config = self.model.config
        return KVPool.bytes_per_block(config.layers, config.heads, config.dim // config.heads,
                                      block_size, self.dtype)

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        """Logits ``[K, vocab]`` at ``batch.logits_at`` (see ``paged.PagedLM``)."""
        check_context(batch, self.context)
        hidden = self._paged(batch.tokens, batch.positions, batch.slot_mapping, pool,
                             lambda q, layer: paged_attention(q, pool, layer, batch))
        model = self.model
        return model.lm_head(model.ln_f(hidden[batch.logits_at]))

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    pool: KVPool) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one token per row in static shapes (see ``paged``)."""
        hidden = self._paged(tokens, positions, slot_mapping, pool,
                             lambda q, layer: decode_attention(q, pool, layer, positions,
                                                               block_tables))
        return self.model.lm_head(self.model.ln_f(hidden))

    def _paged(self, tokens: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, pool: KVPool,
               attend: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """The last hidden states ``[N, dim]`` of flat ``tokens[N]``, each layer's new keys
        and values written at ``slot_mapping`` before ``attend(q[N, heads, head_dim],
        layer)`` reads them."""
        model = self.model
        x = model.tok_emb(tokens) + model.pos_emb(positions)
        for layer, block in enumerate(model.blocks):
            q, k, v = (t[0].transpose(0, 1) for t in block.attn._heads(block.ln1(x)[None]))
            write_kv(pool, layer, k, v, slot_mapping)
            x = x + block.attn.proj(attend(q, layer).reshape(len(x), -1))
            x = x + block.mlp(block.ln2(x))
        return x


def refusal(model: nn.Module, tokenized: bool = False) -> str | None:
    """Why the engine cannot generate with ``model`` (the server's 404 says it), or None
    if it can: gpuflow's GPT over bytes, and Hugging Face causal LMs, with the tokenizer
    of their directory (``tokenized``) or else with tokens 0..255 as bytes."""
    if isinstance(model, GPT):
        if model.config.vocab_size == BYTE_VOCAB_SIZE:
            return None
        return (f"its vocabulary of {model.config.vocab_size} tokens is not bytes and "
                "its run has no tokenizer")
    if is_hf_model(model):
        from gpuflow.serve.generate import hf_models  # imports transformers

        return hf_models.refusal(model, tokenized)  # type: ignore[arg-type]
    return f"{type(model).__name__} is not a causal language model"


def adapter_refusal(model: nn.Module) -> str | None:
    """Why LoRA adapters cannot be served on ``model``, or None: they are added in the
    Llama family's own forward (``llama.py``)."""
    if is_hf_model(model):
        from gpuflow.serve.generate.llama import is_llama_like  # imports transformers

        if is_llama_like(model):  # type: ignore[arg-type]
            return None
    return (f"LoRA adapters are served on Llama, Mistral and Qwen2 models, and this one is "
            f"{type(model).__name__}")


def paged_lm(model: nn.Module, dtype: torch.dtype, tokenized: bool = False,
              context: int | None = None) -> GPTDecoder | HFCausalLM | None:
    """The engine's view of ``model``, or None for a model it cannot generate with (one
    that is no causal LM, or whose tokens are not bytes and that has no tokenizer;
    ``refusal`` says why). ``context`` caps the sequence length a Hugging Face model's
    cache holds (``--max-model-len``)."""
    if refusal(model, tokenized) is not None:
        return None
    if isinstance(model, GPT):
        return GPTDecoder(model, dtype)
    from gpuflow.serve.generate.hf_models import HFCausalLM
    from gpuflow.serve.generate.llama import LlamaDecoder, is_llama_like

    kind = LlamaDecoder if is_llama_like(model) else HFCausalLM  # type: ignore[arg-type]
    return kind(model, dtype, tokenized, context)  # type: ignore[arg-type]
