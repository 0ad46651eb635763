"""What a tokenizer worker process runs: read one piece of the corpus, tokenize its
documents, and return their ids with the separator after each document.

It imports only numpy and ``tokenizers``, never torch (spawned workers start in a fraction
of a second), and holds one tokenizer per process, built once from its JSON form: the same
backend that ``transformers``' ``encode`` calls, so a document's ids here are
``tokenizer.encode(document)``'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gpuflow.errors import UserError

BATCH_DOCUMENTS = 256  # documents encoded in one call
VAL_EVERY = 10  # JSONL: line numbers divisible by it are held out

PieceKind = Literal["text", "jsonl", "topic"]
Split = Literal["train", "val", "lines"]  # "lines": JSONL, split line by line


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of ``source`` (a file, or a help topic's name), whose first
    line is line ``first_line`` of the file (JSONL errors name it)."""

    kind: PieceKind
    source: str
    start: int
    end: int
    split: Split
    first_line: int = 1

    def in_split(self, split: str) -> bool:
        return self.split in (split, "lines")


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as workers rebuild it: its backend's JSON, the id written after each
    document, the width of the shards' tokens, and where it came from."""

    backend_json: str
    eos_id: int
    vocab_size: int
    dtype: str
    name: str


_tokenizer: Any = None
_spec: TokenizerSpec | None = None


def start(spec: TokenizerSpec) -> None:
    """A worker's initializer: one thread per process (the processes are the parallelism)."""
    global _tokenizer, _spec
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _tokenizer, _spec = Tokenizer.from_str(spec.backend_json), spec


def encode_piece(piece: Piece, split: str, text_field: str) -> tuple[np.ndarray, int]:
    """The ids of the piece's documents in ``split``, each followed by the separator, and
    how many documents that is."""
    assert _spec is not None, "start() first"
    documents = [text for text in _documents(piece, split, text_field) if text.strip()]
    ids: list[int] = []
    for first in range(0, len(documents), BATCH_DOCUMENTS):
        for encoding in _tokenizer.encode_batch(documents[first:first + BATCH_DOCUMENTS],
                                                add_special_tokens=True):
            ids.extend(encoding.ids)
            ids.append(_spec.eos_id)
    return np.array(ids, dtype=np.dtype(_spec.dtype).newbyteorder("<")), len(documents)


def _documents(piece: Piece, split: str, text_field: str) -> list[str]:
    if piece.kind == "topic":
        from pydoc_data.topics import topics

        return [topics[piece.source]]
    with open(piece.source, "rb") as handle:
        handle.seek(piece.start)
        data = handle.read(piece.end - piece.start)
    if piece.kind == "text":
        return [_decoded(data, piece.source)]
    texts = []
    for number, line in enumerate(data.split(b"\n"), piece.first_line):
        if line.strip() and (number % VAL_EVERY == 0) == (split == "val"):
            texts.append(_field(line, text_field, f"{piece.source}:{number}"))
    return texts


def _decoded(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where} is not UTF-8 text ({error}); convert it to UTF-8.") from None


def _field(line: bytes, text_field: str, where: str) -> str:
    try:
        record = json.loads(_decoded(line, where))
    except ValueError as error:
        raise UserError(f"{where}: not a JSON object ({error}). Each line of a .jsonl file "
                        "is one JSON object.") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{where}: no string field {text_field!r} (found {found}). Name the "
                        "field holding the text with --text-field.")
    return text
