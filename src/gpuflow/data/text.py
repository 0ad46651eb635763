"""Byte-level text corpora, split by document, served as fixed windows of bytes.

The default corpus is the Python documentation that ships inside CPython
(``pydoc_data.topics``: the language reference topics ``help()`` shows), so a real text
workload needs no download. Any folder of text files can replace it.

Documents are joined by the end-of-document byte (``gpuflow.byte_vocab``), so a model
learns where one ends. Held-out text is chosen by whole document, never by scattering
bytes, so validation measures how well the model predicts text it has not seen, not text
it has seen around.
Datasets are map-style and item ``i`` depends only on ``i`` (the engine's exact resume and
its data-parallel sharding rely on that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from gpuflow.byte_vocab import END_OF_DOCUMENT
from gpuflow.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst")
DOC_SEPARATOR = bytes([END_OF_DOCUMENT])
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class Document:
    """One unit of the split: a pydoc topic or a file."""

    name: str
    data: bytes


@dataclass(frozen=True)
class TextSplit:
    """A corpus split into training and held-out bytes, with the documents on each side."""

    train: bytes
    val: bytes
    train_names: tuple[str, ...]
    val_names: tuple[str, ...]


def pydoc_documents() -> list[Document]:
    """CPython's bundled documentation topics, sorted by name (the text varies with the
    Python version, the order and split rule do not)."""
    from pydoc_data.topics import topics

    return [Document(name, topics[name].encode("utf-8")) for name in sorted(topics)]


def text_files(data_dir: str | Path) -> list[Path]:
    """Every *.txt, *.md and *.rst file under ``data_dir``, recursively, in sorted path order."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UserError(
            f"--data-dir {data_dir} {what}. Give a folder holding text files "
            f"({', '.join('*' + s for s in TEXT_SUFFIXES)}), or drop --data-dir to train on "
            "the Python documentation bundled with CPython."
        )
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())


def _no_text(data_dir: str | Path) -> UserError:
    return UserError(
        f"--data-dir {data_dir} holds no non-empty text files "
        f"({', '.join('*' + s for s in TEXT_SUFFIXES)}, searched recursively). "
        "Add some, or drop --data-dir to train on the bundled Python documentation."
    )


def directory_documents(data_dir: str | Path) -> list[Document]:
    """The non-empty text files of ``data_dir`` (see ``text_files``), read whole."""
    root = Path(data_dir).expanduser()
    documents = [Document(str(p.relative_to(root)), p.read_bytes()) for p in text_files(root)]
    documents = [doc for doc in documents if doc.data.strip()]
    if not documents:
        raise _no_text(data_dir)
    return documents


def held_out_positions(count: int) -> list[int]:
    """Sorted positions of the documents held out: about 10% of them, spread evenly, at
    least one, never all."""
    if count < 2:
        return []
    k = max(1, round(count * VAL_FRACTION))
    return [j * count // k + 1 for j in range(k)]


def single_document_cut(size: int) -> int:
    """Where a corpus of one document is split: its last 10% of bytes are held out."""
    return size - max(1, int(size * VAL_FRACTION))


def split_documents(documents: Sequence[Document]) -> TextSplit:
    """Hold out ~10% of the documents (deterministically, by position in sorted order).

    A single document cannot be split by document; its last 10% of bytes are held out.
    """
    if len(documents) == 1:
        data = documents[0].data
        cut = single_document_cut(len(data))
        name = documents[0].name
        return TextSplit(data[:cut], data[cut:], (name,), (name + " (last 10%)",))
    held = set(held_out_positions(len(documents)))
    train = [doc for i, doc in enumerate(documents) if i not in held]
    val = [doc for i, doc in enumerate(documents) if i in held]
    return TextSplit(
        DOC_SEPARATOR.join(doc.data for doc in train),
        DOC_SEPARATOR.join(doc.data for doc in val),
        tuple(doc.name for doc in train),
        tuple(doc.name for doc in val),
    )


def load_split(data_dir: str | Path | None = None) -> TextSplit:
    """The pydoc corpus, or the text files of ``data_dir``, split for training."""
    documents = pydoc_documents() if data_dir is None else directory_documents(data_dir)
    return split_documents(documents)


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string (or of a 1-D tensor of token ids): item i
    is ``(x, y)``, both int64 of shape ``[seq_len]``, with ``y`` the bytes that follow each
    byte of ``x``."""

    def __init__(self, data: bytes | torch.Tensor, seq_len: int, label: str = "text") -> None:
        unit = "tokens" if isinstance(data, torch.Tensor) else "bytes"
        if len(data) < seq_len + 1:
            raise UserError(
                f"The {label} holds {len(data)} {unit}, fewer than one window of "
                f"{seq_len + 1} (the sequence length + 1). Add text, or choose a shorter "
                "sequence (--model-size 'tiny,seq=64', or --seq-len for hf:DIR)."
            )
        self.data = (data if isinstance(data, torch.Tensor)
                     else torch.frombuffer(bytearray(data), dtype=torch.uint8).clone())
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        chunk = self.data[start:start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class RandomBytes(Dataset):
    """Uniformly random bytes (or ids below ``vocab``) in the shapes of ``ByteWindows``, for
    throughput runs; item i is drawn from a generator seeded by ``(seed, i)``, so it
    depends only on ``i``."""

    def __init__(self, count: int, seq_len: int, seed: int = 0, vocab: int = 256) -> None:
        self.count, self.seq_len, self.seed, self.vocab = count, seq_len, seed, vocab

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chunk = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=generator)
        return chunk[:-1], chunk[1:]


# --- streamed, for packing: the same split, never held in memory -----------------------

READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of a file (or of bytes in memory: the bundled topics and the
    separators between documents)."""

    source: Path | bytes
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def has_text(path: Path) -> bool:
    """Whether a file holds more than whitespace, read a chunk at a time."""
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            if chunk.strip():
                return True
    return False


def split_spans(data_dir: str | Path | None = None) -> dict[str, list[Span]]:
    """The train and val bytes of ``load_split(data_dir)`` as spans of the files, found
    from the files' sizes: joined, each split is exactly the bytes ``load_split`` gives."""
    if data_dir is None:
        sources: list[Path | bytes] = [doc.data for doc in pydoc_documents()]
    else:
        sources = [path for path in text_files(data_dir) if has_text(path)]
        if not sources:
            raise _no_text(data_dir)
    sizes = [len(s) if isinstance(s, bytes) else s.stat().st_size for s in sources]
    if len(sources) == 1:
        cut = single_document_cut(sizes[0])
        return {"train": [Span(sources[0], 0, cut)], "val": [Span(sources[0], cut, sizes[0])]}
    held = set(held_out_positions(len(sources)))
    splits: dict[str, list[Span]] = {"train": [], "val": []}
    for position, (source, size) in enumerate(zip(sources, sizes, strict=True)):
        spans = splits["val" if position in held else "train"]
        if spans:
            spans.append(Span(DOC_SEPARATOR, 0, len(DOC_SEPARATOR)))
        spans.append(Span(source, 0, size))
    return splits


class SpanReader:
    """Reads spans as one stream, from ``skip`` bytes in, at most a chunk at a time."""

    def __init__(self, spans: Sequence[Span], skip: int = 0) -> None:
        self._spans = list(spans)
        self._index, self._position = 0, 0
        while self._index < len(self._spans) and skip >= self._spans[self._index].size:
            skip -= self._spans[self._index].size
            self._index += 1
        self._position = skip

    def read(self, limit: int = READ_CHUNK) -> bytes:
        """Up to ``limit`` bytes from the current span; empty at the end of the last."""
        while self._index < len(self._spans):
            span = self._spans[self._index]
            start = span.start + self._position
            count = min(limit, span.end - start)
            if count > 0:
                self._position += count
                if isinstance(span.source, bytes):
                    return span.source[start:start + count]
                with open(span.source, "rb") as handle:
                    handle.seek(start)
                    data = handle.read(count)
                if len(data) != count:
                    raise UserError(f"{span.source} changed while it was being packed; "
                                    "pack it again when it is no longer written to.")
                return data
            self._index, self._position = self._index + 1, 0
        return b""
