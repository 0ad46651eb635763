"""A model directory's tokenizer as text packing and text workloads use it: its backend for
worker processes, its end-of-sequence id (written between documents) and its vocabulary
(the width of the shards and the rows of the embedding)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuflow.data.text_pieces import corpus_pieces
from gpuflow.data.tokenize_pack import TokenizedSource, token_dtype
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

