"""Atomic, verified checkpoints that restore a run exactly.

Layout: ``<run>/checkpoints/step-00000042/`` with ``trainer.pt`` (scheduler, scaler, RNG
states, data position, optimizer hyperparameters; tensors and plain containers only, loaded
with ``weights_only=True``), ``manifest.json`` (step, format version and the SHA-256 of
every file) and the weights and optimizer state in one of two layouts:

- full: ``model.safetensors`` (all weights) and the optimizer state inside ``trainer.pt``,
  written by one process;
- sharded: a ``torch.distributed.checkpoint`` folder ``state/`` that every rank writes its
  own shards into, in parallel, with no gathering; any world size or strategy reads it back.

A checkpoint is written into a hidden temporary folder, fsynced, then renamed into place:
a crash mid-save leaves no folder that looks valid.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuflow import storage
from gpuflow.errors import UserError

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
MANIFEST_FILE = "manifest.json"
STATE_DIR = "state"
PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def capture_rng_state() -> dict[str, Any]:
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss,
                  np_gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(item) for item in value)
    return value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, with tied (storage-sharing) entries copied apart for safetensors."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out


ADVICE = ("Free some space, keep fewer checkpoints (--keep-checkpoints 1), or train into "
          "another --run-dir on a larger disk. The earlier checkpoints are intact: "
          "--resume continues from the newest.")

# Every rank's view of a save, gathered by all of them so that all decide alike.
Gather = Callable[[Any], list[Any]]


class _HashingFile:
    """Hashes what passes through to ``handle``: the manifest records what was meant to be
    written, and reading the files back checks what the disk holds, in one read."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _write_hashed(path: Path, fill: Callable[[_HashingFile], object]) -> str:
    """Write ``path`` through ``fill`` with Python's file I/O, whose errors carry an errno
    (and where a test can fill the disk partway through the file); its SHA-256."""
    with path.open("wb") as handle:
        hashing = _HashingFile(handle)
        fill(hashing)
    return hashing.digest.hexdigest()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor],
                      metadata: dict[str, str]) -> str:
    """Serialize in memory (the weights' bytes once more in host memory), then write; the
    file's SHA-256."""
    from safetensors.torch import save  # imported when a checkpoint is written

    return _write_hashed(path, lambda file: file.write(save(_unshared(tensors),
                                                           metadata=metadata)))


def save_checkpoint(directory: Path, step: int, model_state: Mapping[str, torch.Tensor],
                    trainer_state: dict[str, Any], keep: int) -> Checkpoint:
    """Write a full checkpoint atomically and read it back; only then prune all but the
    newest ``keep``. A full or unwritable disk leaves no trace and raises one clear
    :class:`~gpuflow.errors.UserError`.

    ``model_state`` is the full (unsharded) state dict, so any strategy or world size can
    load it.
    """
    final = directory / f"{PREFIX}{step:08d}"
    tmp = directory / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    needed = storage.tensor_bytes(dict(model_state)) + storage.tensor_bytes(trainer_state)
    with storage.guarded(final, ADVICE, needed):
        try:
            _fresh_folder(directory, tmp)
            storage.ensure_room(directory, needed, ADVICE)
            digest = write_safetensors(tmp / MODEL_FILE, model_state, {"step": str(step)})
            _seal(directory, tmp, step, trainer_state, {MODEL_FILE: digest})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _prune(directory, keep)
    return Checkpoint(final, step)


def save_sharded_checkpoint(directory: Path, step: int, state: dict[str, Any],
                            trainer_state: dict[str, Any], keep: int, is_main: bool,
                            gather: Gather) -> Checkpoint:
    """Every rank writes its shards of ``state`` (a collective); rank 0 then seals it.

    ``state`` holds each rank's local view (DTensor shards under FSDP and TP, a stage's
    weights under pipelining); torch.distributed.checkpoint records how the pieces fit, so
    a different world size or strategy can read them back. ``gather`` (all_gather_object)
    makes every rank take the same decision at each phase: a full disk on any rank fails
    the save on all of them, before anything is written when the room is known to be short,
    and the previous checkpoint stays the newest.
    """
    import torch.distributed.checkpoint as dcp  # only distributed jobs pay for importing it

    final = directory / f"{PREFIX}{step:08d}"
    tmp = directory / f".tmp-{PREFIX}{step:08d}-sharded"
    own, shared = storage.shard_bytes(state)
    own += storage.tensor_bytes(trainer_state) if is_main else 0
    try:
        setup = _attempt(lambda: _fresh_folder(directory, tmp) if is_main else None, final)
        failed = next((error for error in gather(setup) if error is not None), None)
        if failed is None:  # the room, measured once killed saves' leftovers are gone
            views = gather((own, shared, storage.free_bytes(directory)))
            total = storage.sharded_save_bytes([view[:2] for view in views])
            if min(view[2] for view in views) < total:
                failed = storage.storage_error(errno.ENOSPC, final, total, ADVICE)
        if failed is None:
            with storage.guarded(final, ADVICE, total):
                dcp.save(state, storage_writer=_shard_writer(tmp / STATE_DIR))
            sealed = _attempt(lambda: _seal(directory, tmp, step, trainer_state, {})
                              if is_main else None, final)
            failed = next((error for error in gather(sealed) if error is not None), None)
        if failed is not None:
            raise failed
    except BaseException:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_main:
        _prune(directory, keep)
    return Checkpoint(final, step)


def _shard_writer(path: Path) -> Any:
    """torch.distributed.checkpoint's file writer, whose files report a full disk as a plain
    OSError: DCP pickles a rank's failure to the others, which drops the chained cause
    (torch.save's zip writer buries the OSError under a RuntimeError)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Files(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            try:
                with super().create_stream(path, mode) as stream:
                    yield stream
            except Exception as exc:
                code = storage.storage_errno(exc)
                if code is None:
                    raise
                raise OSError(code, os.strerror(code), str(path)) from exc

    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = Files()
    return writer


def _attempt(action: Callable[[], object], final: Path) -> Exception | None:
    """Run ``action`` on this rank; what it raised (a full disk as the clear message), for
    every rank to raise alike rather than wait for this one."""
    try:
        with storage.guarded(final, ADVICE):
            action()
    except Exception as exc:
        return exc
    return None


def _fresh_folder(directory: Path, tmp: Path) -> None:
    """An empty ``tmp``, once the temporary folders of saves killed midway are gone: never
    listed nor loaded, they would still take the room this save needs."""
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f".tmp-{PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir()


def _seal(directory: Path, tmp: Path, step: int, trainer_state: dict[str, Any],
          digests: dict[str, str]) -> None:
    """Add the trainer state and a manifest of checksums (``digests``: those of the files
    hashed as they were written), read everything back against them, then rename into
    place."""
    digests = {**digests, TRAINER_FILE: _write_hashed(
        tmp / TRAINER_FILE, lambda file: torch.save(trainer_state, file))}
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync_file(path)
        name = path.relative_to(tmp).as_posix()
        files[name] = digests.get(name) or _sha256(path)
    manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files,
                "layout": "sharded" if (tmp / STATE_DIR).is_dir() else "full",
                "created_unix": time.time()}
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    _fsync_file(tmp / MANIFEST_FILE)
    for folder in (tmp / STATE_DIR, tmp):
        if folder.is_dir():
            _fsync_dir(folder)
    try:
        verify_checkpoint(Checkpoint(tmp, step))
    except CheckpointError as exc:
        raise UserError(f"{exc} when read back: the disk did not keep what was written. Check "
                        "it, or train into another --run-dir; the earlier checkpoints are "
                        "intact.") from None
    final = directory / f"{PREFIX}{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(directory)


def _prune(directory: Path, keep: int) -> None:
    """Called only once the new checkpoint is in place and read back, so a failing save
    never leaves fewer good checkpoints than before."""
    for stale in list_checkpoints(directory)[keep:]:
        shutil.rmtree(stale.path, ignore_errors=True)


def list_checkpoints(directory: Path) -> list[Checkpoint]:
    """Finished checkpoints, newest first (temporary folders are never listed)."""
    found = []
    for path in directory.glob(f"{PREFIX}*"):
        try:
            found.append(Checkpoint(path, int(path.name[len(PREFIX):])))
        except ValueError:
            continue
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify_checkpoint(checkpoint: Checkpoint) -> dict[str, Any]:
    """Check the manifest and every file's checksum; return the manifest."""
    manifest_path = checkpoint.path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint.path}: unreadable manifest ({exc})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{checkpoint.path}: format version {manifest.get('format_version')} is not "
            f"{FORMAT_VERSION}"
        )
    for name, expected in manifest.get("files", {}).items():
        path = checkpoint.path / name
        if not path.is_file():
            raise CheckpointError(f"{checkpoint.path}: {name} is missing")
        if _sha256(path) != expected:
            raise CheckpointError(f"{checkpoint.path}: {name} fails its checksum (corrupt)")
    return manifest


def is_sharded(checkpoint: Checkpoint) -> bool:
    return (checkpoint.path / STATE_DIR).is_dir()


def load_trainer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    return torch.load(checkpoint.path / TRAINER_FILE, weights_only=True, map_location="cpu")


def load_checkpoint(checkpoint: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model state and the trainer state (with the full
    optimizer state), whichever layout the checkpoint has.

    A sharded checkpoint is assembled in this process's memory: right for export, serving
    and one-process resumes; distributed resumes read their own shards instead.
    """
    trainer_state = load_trainer_state(checkpoint)
    if not is_sharded(checkpoint):
        from safetensors.torch import load_file

        return load_file(str(checkpoint.path / MODEL_FILE)), trainer_state
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    full = _load_state_dict_from_keys(checkpoint_id=str(checkpoint.path / STATE_DIR))
    trainer_state["optimizer"] = {"state": full["optimizer"],
                                  "param_groups": trainer_state["optimizer"]["param_groups"]}
    return full["model"], trainer_state


def with_saved_settings(saved: list[dict[str, Any]], current: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:
    """The current param groups' parameters with a checkpoint's settings (learning rate,
    weight decay and the like), matched by group name: how a group splits into DTensor and
    plain parts differs between strategies. Checkpoints without names match by position."""
    named = {group.get("name"): group for group in saved}
    if None in named:
        pairs = list(zip(saved, current, strict=True))
    else:
        pairs = [(named[group["name"]], group) for group in current]
    return [{**settings, "params": group["params"]} for settings, group in pairs]


def latest_verified(directory: Path) -> Checkpoint | None:
    """Newest checkpoint whose files match their checksums; a corrupt one is reported and
    skipped."""
    for checkpoint in list_checkpoints(directory):
        try:
            verify_checkpoint(checkpoint)
            return checkpoint
        except (CheckpointError, OSError) as exc:
            warnings.warn(f"Skipping checkpoint: {exc}. Trying the previous one.", stacklevel=2)
    return None


def load_latest(directory: Path
                ) -> tuple[Checkpoint, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest verified checkpoint with its full model and trainer state."""
    checkpoint = latest_verified(directory)
    return None if checkpoint is None else (checkpoint, *load_checkpoint(checkpoint))
