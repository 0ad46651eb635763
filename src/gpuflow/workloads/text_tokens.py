"""A model directory's tokenizer as text packing and text workloads use it: its backend for
worker processes, its end-of-sequence id (written between documents) and its vocabulary
(the width of the shards and the rows of the embedding)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuflow.data.streaming import open_packed
from gpuflow.data.text import ByteWindows, RandomBytes
from gpuflow.data.text_pieces import corpus_pieces
from gpuflow.data.tokenize_pack import TokenizedSource, token_dtype, tokenize_split
from gpuflow.data.tokenize_worker import TokenizerSpec
from gpuflow.errors import UserError
from gpuflow.model_dir import load_hf_tokenizer


def tokenizer_spec(directory: str | Path) -> TokenizerSpec:
    """The tokenizer in ``directory`` as workers rebuild it; a UserError when it has no
    fast backend or declares no end-of-sequence token."""
    path = Path(directory).expanduser().resolve()
    tokenizer = load_hf_tokenizer(path)
    return spec_of(tokenizer, str(path))


def spec_of(tokenizer: Any, name: str) -> TokenizerSpec:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"The tokenizer in {name} has no fast (tokenizers) form; save it with "
                        "tokenizer.json beside its other files.")
    if tokenizer.eos_token_id is None:
        raise UserError(f"The tokenizer in {name} declares no eos_token, which packing writes "
                        "between documents: set eos_token in its tokenizer_config.json.")
    vocab = len(tokenizer)
    return TokenizerSpec(backend.to_str(), int(tokenizer.eos_token_id), vocab,
                         token_dtype(vocab), name)


def default_workers() -> int:
    """One tokenizer process per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def tokenized_source(workload: str, data_dir: str | None, tokenizer: str,
                     text_field: str | None = None,
                     workers: int | None = None) -> TokenizedSource:
    """``data_dir``'s text (.txt/.md/.rst files, .jsonl lines; None: the Python help
    topics) to pack under the tokenizer in directory ``tokenizer``."""
    if workers is not None and workers < 0:
        raise UserError(f"--workers must be 0 (tokenize in the packing process) or more "
                        f"(got {workers}).")
    return TokenizedSource(workload, corpus_pieces(data_dir), tokenizer_spec(tokenizer),
                           text_field or "text",
                           default_workers() if workers is None else workers)


def check_vocabulary(manifest_meta: dict[str, Any], data_dir: str, vocab_size: int,
                     what: str) -> None:
    """A packed set's ids must all be rows of the model's embedding."""
    packed = manifest_meta.get("vocab_size")
    if packed is None:
        raise UserError(f"--data-dir {data_dir} holds bytes packed without a tokenizer; pack "
                        f"the text with `gpuflow data pack --tokenizer DIR` for {what}.")
    if int(packed) > vocab_size:
        raise UserError(f"--data-dir {data_dir} was packed with a tokenizer of {packed} ids "
                        f"({manifest_meta.get('tokenizer')}), more than the {vocab_size} rows "
                        f"of {what}'s embedding. Pack it with the model's own tokenizer.")


# Random windows for throughput runs (--data synthetic), textlm's bytes or a tokenizer's ids.
SYNTHETIC_TRAIN_ITEMS = 65_536
SYNTHETIC_VAL_ITEMS = 32


def token_datasets(data_dir: str | None, data: str, seq_len: int, vocab_size: int,
                   tokenizer: Path, what: str) -> tuple[Dataset, Dataset | None]:
    """Training and held-out windows of ``seq_len`` + 1 ids: a set packed under a tokenizer
    (streamed), raw text tokenized in memory by ``tokenizer`` (``data_dir``'s files, or the
    Python help topics), or random ids (``data`` "synthetic")."""
    if data not in ("real", "synthetic"):
        raise UserError(f"--data must be real or synthetic (got {data!r}).")
    if data == "synthetic":
        return (RandomBytes(SYNTHETIC_TRAIN_ITEMS, seq_len, seed=1, vocab=vocab_size),
                RandomBytes(SYNTHETIC_VAL_ITEMS, seq_len, seed=2, vocab=vocab_size))
    packed = open_packed(data_dir, "textlm", seq_len=seq_len)
    if packed is not None:
        check_vocabulary(packed.meta, str(data_dir), vocab_size, what)
        return packed.train, packed.val
    spec, pieces = tokenizer_spec(tokenizer), corpus_pieces(data_dir)
    source = "the Python documentation" if data_dir is None else f"--data-dir {data_dir}"
    train, val = (torch.from_numpy(tokenize_split(pieces, spec, split).astype(np.int32))
                  for split in ("train", "val"))
    return (ByteWindows(train, seq_len, label=f"training text of {source}"),
            ByteWindows(val, seq_len, label=f"held-out text of {source}") if len(val) else None)


def first_windows(dataset: Dataset, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` windows (fewer if the set is smaller) as one batch: the
    workload's example batch."""
    count = min(count, len(dataset))  # type: ignore[arg-type]
    x, y = (torch.stack(items) for items in zip(*(dataset[i] for i in range(count)),
                                                strict=True))
    return x, y
