"""A text corpus cut into pieces that tokenizer workers take one at a time.

A piece is a whole text file (one document), a range of whole lines of a JSONL file (one
document a line, its text under a field), or one of the Python help topics bundled with
CPython (the default corpus). Pieces are decided from the files alone, never from the
number of workers, so a pack is the same with any number of them and resumes after
whole pieces.

Held-out text is chosen as ``gpuflow.data.text`` chooses it for bytes: whole text files
(about one in ten, spread evenly; a corpus of one file holds out its last 10%), and for
JSONL every tenth line of each file (line numbers 10, 20, ...), so a held-out document
is never also trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from gpuflow.data.text import (
    READ_CHUNK,
    TEXT_SUFFIXES,
    has_text,
    held_out_positions,
    single_document_cut,
)
from gpuflow.data.tokenize_worker import Piece
from gpuflow.errors import UserError

JSONL_SUFFIX = ".jsonl"
PIECE_BYTES = 1 << 20  # JSONL lines a worker tokenizes at once

def corpus_pieces(data_dir: str | Path | None,
                  piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """The pieces of the help topics (``data_dir`` None) or of the .txt/.md/.rst and .jsonl
    files under ``data_dir`` (recursively, in sorted path order)."""
    if data_dir is None:
        from pydoc_data.topics import topics

        names = sorted(topics)
        held = set(held_out_positions(len(names)))
        return [Piece("topic", name, 0, len(topics[name].encode("utf-8")),
                      "val" if i in held else "train")
                for i, name in enumerate(names)]
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UserError(f"{data_dir} {what}. Give a folder of text files "
                        f"({', '.join('*' + s for s in (*TEXT_SUFFIXES, JSONL_SUFFIX))}).")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    texts = [p for p in files if p.suffix.lower() in TEXT_SUFFIXES and has_text(p)]
    pieces = _text_pieces(texts)
    for path in files:
        if path.suffix.lower() == JSONL_SUFFIX:
            pieces += _jsonl_pieces(path, piece_bytes)
    if not pieces:
        raise UserError(f"{data_dir} holds no non-empty text files "
                        f"({', '.join('*' + s for s in (*TEXT_SUFFIXES, JSONL_SUFFIX))}, "
                        "searched recursively).")
    return pieces


def _text_pieces(files: list[Path]) -> list[Piece]:
    if len(files) == 1:
        size = files[0].stat().st_size
        cut = _character_boundary(files[0], single_document_cut(size))
        return [Piece("text", str(files[0]), 0, cut, "train"),
                Piece("text", str(files[0]), cut, size, "val")]
    held = set(held_out_positions(len(files)))
    return [Piece("text", str(path), 0, path.stat().st_size, "val" if i in held else "train")
            for i, path in enumerate(files)]


def _character_boundary(path: Path, cut: int) -> int:
    """``cut`` moved forward past UTF-8 continuation bytes, so both sides decode."""
    with open(path, "rb") as handle:
        handle.seek(cut)
        following = handle.read(4)
    return cut + next((i for i, byte in enumerate(following) if byte & 0xC0 != 0x80),
                      len(following))


def _jsonl_pieces(path: Path, piece_bytes: int) -> Iterator[Piece]:
    """Ranges of whole lines of about ``piece_bytes``, each with its first line's number,
    found reading the file a chunk at a time."""
    start, line, position, lines_in = 0, 1, 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            offset = 0
            while (newline := chunk.find(b"\n", offset)) >= 0:
                offset = newline + 1
                lines_in += 1
                if position + offset - start >= piece_bytes:
                    yield Piece("jsonl", str(path), start, position + offset, "lines", line)
                    start, line, lines_in = position + offset, line + lines_in, 0
            position += len(chunk)
    if position > start:
        yield Piece("jsonl", str(path), start, position, "lines", line)
