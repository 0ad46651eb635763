"""``gpuflow data pack --workload images``: the encoded files as record shards.

Each record is a file's encoded bytes (a 1-D uint8 tensor) and its class index: the pack
moves files, not decoded pixels, so it is about as large as the source and training still
decodes and crops per epoch. The training split is written in a seeded permutation (a class-
folder tree lists its files class by class; shards must not). ``max_side`` re-encodes each
photo whose longer side is above it to that side (JPEG, quality 90): most of a large photo's
decode time buys pixels a training crop throws away. The class names go to the manifest.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from gpuflow.data.image_batches import (
    DataIssues,
    EvalImages,
    PackedEncoded,
    collate_images,
    ref_name,
)
from gpuflow.data.image_decode import ImageDecodeError, open_image
from gpuflow.data.image_sources import ImageRef, scan
from gpuflow.data.manifest import Manifest
from gpuflow.data.pack_progress import PackProgress
from gpuflow.data.pack_sources import RecordSource
from gpuflow.data.pack_state import PackState
from gpuflow.errors import UserError

PACK_SEED = 0
REENCODE_QUALITY = 90
EXAMPLE_ITEMS, EXAMPLE_SIZE = 2, 64


def reencoded(data: bytes, max_side: int) -> bytes:
    """The image upright and at most ``max_side`` pixels a side, as JPEG; bytes that do not
    decode are kept as they are (training skips and counts them)."""
    try:
        image = open_image(data)
        if max(image.size) <= max_side:
            return data
        image.draft("RGB", (max_side, max_side))  # a reduced-size decode where it suffices
        image = ImageOps.exif_transpose(image)
        image = image.convert("L" if image.mode in ("L", "I;16") else "RGB")
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    except (ImageDecodeError, OSError, ValueError, SyntaxError):
        return data
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=REENCODE_QUALITY)
    return buffer.getvalue()


class PackItems(Sequence):
    """Item ``i``: ``((name, encoded bytes), class index)``, name and bytes as uint8
    tensors, re-encoded on access when ``max_side`` is given."""

    def __init__(self, refs: Sequence[ImageRef], max_side: int | None) -> None:
        self.refs, self.max_side = list(refs), max_side

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> tuple[PackedEncoded, int]:  # type: ignore[override]
        ref = self.refs[index]
        data = ref.read()
        if self.max_side is not None:
            data = reencoded(data, self.max_side)
        return (_tensor(ref_name(ref).encode()), _tensor(data)), ref.label


def _tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


@dataclass(frozen=True)
class ImagePackSource:
    """A record source that also names the classes in the manifest."""

    records: RecordSource
    classes: list[str]
    workload: str = "images"

    def pack(self, out: Path, state: PackState, shard_bytes: int,
             progress: PackProgress) -> Manifest:
        manifest = self.records.pack(out, state, shard_bytes, progress)
        manifest.meta = {**manifest.meta, "classes": self.classes}
        return manifest


def pack_source(data_dir: str | None, max_side: int | None = None) -> ImagePackSource:
    """The images under ``data_dir`` (class folders or tar shards), ready to pack."""
    if data_dir is None:
        raise UserError("gpuflow data pack --workload images needs SRC: a class-folder tree "
                        "or a folder of tar shards.")
    if max_side is not None and max_side < 8:
        raise UserError(f"--max-side {max_side}: give at least 8 pixels.")
    splits = scan(data_dir)
    order = np.random.default_rng(PACK_SEED).permutation(len(splits.train))
    train = PackItems([splits.train[i] for i in order], max_side)
    example_source = EvalImages(train, EXAMPLE_SIZE, "RGB", DataIssues())
    example = collate_images([example_source[i] for i in range(min(EXAMPLE_ITEMS, len(train)))])
    parts = {"train": train}
    if splits.val:
        parts["val"] = PackItems(splits.val, max_side)
    return ImagePackSource(RecordSource("images", parts, example), splits.classes)
