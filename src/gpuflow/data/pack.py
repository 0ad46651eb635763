"""Convert a workload's data set into a packed set of shards (see ``gpuflow.data.manifest``).

The workload's source (``gpuflow.data.pack_sources``) decides the set's kind: text becomes
token shards, any other workload's items tensor records. Memory stays bounded whatever the
corpus: text is read from its files a chunk at a time straight into the shard being written,
and records one at a time from lazy splits (the built-in image and audio readers' own, or a
user workload's datasets as given). Packing is resumable: each finished shard is recorded
in a hidden state file as soon as it is renamed into place, and a rerun with the same
settings keeps the shards that still match their checksums and continues after them. The
manifest is written last, so a folder with a manifest is a finished set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuflow import storage
from gpuflow.data.manifest import (
    EXAMPLE_FILE,
    FORMAT_VERSION,
    MANIFEST,
    PACK_STATE,
    Manifest,
    is_packed,
    write_manifest,
)
from gpuflow.data.pack_progress import Mode, PackProgress
from gpuflow.data.pack_sources import PackSource
from gpuflow.data.pack_state import PackState
from gpuflow.errors import UserError

DEFAULT_SHARD_MB = 64
ADVICE = ("Free some space or pack into another --out on a larger disk; the same command "
          "continues after the shards already finished.")

# A workload's data from its raw --data-dir (None: its default), ready to pack.
SourceOf = Callable[[str, str | None], PackSource]


def _prepare_out(out: Path, force: bool) -> None:
    """Refuse to overwrite a finished set or to write among foreign files."""
    if is_packed(out):
        if not force:
            raise UserError(f"--out {out} already holds a finished packed set; add --force to "
                            "pack it again.")
        old = json.loads((out / MANIFEST).read_text())
        listed = [s["file"] for split in old.get("splits", {}).values() for s in split]
        for name in [*listed, EXAMPLE_FILE, MANIFEST, PACK_STATE]:
            (out / name).unlink(missing_ok=True)
    elif force:
        (out / PACK_STATE).unlink(missing_ok=True)
    elif out.is_dir() and any(out.iterdir()) and not (out / PACK_STATE).is_file():
        raise UserError(f"--out {out} is not empty and holds no packed set; choose a new or "
                        "empty folder.")
    out.mkdir(parents=True, exist_ok=True)


def write_pack(workload: str, src: str | Path | None, out: str | Path, source_of: SourceOf,
               shard_mb: float = DEFAULT_SHARD_MB, force: bool = False,
               progress: bool | Mode = True,
               options: Mapping[str, Any] | None = None) -> Manifest:
    """Pack ``workload``'s data from ``src`` (its raw --data-dir; None: its default) into
    ``out``, continuing an interrupted pack of the same settings. The data comes from
    ``source_of`` (``gpuflow.workloads.packing`` finds it by the workload's name).
    ``progress``: a live bar (True or "bar"), a line per shard ("lines"), or nothing
    (False or "off"). ``options`` are the source's own settings (e.g. images' ``max_side``):
    a rerun continues only a pack of the same ones."""
    out = Path(out)
    source = None if src is None else str(Path(src).resolve())
    if source is not None and is_packed(source):
        raise UserError(f"{src} is already a packed set; train from it with --data-dir.")
    shard_bytes = max(1, int(shard_mb * 2**20))
    settings = {"workload": workload, "source": source, "shard_bytes": shard_bytes,
                "format_version": FORMAT_VERSION, **({"options": dict(options)} if options
                                                     else {})}
    mode: Mode = "bar" if progress is True else "off" if progress is False else progress
    with storage.guarded(out, ADVICE):
        storage.ensure_room(out, shard_bytes, ADVICE)  # room for one shard, at least
        _prepare_out(out, force)
        state = PackState.resume(out, settings)
        try:
            with PackProgress(mode) as report:
                manifest = source_of(workload, source).pack(out, state, shard_bytes, report)
            manifest.source, manifest.shard_bytes = source, shard_bytes
            write_manifest(out, manifest)
        except BaseException:
            for partial in out.glob(".*.tmp"):  # finished shards stay, for a rerun
                partial.unlink(missing_ok=True)
            raise
    state.path.unlink()
    return manifest
