"""Conversations into a packed set: ``gpuflow data pack CHATS --workload hf:DIR``.

The conversations are rendered and packed into windows of ``--seq-len`` positions exactly as
training packs them in memory (``gpuflow.workloads.chat_windows``), then written as records
of ``((ids, positions), targets)`` int32 tensors, one window each, through the record packer:
same manifest, checksums and resume (a rerun of the same command continues after the
finished shards). The windows of the whole JSONL are held in memory while packing (12 bytes
a token), as the chat set is rendered turn by turn in this process. The manifest names the
workload ``hf`` and records the tokenizer, its vocabulary and the window length, which
``--workload hf:DIR`` checks before training on the set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.data.manifest import Manifest, is_packed, load_manifest
from gpuflow.data.pack import write_pack
from gpuflow.data.pack_progress import Mode, PackProgress
from gpuflow.data.pack_sources import RecordSource
from gpuflow.data.pack_state import PackState
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.workloads.chat_windows import Window, pack_conversations
from gpuflow.workloads.chats import chat_files, pad_id, tokenized_chats

CHAT_SET = "hf"  # the workload a packed chat set's manifest names
EXAMPLE_WINDOWS = 4


@dataclass(frozen=True)
class ChatSource:
    """A chat set's windows by split, written as records."""

    splits: dict[str, list[Window]]
    meta: dict[str, Any]
    workload: str = CHAT_SET

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        splits = {name: windows for name, windows in self.splits.items() if windows}
        first = splits["train"][:EXAMPLE_WINDOWS]
        example = ([torch.stack([inputs[i] for inputs, _ in first]) for i in range(2)],
                   torch.stack([target for _, target in first]))
        manifest = RecordSource(self.workload, splits, example).pack(
            out, state, shard_bytes, progress)
        manifest.meta = dict(self.meta)
        return manifest


def pack_chats(directory: str | Path, src: str | Path, out: str | Path, seq_len: int,
               truncate: bool, shard_mb: float, force: bool,
               progress: bool | Mode) -> Manifest:
    """Pack the conversations of ``src`` under the tokenizer and chat template of model
    directory ``directory`` into windows of ``seq_len`` positions, in ``out``."""
    path = Path(directory).expanduser().resolve()
    options = {"tokenizer": str(path), "seq_len": seq_len, "truncate_chats": truncate}

    def source(_workload: str, raw: str | None) -> ChatSource:
        tokenizer = load_hf_tokenizer(path)
        splits = tokenized_chats(chat_files(str(raw)), tokenizer, seq_len, truncate)
        windows = {name: list(pack_conversations(chats, seq_len, pad_id(tokenizer)))
                   for name, chats in splits.items()}
        return ChatSource(windows, {"tokenizer": str(path), "vocab_size": len(tokenizer),
                                    "seq_len": seq_len})

    return write_pack(CHAT_SET, src, out, source, shard_mb=shard_mb, force=force,
                      progress=progress, options=options)


def is_chat_set(data_dir: str | Path | None) -> bool:
    """Whether ``data_dir`` is a finished set of packed conversations."""
    return (data_dir is not None and is_packed(data_dir)
            and load_manifest(data_dir).workload == CHAT_SET)


def open_chat_set(data_dir: str | Path, seq_len: int, rows: int) -> tuple[Any, Any]:
    """The training stream and held-out windows of a packed chat set, checked against
    the run's ``seq_len`` and the ``rows`` of the model's embedding."""
    packed = open_packed(data_dir, CHAT_SET)
    assert packed is not None  # is_chat_set said so
    meta = packed.meta
    if meta.get("seq_len") != seq_len:
        raise UserError(f"--data-dir {data_dir} holds conversations packed into windows of "
                        f"{meta.get('seq_len')} tokens, not --seq-len {seq_len}: train with "
                        f"--seq-len {meta.get('seq_len')}, or pack them again with "
                        f"--seq-len {seq_len}.")
    if int(meta.get("vocab_size", 0)) > rows:
        raise UserError(f"--data-dir {data_dir} was packed with a tokenizer of "
                        f"{meta['vocab_size']} ids ({meta.get('tokenizer')}), more than the "
                        f"{rows} rows of the model's embedding. Pack it with the model's own "
                        "tokenizer.")
    return packed.train, packed.val

