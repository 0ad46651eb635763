"""Encoded images to uint8 batches: read, decode and crop in the loader's workers.

Training items are the encoded bytes; the workload's ``augment`` (a ``TrainCrops``, called
with the generator of (seed, epoch, index)) decodes each one with a RandomResizedCrop and a
flip, so augmented batches resume exactly and do not depend on the number of workers.
Validation items are decoded with the centre crop. Pixels stay uint8 NHWC until the device,
where the model's input layer converts and normalises them (``gpuflow.models.pixels``).

A file that does not decode is skipped: its item carries no pixels, the collate leaves it
out of the batch, and ``DataIssues`` counts it across worker processes and keeps the first
one's name; under ``strict`` it stops the run with its path instead.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuflow.data.image_decode import (
    ImageDecodeError,
    centre_crop,
    decode_crop,
    random_resized_crop,
)
from gpuflow.data.image_sources import ImageRef
from gpuflow.errors import UserError

Encoded = tuple[str, bytes]  # a sample's name (path or shard:key) and its bytes
# The same in a packed record, which holds tensors only: name and bytes as uint8 [N].
PackedEncoded = tuple[torch.Tensor, torch.Tensor]
Item = tuple[torch.Tensor | None, int]
NAME_BYTES = 1024


def ref_name(ref: ImageRef) -> str:
    return ref.path if ref.size < 0 else f"{ref.path}:{ref.key}{ref.suffix}"


class StrictDataError(UserError):
    """``--strict-data``'s stop at a file that does not decode.

    A loader worker's exception reaches the training process rebuilt from a message that
    holds the worker's traceback; this keeps only the message, for the CLI to print.
    """

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class DataIssues:
    """Files skipped for not decoding, counted across loader worker processes (shared
    memory made before the workers start), with the first one's name and error."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._count = multiprocessing.Value("q", 0)
        self._first = multiprocessing.Array("c", NAME_BYTES)

    def skip(self, name: str, error: ImageDecodeError) -> None:
        if self.strict:
            raise StrictDataError(f"{name}: {error}. Remove or replace the file, or train "
                                  "without --strict-data to skip such files (they are "
                                  "counted).")
        with self._count.get_lock():
            if self._count.value == 0:
                self._first.value = f"{name}: {error}".encode()[:NAME_BYTES - 1]
            self._count.value += 1

    def report(self) -> dict[str, Any]:
        """For the run's summary: how many files were skipped, and the first."""
        return {"skipped_files": int(self._count.value),
                "first_skipped": self._first.value.decode(errors="replace") or None}


class EncodedImages(Dataset):
    """Item ``i``: ``((name, encoded bytes), class index)``, read on access."""

    def __init__(self, refs: Sequence[ImageRef]) -> None:
        self.refs = list(refs)

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> tuple[Encoded, int]:
        ref = self.refs[index]
        return (ref_name(ref), ref.read()), ref.label


def as_encoded(part: Encoded | PackedEncoded) -> Encoded:
    """A sample's name and bytes, read from a file or from a packed record."""
    name, data = part
    if isinstance(data, torch.Tensor):
        return bytes(name.numpy()).decode(), data.numpy().tobytes()
    return part  # type: ignore[return-value]


def _decoded(issues: DataIssues, name: str, data: bytes, box_fn: Any, size: int,
             mode: str) -> np.ndarray | None:
    try:
        return decode_crop(data, box_fn, size, mode)
    except ImageDecodeError as exc:
        issues.skip(name, exc)
        return None


class TrainCrops:
    """The training transform: a RandomResizedCrop to ``size`` and a horizontal flip, both
    drawn from the sample's generator; a ``Workload.augment``."""

    def __init__(self, size: int, mode: str, issues: DataIssues) -> None:
        self.size, self.mode, self.issues = size, mode, issues

    def __call__(self, item: tuple[Encoded | PackedEncoded, int],
                 rng: np.random.Generator) -> Item:
        (name, data), label = as_encoded(item[0]), int(item[1])
        box_fn = partial(random_resized_crop, rng=rng)
        pixels = _decoded(self.issues, name, data, box_fn, self.size, self.mode)
        if pixels is not None and rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        return (None if pixels is None else torch.from_numpy(np.ascontiguousarray(pixels)),
                label)


class EvalImages(Dataset):
    """Encoded images (from files or a packed set) decoded with the centre crop, for
    validation and examples."""

    def __init__(self, images: Dataset, size: int, mode: str,
                 issues: DataIssues) -> None:
        self.images, self.size, self.mode, self.issues = images, size, mode, issues

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Item:
        part, label = self.images[index]
        (name, data), label = as_encoded(part), int(label)
        pixels = _decoded(self.issues, name, data, centre_crop, self.size, self.mode)
        return (None if pixels is None else torch.from_numpy(pixels), label)


def nothing_decoded(count: int, issues: DataIssues | None) -> UserError:
    """The stop when not one image of a batch of ``count`` decoded."""
    first = issues.report()["first_skipped"] if issues is not None else None
    return UserError(f"None of the {count} images of a batch could be decoded "
                     f"(the first file skipped: {first}); check the data directory.")


def collate_images(items: Sequence[Item], issues: DataIssues | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[B, H, W, C]`` pixels and int64 labels; items that did not decode are left
    out (a batch is smaller by as many)."""
    kept = [(pixels, label) for pixels, label in items if pixels is not None]
    if not kept:
        raise nothing_decoded(len(items), issues)
    return (torch.stack([pixels for pixels, _ in kept]),
            torch.tensor([label for _, label in kept], dtype=torch.int64))
