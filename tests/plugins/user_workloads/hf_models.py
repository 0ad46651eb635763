"""Hugging Face models as a user brings them: built from small configs, nothing downloaded.

Each factory is all the gpuflow-specific code a user writes: the model, the data, and a
``gpuflow.Workload`` with the default loss, metrics, layers and (for Llama) the model's own
tensor-parallel plan.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import gpuflow
from gpuflow.data.text import ByteWindows, load_split
from gpuflow.workloads import digits

SEQ = 32


class DictInputs(Dataset):
    """Byte windows handed to the model as keyword arguments, as a tokenizer's output is."""

    def __init__(self, windows: ByteWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tokens, target = self.windows[index]
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}, target


def _pydoc_windows() -> tuple[ByteWindows, ByteWindows]:
    split = load_split(None)
    return ByteWindows(split.train, SEQ), ByteWindows(split.val[: 64 * SEQ], SEQ)


def gpt2() -> gpuflow.Workload:
    """GPT-2 on the bytes of the Python docs; token ids passed positionally."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    train, val = _pydoc_windows()
    return gpuflow.Workload(name="hf-gpt2", model=GPT2LMHeadModel(config), train_dataset=train,
                            val_dataset=val, tokens_per_sample=SEQ)


def llama() -> gpuflow.Workload:
    """A Llama (grouped-query attention, rotary positions) fed dicts of input_ids and mask."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, use_cache=False)
    train, val = _pydoc_windows()
    return gpuflow.Workload(name="hf-llama", model=LlamaForCausalLM(config),
                            train_dataset=DictInputs(train), val_dataset=DictInputs(val),
                            tokens_per_sample=SEQ)


def vit() -> gpuflow.Workload:
    """A ViT image classifier on the bundled 8x8 digits."""
    torch.manual_seed(0)
    base = digits.build(width=8, depth=1)
    config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return gpuflow.Workload(name="hf-vit", model=ViTForImageClassification(config),
                            train_dataset=base.train_dataset, val_dataset=base.val_dataset)
