"""Writes that meet a full or read-only disk end in one clear message, not a traceback.

Every writer of a run dir, a packed set or an export checks for room before it starts
(:func:`ensure_room`) and runs inside :func:`guarded`, which turns an out-of-space or
permission error (from Python, torch.distributed.checkpoint or a Rust writer's
``(os error 28)``) into a :class:`~gpuflow.errors.UserError` naming the path, the bytes
needed and free, and what to do; the CLI prints it and exits 2.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gpuflow.errors import UserError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_RUST_OS_ERROR = re.compile(r"os error (\d+)")


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing
    folder)."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists and tuples): what saving it
    writes, give or take headers."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def shard_bytes(state: Any) -> tuple[int, dict[str, int]]:
    """What this rank writes of ``state`` in a torch.distributed.checkpoint save, which
    writes every piece once, however many ranks hold it: the bytes of this rank's DTensor
    shards (of a shard replicated over some mesh dimensions, the copy at coordinate 0 of
    them), and its plain tensors by key, for the ranks to count each key once between
    them. Counting global sizes on every rank would ask FSDP's N ranks for N times the
    room."""
    from torch.distributed.tensor import DTensor

    own, shared = 0, {}
    for key, tensor in _tensors(state, ""):
        if not isinstance(tensor, DTensor):
            shared[key] = tensor_bytes(tensor)
            continue
        coordinate = tensor.device_mesh.get_coordinate()
        if coordinate is not None and all(
                placement.is_shard() or index == 0
                for placement, index in zip(tensor.placements, coordinate, strict=True)):
            own += tensor_bytes(tensor.to_local())
    return own, shared


def sharded_save_bytes(views: Sequence[tuple[int, dict[str, int]]]) -> int:
    """The bytes a sharded save writes over all ranks, from each rank's
    :func:`shard_bytes`: every rank's own shards, and each plain tensor's key once."""
    shared = {key: size for _, by_key in views for key, size in by_key.items()}
    return sum(own for own, _ in views) + sum(shared.values())

def _tensors(value: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict | list | tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for name, item in items:
            yield from _tensors(item, f"{key}.{name}" if key else str(name))


def storage_errno(exc: BaseException) -> int | None:
    """The out-of-space or permission errno behind ``exc``, if one is: in it, in its cause or
    context, in a torch.distributed.checkpoint failure of some rank, or in the text of a Rust
    writer's error (safetensors)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE | NOT_WRITABLE:
            return current.errno
        found = _RUST_OS_ERROR.search(str(current))
        if found and int(found.group(1)) in NO_SPACE | NOT_WRITABLE:
            return int(found.group(1))
        failures = getattr(current, "failures", None)  # DCP's CheckpointException, by rank
        for failure in failures.values() if isinstance(failures, dict) else ():
            wrapped = failure[0] if isinstance(failure, tuple) else failure  # (exc, traceback)
            if isinstance(wrapped, BaseException):
                pending.append(wrapped)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def storage_error(code: int, path: Path, needed: int | None, advice: str) -> UserError:
    """The one message for ``code`` while writing ``path``."""
    if code in NOT_WRITABLE:
        return UserError(f"Cannot write {path}: {errno.errorcode.get(code, code)} "
                         f"(permission denied or a read-only file system). {advice}")
    need = f"it needs {_size(needed)}, " if needed is not None else ""
    return UserError(f"No space left on the disk holding {path}: {need}"
                     f"{_size(free_bytes(path))} free. {advice}")


def ensure_room(path: Path, needed: int, advice: str) -> None:
    """Refuse, before writing anything, when ``needed`` bytes do not fit where ``path``
    goes."""
    if free_bytes(path) < needed:
        raise storage_error(errno.ENOSPC, path, needed, advice)


@contextmanager
def guarded(path: Path, advice: str, needed: int | None = None) -> Iterator[None]:
    """Turn a full disk or a denied write in the block into :func:`storage_error`'s
    message; any other error passes through unchanged."""
    try:
        yield
    except UserError:
        raise
    except BaseException as exc:  # DCP's CheckpointException is not an Exception
        code = storage_errno(exc)
        if code is None:
            raise
        raise storage_error(code, path, needed, advice) from None


def _size(count: int | None) -> str:
    count = count or 0
    return f"{count:,} bytes" + (f" ({count / 2**20:,.1f} MiB)" if count >= 2**20 else "")
