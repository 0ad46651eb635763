"""``hf:DIR``: fine-tune a Hugging Face causal-LM directory, with no Python of the user's.

The model is ``AutoModelForCausalLM`` from the directory's safetensors (sharded ones
too; ``from_config``: random weights of its ``config.json``), the data text under the
directory's tokenizer: a set packed with ``gpuflow data pack --tokenizer DIR``, or text
files tokenized in memory; or conversations, several to a window with attention kept inside
each (``gpuflow.workloads.chat_windows``), packed with ``gpuflow data pack`` or in memory.
Everything else comes from the model itself (``gpuflow.hf``):
FSDP and activation checkpointing wrap its decoder layers, tensor parallelism follows its
own plan, and FLOPs (hence MFU) are counted on its own shapes. The export is a model
directory again, with the source's tokenizer, chat template and generation config.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch
from torch import nn

from gpuflow import hf, lora
from gpuflow.errors import UserError
from gpuflow.model_dir import GENERATION_FILE, ModelDirectory, load_hf_tokenizer, saved_dtype
from gpuflow.precision import autocast_dtype
from gpuflow.workload import Workload
from gpuflow.workloads.chat_windows import collate_windows
from gpuflow.workloads.chats import chat_datasets, chat_files
from gpuflow.workloads.chats_pack import is_chat_set, open_chat_set
from gpuflow.workloads.text_tokens import first_windows, token_datasets

DEFAULT_SEQ_LEN = 1024
EXAMPLE_ITEMS = 4
# What a Hub directory holds besides the model: the tokenizer in its several formats, its
# chat template, and the generation defaults.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", GENERATION_FILE)


def load_causal_lm(directory: ModelDirectory, from_config: bool,
                   frozen_precision: str | None = None) -> nn.Module:
    """The directory's model in training mode, with SDPA attention and without a KV cache
    (training never reuses one): in fp32, or, as a LoRA run's frozen base computed under
    ``frozen_precision``, in the dtype it will be held in (``lora.held_dtype``), so that
    no fp32 copy of the base is ever made. On the meta device (the planner's) it is built
    from its config: no weights are read there."""
    autocast = autocast_dtype(frozen_precision) if frozen_precision else None
    dtype = lora.held_dtype(saved_dtype(directory.config), autocast)
    if from_config or torch.get_default_device().type == "meta":
        import transformers

        config = transformers.AutoConfig.from_pretrained(
            directory.path, local_files_only=True, trust_remote_code=False)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=dtype)
    else:
        model = directory.load_model(dtype)
    model.config.use_cache = False
    return model.train()


def save_directory(source: Path, model: nn.Module, out: Path) -> None:
    """The trained model as a Hub directory: its own config and safetensors, and the
    source directory's tokenizer, chat template and generation config."""
    model.config.use_cache = True  # type: ignore[union-attr]
    hf.save_pretrained(model, out)
    copy_companions(source, out)


def copy_companions(source: Path, out: Path) -> None:
    """The tokenizer, chat template and generation config of ``source``, into ``out``."""
    for name in COMPANION_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


def window_length(directory: ModelDirectory, seq_len: int | None) -> int:
    """``seq_len``, checked against the model's context; by default that context, at most
    ``DEFAULT_SEQ_LEN``."""
    try:
        context: int | None = directory.context_length()
    except UserError:  # a config that states no context
        context = None
    if seq_len is None:
        return min(context or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
    if seq_len < 1 or (context is not None and seq_len > context):
        raise UserError(f"--seq-len {seq_len} is not between 1 and the context of {context} "
                        f"tokens the model was built for ({directory.path / 'config.json'}).")
    return seq_len


def build(directory: str, data_dir: str | None = None, data: str = "real",
          from_config: bool = False, seq_len: int | None = None,
          truncate_chats: bool = False, frozen_precision: str | None = None) -> Workload:
    """The ``hf:DIR`` workload: the model in ``directory`` trained on ``data_dir`` (a set
    packed under its tokenizer, text files, or JSONL conversations; None: the Python help
    topics) in windows of ``seq_len`` tokens (default: its context, at most 1024).
    ``truncate_chats``: cut conversations longer than a window instead of refusing them.
    ``frozen_precision``: the run's precision where it trains adapters on a frozen base."""
    path = Path(directory).expanduser().resolve()
    model_dir = ModelDirectory.check(path, weights=not from_config)
    tokenizer = load_hf_tokenizer(path)
    rows = (model_dir.config.get("text_config") or model_dir.config).get("vocab_size")
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise UserError(f"The tokenizer in {path} has {len(tokenizer)} ids, more than the "
                        f"{rows} rows of the model's embedding (config.json vocab_size): "
                        "they do not belong together. Use the model's own tokenizer.")
    seq = window_length(model_dir, seq_len)
    model = load_causal_lm(model_dir, from_config, frozen_precision)
    rows = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    chats = chat_files(data_dir) if data_dir is not None and data == "real" else []
    if chats or is_chat_set(data_dir):
        train, val = (chat_datasets(chats, tokenizer, seq, truncate_chats) if chats else
                      open_chat_set(data_dir, seq, rows))  # type: ignore[arg-type]
        count = min(EXAMPLE_ITEMS, len(train))
        inputs, targets = collate_windows([train[i] for i in range(count)])
        # position_ids only restart positions at each packed conversation: the example
        # (the served inputs' schema) holds the token ids, as one conversation is sent.
        collate, example = collate_windows, ({"input_ids": inputs["input_ids"]}, targets)
    else:
        train, val = token_datasets(data_dir, data, seq, rows, path, f"the model in {path}")
        collate, example = None, first_windows(train, EXAMPLE_ITEMS)
    return Workload(
        name="hf",
        model=model,
        train_dataset=train,
        val_dataset=val,
        collate_fn=collate,
        example_batch=example,
        tokens_per_sample=seq,
        max_sequence_length=seq,
        export_hf=partial(save_directory, path),
    )
