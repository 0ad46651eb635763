"""The untrained models ``kv_paging.py`` serves, each with prompts of a wanted token count.

- ``textlm``: gpuflow's GPT, ``layers=4,dim=256,heads=8,seq=4096``, a byte a token.
- ``hub-llama``: a Llama-architecture Hugging Face directory with a 4,096-token context
  (4 layers, width 256, 8 query and 2 key/value heads: grouped-query attention) under the
  test suite's 4,096-id byte-level BPE tokenizer and chat template (``hub_models``).

Both heads are limited to tokens that decode to text on their own (``text_only_head``):
greedy decoding then streams every token as text at once. Random weights otherwise pick
tokens that are special, or bytes that are no UTF-8 alone, for stretches of tokens, which
the server holds back until they decode, and the clients, timing text chunks, would count
those stretches as stalls of the scheduler. The cost of a step does not depend on weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the Hub-style tokenizers

TEXT = ("The Python interpreter reads a program text, splits it into tokens and builds a "
        "tree of the statements it finds; then it compiles the tree to bytecode. ")
TEXTLM_SIZE = "layers=4,dim=256,heads=8,seq=4096"
LLAMA = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096}


def text_of(length: int, offset: int = 0) -> str:
    """``length`` ASCII characters of prose, from character ``offset`` of it on."""
    repeated = TEXT * (2 + (length + offset) // len(TEXT))
    return repeated[offset:offset + length]


@dataclass(frozen=True)
class ServedModel:
    """A model folder ``gpuflow serve`` takes, what it is, and its prompts."""

    path: Path
    about: str
    chars_per_token: float
    kv_bytes_per_token: int  # fp32 keys and values of all layers
    context: int

    def prompt(self, tokens: int, offset: int = 0) -> str:
        """Prose of about ``tokens`` tokens under the model's tokenizer."""
        return text_of(round(tokens * self.chars_per_token), offset)


def text_only_head(weight: torch.Tensor, decodes: Callable[[int], str]) -> None:
    """Zero the head rows (``weight[V, dim]``) of tokens that do not decode to text alone:
    their logits are then 0, below the largest of the other rows' random ones."""
    with torch.no_grad():
        for token in range(weight.shape[0]):
            text = decodes(token)
            if not text or "\ufffd" in text or not text.isascii():
                weight[token] = 0.0


def textlm(folder: Path) -> ServedModel:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from serving import untrained_export

    from gpuflow.workloads.textlm import parse_model_size

    path, _ = untrained_export(folder, "textlm", TEXTLM_SIZE)
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    for name in ("tok_emb.weight", "lm_head.weight"):  # tied: both names are saved
        text_only_head(tensors[name], lambda token: bytes([token]).decode("utf-8", "replace"))
    save_file(tensors, str(path), metadata=metadata)
    config = parse_model_size(TEXTLM_SIZE)
    return ServedModel(path, f"textlm {TEXTLM_SIZE}, untrained, text-only head", 1.0,
                       2 * config.layers * config.dim * 4, config.seq_len)


def hub_llama(folder: Path) -> ServedModel:
    from hub_models import save_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    path = folder / "llama-4k"
    save_tokenizer("llama3", path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **LLAMA)
    model = AutoModelForCausalLM.from_config(config)
    text_only_head(model.lm_head.weight, lambda token: tokenizer.decode([token]))
    model.save_pretrained(path)
    sample = TEXT * 40
    ratio = len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    kv = 2 * LLAMA["num_hidden_layers"] * LLAMA["num_key_value_heads"] * head_dim * 4
    return ServedModel(path, "Llama 4x256, 8 query / 2 key-value heads, 4,096 context, "
                       "4,096-id byte-level BPE, untrained, text-only head", ratio, kv,
                       LLAMA["max_position_embeddings"])


MODELS: dict[str, Callable[[Path], ServedModel]] = {"textlm": textlm, "hub-llama": hub_llama}
