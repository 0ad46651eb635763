"""Byte-level text corpora, split by document, served as fixed windows of bytes.

The default corpus is the Python documentation that ships inside CPython
(``pydoc_data.topics``: the language reference topics ``help()`` shows), so a real text
workload needs no download. Any folder of text files can replace it.

Held-out text is chosen by whole document, never by scattering bytes, so validation
measures how well the model predicts text it has not seen, not text it has seen around.
Datasets are map-style and item ``i`` depends only on ``i`` (the engine's exact resume and
its data-parallel sharding rely on that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from gpuflow.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst")
DOC_SEPARATOR = b"\n\n"
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


def directory_documents(data_dir: str | Path) -> list[Document]:
    """Every *.txt, *.md and *.rst file under ``data_dir``, recursively, in sorted path order."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UserError(
            f"--data-dir {data_dir} {what}. Give a folder holding text files "
            f"({', '.join('*' + s for s in TEXT_SUFFIXES)}), or drop --data-dir to train on "
            "the Python documentation bundled with CPython."
        )
    paths = sorted(p for p in root.rglob("*")
                   if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
    documents = [Document(str(p.relative_to(root)), p.read_bytes()) for p in paths]
    documents = [doc for doc in documents if doc.data.strip()]
    if not documents:
        raise UserError(
            f"--data-dir {data_dir} holds no non-empty text files "
            f"({', '.join('*' + s for s in TEXT_SUFFIXES)}, searched recursively). "
            "Add some, or drop --data-dir to train on the bundled Python documentation."
        )
    return documents


def held_out_positions(count: int) -> list[int]:
    """Sorted positions of the documents held out: about 10% of them, spread evenly, at
    least one, never all."""
    if count < 2:
        return []
    k = max(1, round(count * VAL_FRACTION))
    return [j * count // k + 1 for j in range(k)]


def split_documents(documents: Sequence[Document]) -> TextSplit:
    """Hold out ~10% of the documents (deterministically, by position in sorted order).

    A single document cannot be split by document; its last 10% of bytes are held out.
    """
    if len(documents) == 1:
        data = documents[0].data
        cut = len(data) - max(1, int(len(data) * VAL_FRACTION))
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
    """Non-overlapping windows of a byte string: item i is ``(x, y)``, both int64 of shape
    ``[seq_len]``, with ``y`` the bytes that follow each byte of ``x``."""

    def __init__(self, data: bytes, seq_len: int, label: str = "text") -> None:
        if len(data) < seq_len + 1:
            raise UserError(
                f"The {label} holds {len(data)} bytes, fewer than one window of "
                f"{seq_len + 1} (the sequence length + 1). Add text, or choose a shorter "
                "sequence with --model-size, e.g. 'tiny,seq=64'."
            )
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
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
    """Uniformly random bytes in the shapes of ``ByteWindows``, for throughput runs; item i
    is drawn from a generator seeded by ``(seed, i)``, so it depends only on ``i``."""

    def __init__(self, count: int, seq_len: int, seed: int = 0) -> None:
        self.count, self.seq_len, self.seed = count, seq_len, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chunk = torch.randint(0, 256, (self.seq_len + 1,), generator=generator)
        return chunk[:-1], chunk[1:]
