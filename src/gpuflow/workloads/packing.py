"""Pack a workload's data set, found by its name (``gpuflow data pack --workload NAME``).

The shard writing is ``gpuflow.data.pack``'s; this module only knows where a workload's
items come from, so that ``data`` never imports the workloads it stores.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gpuflow.data.manifest import Manifest
from gpuflow.data.pack import DEFAULT_SHARD_MB, write_pack
from gpuflow.data.pack_progress import Mode
from gpuflow.data.pack_sources import PackSource, RecordSource
from gpuflow.errors import UserError
from gpuflow.model_dir import ModelDirectory
from gpuflow.workload import resolve_workload
from gpuflow.workloads.chats import chat_files
from gpuflow.workloads.chats_pack import pack_chats
from gpuflow.workloads.hf_dir import window_length

# Built-in workloads that read their raw data for packing otherwise than for training
# (lazily, or as text for token shards): "module:function" taking the raw --data-dir.
PACK_SOURCES: dict[str, str] = {"images": "gpuflow.workloads.images_pack:pack_source",
                                "mnist-idx": "gpuflow.workloads.mnist_idx:pack_source",
                                "speech": "gpuflow.workloads.speech:pack_source",
                                "textlm": "gpuflow.workloads.textlm:pack_source"}


def workload_source(workload: str, src: str | None,
                    options: Mapping[str, Any] | None = None) -> PackSource:
    """A workload's data from ``src``: its own pack source where it has one (given
    ``options``, e.g. images' ``max_side``), else the train/val items of the datasets its
    factory builds (lazy or not, as the workload wrote them)."""
    options = dict(options or {})
    if workload in PACK_SOURCES:
        module, _, name = PACK_SOURCES[workload].partition(":")
        source = getattr(importlib.import_module(module), name)
        unknown = set(options) - set(inspect.signature(source).parameters)
        if not unknown:
            return source(src, **options)
    if options:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(options))
        raise UserError(f"{flags}: not an option of packing workload {workload!r}.")
    built = resolve_workload(workload, {} if src is None else {"data_dir": src})
    splits: dict[str, Sequence[Any]] = {"train": built.train_dataset}  # type: ignore[dict-item]
    if built.val_dataset is not None:
        splits["val"] = built.val_dataset  # type: ignore[assignment]
    return RecordSource(built.name, splits, built.get_example_batch())


def pack(workload: str, src: str | Path | None, out: str | Path,
         shard_mb: float = DEFAULT_SHARD_MB, force: bool = False,
         progress: bool | Mode = True, max_side: int | None = None,
         tokenizer: str | Path | None = None, text_field: str | None = None,
         workers: int | None = None, seq_len: int | None = None,
         truncate_chats: bool = False) -> Manifest:
    """Pack ``workload``'s data from ``src`` (its raw --data-dir; None: its default) into
    ``out``, continuing an interrupted pack of the same settings. ``progress``: a live bar
    (True or "bar"), a line per shard ("lines"), or nothing (False or "off"). ``max_side``
    (images): re-encode larger photos to that many pixels on their longer side.
    ``tokenizer`` (textlm): a model directory whose tokenizer turns the text (files, or the
    ``text_field`` of JSONL lines) into token ids, in ``workers`` processes (default: one
    per core; the set does not depend on it). ``hf:DIR`` packs text as textlm does under
    DIR's tokenizer, the set ``--workload hf:DIR`` trains on; a ``src`` of JSONL
    conversations becomes windows of ``seq_len`` tokens (default: the model's, as training
    takes it), a longer conversation refused or cut (``truncate_chats``), rendered in
    ``workers`` processes as text is tokenized."""
    if workload.startswith("hf:"):
        if tokenizer is not None:
            raise UserError("--workload hf:DIR packs text under DIR's own tokenizer: drop "
                            "--tokenizer.")
        workload, tokenizer = "textlm", workload.removeprefix("hf:")
        if src is not None and chat_files(src):
            return _pack_chats(tokenizer, src, out, seq_len, truncate_chats, shard_mb, force,
                               progress, workers)
    if seq_len is not None or truncate_chats:
        raise UserError("--seq-len and --truncate-chats apply to conversations packed with "
                        "--workload hf:DIR only.")
    given = {"max_side": max_side, "text_field": text_field,
             "tokenizer": None if tokenizer is None else str(Path(tokenizer).resolve())}
    options = {name: value for name, value in given.items() if value is not None}
    source_options = options if workers is None else {**options, "workers": workers}
    return write_pack(workload, src, out, partial(workload_source, options=source_options),
                      shard_mb=shard_mb, force=force, progress=progress, options=options)


def _pack_chats(directory: str, src: str | Path, out: str | Path, seq_len: int | None,
                truncate: bool, shard_mb: float, force: bool,
                progress: bool | Mode, workers: int | None) -> Manifest:
    model_dir = ModelDirectory.check(Path(directory).expanduser().resolve(), weights=False)
    return pack_chats(directory, src, out, window_length(model_dir, seq_len), truncate,
                      shard_mb, force, progress, workers)
