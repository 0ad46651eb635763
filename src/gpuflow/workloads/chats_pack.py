"""Conversations into a packed set: ``gpuflow data pack CHATS --workload hf:DIR``.

The conversations are rendered and packed into windows of ``--seq-len`` positions exactly as
training packs them in memory (``gpuflow.workloads.chat_windows``), then written as records
of ``((ids, positions), targets)`` int32 tensors, one window each, through the record packer:
same manifest, checksums and resume. Worker processes render and tokenize the lines
(``gpuflow.workloads.chat_render``; one per core, as text packing chooses) and hand the
conversations back in file order; each window is written as soon as it is complete, so
memory holds the chunks in flight and a window, never the chat set. Each split is one
streaming pass over the files (the record packer writes a split at a time, and the pack
state counts the windows each has finished); a rerun of the same command renders again the
windows of the finished shards and skips them. The total is known only at the end, so the
progress reports windows so far. The manifest names the workload ``hf`` and records the
tokenizer, its vocabulary and the window length, which ``--workload hf:DIR`` checks before
training on the set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from gpuflow.data.manifest import Manifest, is_packed, load_manifest
from gpuflow.data.pack import write_pack
from gpuflow.data.pack_progress import Mode, PackProgress
from gpuflow.data.pack_sources import record_manifest, write_records
from gpuflow.data.pack_state import PackState
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.model_dir import load_hf_tokenizer
from gpuflow.workloads.chat_render import chat_renderer
from gpuflow.workloads.chat_windows import Window, pack_conversations
from gpuflow.workloads.chats import chat_files, pad_id
from gpuflow.workloads.text_tokens import default_workers

CHAT_SET = "hf"  # the workload a packed chat set's manifest names
EXAMPLE_WINDOWS = 4
SPLITS = ("train", "val")


@dataclass(frozen=True)
class ChatSource:
    """A chat set's files, rendered under model directory ``directory`` by ``workers``
    processes and written window by window as records."""

    files: list[Path]
    directory: Path
    seq_len: int
    truncate: bool
    pad_id: int
    workers: int
    meta: dict[str, Any]
    workload: str = CHAT_SET

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        first: list[Window] = []
        with chat_renderer(self.directory, self.seq_len, self.truncate,
                           self.workers) as rendered:
            for split in SPLITS:
                done, shards = state.done(split)
                progress.begin(split, None, "windows", done, shards)
                with closing(rendered(self.files, split)) as chats:
                    windows = pack_conversations(chats, self.seq_len, self.pad_id)
                    if split == "train":
                        windows = _noting(windows, first)
                    write_records(out, split, islice(windows, done, None), state,
                                  shard_bytes, progress)
                if not first:
                    raise UserError(f"{self.files[0].parent} holds no training "
                                    "conversations.")
        example = ([torch.stack([inputs[i] for inputs, _ in first]) for i in range(2)],
                   torch.stack([target for _, target in first]))
        manifest = record_manifest(out, self.workload, state, first[0], example)
        manifest.meta = dict(self.meta)
        return manifest


def _noting(windows: Iterable[Window], first: list[Window]) -> Iterator[Window]:
    """``windows``, keeping the first ``EXAMPLE_WINDOWS`` in ``first`` (the example batch)."""
    for window in windows:
        if len(first) < EXAMPLE_WINDOWS:
            first.append(window)
        yield window


def pack_chats(directory: str | Path, src: str | Path, out: str | Path, seq_len: int,
               truncate: bool, shard_mb: float, force: bool,
               progress: bool | Mode, workers: int | None = None) -> Manifest:
    """Pack the conversations of ``src`` under the tokenizer and chat template of model
    directory ``directory`` into windows of ``seq_len`` positions, in ``out``, rendered by
    ``workers`` processes (default: one per core; 0: in this process; the set does not
    depend on it)."""
    path = Path(directory).expanduser().resolve()
    options = {"tokenizer": str(path), "seq_len": seq_len, "truncate_chats": truncate}
    if workers is not None and workers < 0:
        raise UserError(f"--workers must be 0 (render in the packing process) or more "
                        f"(got {workers}).")

    def source(_workload: str, raw: str | None) -> ChatSource:
        tokenizer = load_hf_tokenizer(path)
        return ChatSource(chat_files(str(raw)), path, seq_len, truncate, pad_id(tokenizer),
                          default_workers() if workers is None else workers,
                          {"tokenizer": str(path), "vocab_size": len(tokenizer),
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

