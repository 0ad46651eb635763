"""Text packed under a tokenizer: documents tokenized in worker processes into token shards.

The corpus is cut into pieces (``gpuflow.data.text_pieces``) that worker processes
tokenize, at most two per worker in flight, while this process writes their ids, in
corpus order, into shards of the set's token width (uint16 when every id fits, uint32
otherwise). Each document's ids are ``tokenizer.encode(document)`` (with the special
tokens the tokenizer adds, e.g. BOS) followed by the end-of-sequence id. A shard closes at
the first piece boundary past the shard size, so memory holds one shard, a piece and the
pieces in flight, whatever the corpus; the pack state records after each shard how many
pieces it has consumed, which is where a rerun continues.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from gpuflow.data.kinds import TokenWindows
from gpuflow.data.manifest import Manifest
from gpuflow.data.pack_progress import PackProgress
from gpuflow.data.pack_state import PackState
from gpuflow.data.shard_files import TokenShardWriter
from gpuflow.data.text_pieces import Piece
from gpuflow.data.tokenize_worker import TokenizerSpec, encode_piece, start
from gpuflow.data.worker_pool import OrderedMap, ordered_map

SPLITS = ("train", "val")
IN_FLIGHT = 2  # pieces per worker submitted ahead


def token_dtype(vocab_size: int) -> str:
    """The narrowest width that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class TokenizedSource:
    """A text corpus to pack under a tokenizer; ``workers`` 0 tokenizes in this process."""

    workload: str
    pieces: list[Piece]
    tokenizer: TokenizerSpec
    text_field: str = "text"
    workers: int = 0

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        itemsize = np.dtype(self.tokenizer.dtype).itemsize
        with ordered_map(self.workers, start, (self.tokenizer,), IN_FLIGHT) as mapped:
            for split in SPLITS:
                pieces = [piece for piece in self.pieces if piece.in_split(split)]
                if pieces:
                    self._write_split(out, split, pieces, state,
                                      max(2, shard_bytes // itemsize), progress, mapped)
        spec = self.tokenizer
        return Manifest(workload=self.workload, kind=TokenWindows.name, splits=state.splits,
                        token_dtype=spec.dtype,
                        meta={"tokenizer": spec.name, "vocab_size": spec.vocab_size,
                              "eos_id": spec.eos_id, "text_field": self.text_field})

    def _write_split(self, out: Path, split: str, pieces: list[Piece], state: PackState,
                     shard_tokens: int, progress: PackProgress, mapped: OrderedMap) -> None:
        cursor = state.cursor(split)
        _, shards = state.done(split)
        progress.begin(split, sum(_size(p) for p in pieces), "bytes",
                       sum(_size(p) for p in pieces[:cursor]), shards)
        buffered: list[np.ndarray] = []
        count = 0
        encoded = mapped(partial(encode_piece, split=split, text_field=self.text_field),
                         pieces[cursor:])
        for index, (ids, _) in enumerate(encoded, cursor + 1):
            buffered.append(ids)
            count += len(ids)
            progress.advance(_size(pieces[index - 1]), _size(pieces[index - 1]))
            if count >= shard_tokens or (index == len(pieces) and count):
                path = out / TokenWindows.shard_name(split, len(state.splits.get(split, [])))
                writer = TokenShardWriter(path, count, np.dtype(self.tokenizer.dtype))
                for part in buffered:
                    writer.write(part.tobytes())
                state.record(split, writer.close(), cursor=index)
                progress.shard_written()
                buffered, count = [], 0


def tokenize_split(pieces: list[Piece], tokenizer: TokenizerSpec, split: str,
                   text_field: str = "text") -> np.ndarray:
    """A split's ids in this process and in memory, for training on a corpus unpacked."""
    start(tokenizer)
    parts = [encode_piece(piece, split, text_field)[0] for piece in pieces
             if piece.in_split(split)]
    return np.concatenate(parts) if parts else np.zeros(0, tokenizer.dtype)


def _size(piece: Piece) -> int:
    return piece.end - piece.start
