"""textlm: a GPT trained as a byte-level language model on real text.

By default the corpus is the Python documentation bundled with CPython (see
``gpuflow.data.text``); ``--data-dir`` trains on any folder of text files and
``--data synthetic`` on random bytes of the same shapes (pure throughput, any model size).
Validation reports ``bits_per_byte``: the mean cross-entropy in bits, comparable across
tokenisers and corpora (a byte model's loss per token is its loss per byte).

It is the workload the tensor- and pipeline-parallel plans target.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import Dataset

from gpuflow.byte_vocab import BYTE_VOCAB_SIZE
from gpuflow.data.streaming import open_packed
from gpuflow.data.text import ByteWindows, RandomBytes, load_split
from gpuflow.errors import UserError
from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.models.gpt2_format import save_as_gpt2
from gpuflow.parallel.tensor import transformer_plan
from gpuflow.workload import Workload, cross_entropy
from gpuflow.workloads.hf_dir import copy_companions
from gpuflow.workloads.text_codec import text_serving
from gpuflow.workloads.text_tokens import (
    SYNTHETIC_TRAIN_ITEMS,
    SYNTHETIC_VAL_ITEMS,
    first_windows,
)

if TYPE_CHECKING:
    from gpuflow.data.pack_sources import TokenSource
    from gpuflow.data.tokenize_pack import TokenizedSource

VOCAB_SIZE = BYTE_VOCAB_SIZE
EXAMPLE_ITEMS = 4

PRESETS: dict[str, GPTConfig] = {
    # Trains below 2.5 bits per byte on the pydoc corpus in minutes on 2 CPU cores.
    "tiny": GPTConfig(vocab_size=VOCAB_SIZE, layers=4, dim=128, heads=4, seq_len=128),
    # nanoGPT's character-level Shakespeare shape.
    "small": GPTConfig(vocab_size=VOCAB_SIZE, layers=6, dim=384, heads=6, seq_len=256),
    # GPT-2 small's and medium's layouts; with 256 byte embeddings instead of 50,257
    # token embeddings they hold 85M and 303M parameters.
    "124m": GPTConfig(vocab_size=VOCAB_SIZE, layers=12, dim=768, heads=12, seq_len=1024),
    "350m": GPTConfig(vocab_size=VOCAB_SIZE, layers=24, dim=1024, heads=16, seq_len=1024),
    # GPT-3 XL's depth and width (24 x 2048, 16 heads of 128), 2048 context: 1.21B.
    "1b": GPTConfig(vocab_size=VOCAB_SIZE, layers=24, dim=2048, heads=16, seq_len=2048),
}
DEFAULT_PRESET = "tiny"

# --model-size key -> GPTConfig field and its type.
SIZE_KEYS: dict[str, tuple[str, type]] = {
    "layers": ("layers", int),
    "dim": ("dim", int),
    "heads": ("heads", int),
    "seq": ("seq_len", int),
    "dropout": ("dropout", float),
}


def _size_help() -> str:
    return (f"Use a preset ({', '.join(PRESETS)}), explicit dimensions such as "
            "'layers=4,dim=256,heads=4,seq=256' (keys: " + ", ".join(SIZE_KEYS)
            + "; unset keys keep tiny's values), or a preset with overrides such as "
            "'124m,seq=256'.")


def parse_model_size(spec: str | None) -> GPTConfig:
    """A preset name, ``key=value`` dimensions, or a preset followed by overrides."""
    if spec is None:
        return PRESETS[DEFAULT_PRESET]
    parts = [part.strip() for part in spec.split(",")]
    if not spec.strip() or any(not part for part in parts):
        raise UserError(f"--model-size {spec!r} is empty or has an empty item. {_size_help()}")
    base = PRESETS[DEFAULT_PRESET]
    if "=" not in parts[0]:
        name = parts.pop(0).lower()
        if name not in PRESETS:
            raise UserError(f"--model-size: unknown preset {name!r}. {_size_help()}")
        base = PRESETS[name]
    overrides: dict[str, int | float] = {}
    for part in parts:
        key, sep, raw = (s.strip() for s in part.partition("="))
        if not sep:
            raise UserError(f"--model-size: {part!r} is not key=value (only the first item "
                            f"may name a preset). {_size_help()}")
        if key not in SIZE_KEYS:
            raise UserError(f"--model-size: unknown key {key!r}. {_size_help()}")
        field_name, kind = SIZE_KEYS[key]
        if field_name in overrides:
            raise UserError(f"--model-size: {key!r} is given twice.")
        try:
            value = kind(raw)
        except ValueError:
            raise UserError(f"--model-size: {key}={raw!r} is not a valid "
                            f"{'integer' if kind is int else 'number'}.") from None
        if kind is int and value < 1:
            raise UserError(f"--model-size: {key} must be at least 1 (got {raw}).")
        overrides[field_name] = value
    try:
        return replace(base, **overrides)
    except ValueError as exc:
        raise UserError(f"--model-size {spec!r}: {exc}.") from None


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats, computed in fp32 whatever the autocast dtype
    (the workload contract's default loss, which reads sequence logits per position)."""
    return cross_entropy(logits, target)


def bits_per_byte(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in bits: what an ideal coder driven by the model spends per byte."""
    return lm_loss(logits, target) / math.log(2)


def pack_source(data_dir: str | None, tokenizer: str | None = None,
                text_field: str | None = None,
                workers: int | None = None) -> TokenSource | TokenizedSource:
    """The split training reads, for ``gpuflow data pack``: as spans of the files packed as
    byte tokens a chunk at a time, or, with a ``tokenizer`` directory, documents (files,
    or JSONL lines' ``text_field``) tokenized by ``workers`` processes."""
    if tokenizer is not None:
        from gpuflow.workloads.text_tokens import tokenized_source

        return tokenized_source("textlm", data_dir, tokenizer, text_field, workers)
    if text_field is not None or workers is not None:
        raise UserError("--text-field and --workers apply to packing under a tokenizer: add "
                        "--tokenizer DIR (a model directory), or drop them.")
    from gpuflow.data.pack_sources import TokenSource
    from gpuflow.data.text import split_spans

    return TokenSource("textlm", split_spans(data_dir))


def _export_with_tokenizer(tokenizer: Path, model: nn.Module, directory: Path) -> None:
    save_as_gpt2(model, directory)
    copy_companions(tokenizer, directory)


def build(data_dir: str | None = None, data: str = "real",
          model_size: str | None = None, tokenizer: str | None = None) -> Workload:
    """The textlm workload: GPT of ``model_size`` on pydoc, ``data_dir`` or random bytes;
    with a ``tokenizer`` directory, on ids of its vocabulary (``gpuflow.workloads.text_tokens``)."""
    if data not in ("real", "synthetic"):
        raise UserError(f"--data must be real or synthetic (got {data!r}).")
    config = parse_model_size(model_size)
    seq = config.seq_len
    if tokenizer is not None:
        return _with_tokenizer(Path(tokenizer).expanduser().resolve(), config, data_dir, data)
    packed = open_packed(data_dir, "textlm", seq_len=seq) if data == "real" else None
    train: Dataset
    val: Dataset | None
    if packed is not None:
        train, val = packed.train, packed.val
    elif data == "synthetic":
        train = RandomBytes(SYNTHETIC_TRAIN_ITEMS, seq, seed=1)
        val = RandomBytes(SYNTHETIC_VAL_ITEMS, seq, seed=2)
    else:
        split = load_split(data_dir)
        source = "the Python documentation" if data_dir is None else f"--data-dir {data_dir}"
        train = ByteWindows(split.train, seq, label=f"training text of {source}")
        val = ByteWindows(split.val, seq, label=f"held-out text of {source}")
    return Workload(
        name="textlm",
        model=GPT(config),
        train_dataset=train,
        val_dataset=val,
        loss_fn=lm_loss,
        metrics={"bits_per_byte": bits_per_byte},
        example_batch=first_windows(train, EXAMPLE_ITEMS),
        tokens_per_sample=seq,
        tensor_parallel_plan=transformer_plan(sequence_parallel=True),
        export_hf=save_as_gpt2,
        serving=text_serving(config.seq_len, config.vocab_size),
    )


def _with_tokenizer(tokenizer: Path, config: GPTConfig, data_dir: str | None,
                    data: str) -> Workload:
    """textlm over the ids of a model directory's tokenizer: its vocabulary sizes the
    embedding; served from token ids (the byte codec does not apply)."""
    from gpuflow.model_dir import load_hf_tokenizer
    from gpuflow.workloads.text_tokens import token_datasets

    config = replace(config, vocab_size=len(load_hf_tokenizer(tokenizer)))
    train, val = token_datasets(data_dir, data, config.seq_len, config.vocab_size, tokenizer,
                                "textlm")
    return Workload(name="textlm", model=GPT(config), train_dataset=train, val_dataset=val,
                    loss_fn=lm_loss, example_batch=first_windows(train, EXAMPLE_ITEMS),
                    tokens_per_sample=config.seq_len,
                    tensor_parallel_plan=transformer_plan(sequence_parallel=True),
                    export_hf=partial(_export_with_tokenizer, tokenizer))


def describe_presets() -> dict[str, dict[str, int]]:
    """Each preset's dimensions and parameter count, for docs and ``--help`` texts."""
    return {
        name: {**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "dropout"},
               "parameters": cfg.num_parameters()}
        for name, cfg in PRESETS.items()
    }
