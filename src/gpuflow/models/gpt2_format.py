"""gpuflow's GPT in Hugging Face's GPT-2 format, with a byte-level tokenizer.

The architectures are the same (pre-norm blocks, learned positions, tanh GELU, a head tied
to the embedding); two layouts differ. GPT-2's ``Conv1D`` stores ``[in, out]`` where
``nn.Linear`` stores ``[out, in]``, and GPT-2's fused attention projection lays its outputs
out as ``(q | k | v)``, each ``heads x head_dim``, where gpuflow's lays them out head by
head, ``(heads, 3, head_dim)``, so that tensor parallelism can split whole heads.

Token ``i`` is byte ``i``; the tokenizer maps text to its UTF-8 bytes and back, so
``AutoTokenizer`` and any tool reading the format feed the model what it was trained on.
Byte 0xFF, which UTF-8 never uses, is the end-of-document token (``gpuflow.byte_vocab``):
the tokenizer names it ``<|endoftext|>`` and makes it the end-of-sequence,
beginning-of-sequence and padding token, and the config and generation config say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow.byte_vocab import BYTE_VOCAB_SIZE, END_OF_DOCUMENT, END_OF_DOCUMENT_TEXT
from gpuflow.models.gpt import GPT, GPTConfig


def gpt2_config(config: GPTConfig) -> Any:
    """The ``transformers.GPT2Config`` of the same shape; a byte-level model's names its
    end-of-document token as the end, beginning and padding of sequences."""
    from transformers import GPT2Config

    special = END_OF_DOCUMENT if config.vocab_size == BYTE_VOCAB_SIZE else None
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.dim,
        n_layer=config.layers, n_head=config.heads, activation_function="gelu_new",
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=special,
        eos_token_id=special, pad_token_id=special)


def _qkv_to_gpt2(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (heads, 3, head_dim) -> (3, heads, head_dim)."""
    rows = tensor.shape[0]
    grouped = tensor.reshape(heads, 3, rows // (3 * heads), *tensor.shape[1:])
    return grouped.transpose(0, 1).reshape(tensor.shape)


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under GPT-2's names and layouts."""
    heads = model.config.heads
    source = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    state = {
        "transformer.wte.weight": source["tok_emb.weight"],
        "transformer.wpe.weight": source["pos_emb.weight"],
        "transformer.ln_f.weight": source["ln_f.weight"],
        "transformer.ln_f.bias": source["ln_f.bias"],
        "lm_head.weight": source["tok_emb.weight"],
    }
    for i in range(model.config.layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            state[f"{theirs}{b}.weight"] = source[f"{ours}{a}.weight"]
            state[f"{theirs}{b}.bias"] = source[f"{ours}{a}.bias"]
        state[f"{theirs}attn.c_attn.weight"] = _qkv_to_gpt2(
            source[f"{ours}attn.qkv.weight"], heads).t()
        state[f"{theirs}attn.c_attn.bias"] = _qkv_to_gpt2(source[f"{ours}attn.qkv.bias"], heads)
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                     ("mlp.proj", "mlp.c_proj")):
            state[f"{theirs}{b}.weight"] = source[f"{ours}{a}.weight"].t()
            state[f"{theirs}{b}.bias"] = source[f"{ours}{a}.bias"]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def byte_tokenizer(model_max_length: int | None = None) -> Any:
    """A fast tokenizer whose token ids are the text's UTF-8 bytes, byte 0xFF its special
    ``<|endoftext|>``; ``model_max_length``: the model's context, which tools reading the
    format cut prompts to (unset, transformers writes 10^30)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()  # GPT-2's printable stand-in for each byte
    vocab = {symbols[b]: b for b in range(BYTE_VOCAB_SIZE) if b != END_OF_DOCUMENT}
    vocab[END_OF_DOCUMENT_TEXT] = END_OF_DOCUMENT
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_DOCUMENT_TEXT,
        eos_token=END_OF_DOCUMENT_TEXT, pad_token=END_OF_DOCUMENT_TEXT,
        **({} if model_max_length is None else {"model_max_length": model_max_length}))


def save_as_gpt2(model: nn.Module, directory: Path) -> None:
    """Write ``model`` as a ``GPT2LMHeadModel`` with its byte tokenizer into ``directory``."""
    from transformers import GPT2LMHeadModel

    if not isinstance(model, GPT):
        raise TypeError(f"save_as_gpt2 takes gpuflow's GPT, not {type(model).__name__}")
    gpt2 = GPT2LMHeadModel(gpt2_config(model.config))
    gpt2.load_state_dict(gpt2_state_dict(model), strict=True)
    gpt2.save_pretrained(directory)
    if model.config.vocab_size == BYTE_VOCAB_SIZE:
        byte_tokenizer(model.config.seq_len).save_pretrained(directory)
