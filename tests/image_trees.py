"""Image trees for the images tests: crops of scikit-learn's two shipped photos, as files.

Class ``china`` holds crops of ``china.jpg``, class ``flower`` crops of ``flower.jpg``: real
photographs, told apart easily enough that a tiny network overfits them in a few steps.
Files come in every format and mode the workload reads (JPEG with EXIF orientation, CMYK
JPEG, palette PNG, greyscale PNG, RGBA WebP); ``bomb_png`` makes a decompression bomb.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SKLEARN_IMAGES = Path(__import__("sklearn").__file__).parent / "datasets" / "images"
PER_CLASS = 24
FORMATS = (("JPEG", ".jpg", "RGB"), ("JPEG", ".jpg", "CMYK"), ("PNG", ".png", "P"),
           ("PNG", ".png", "L"), ("WEBP", ".webp", "RGBA"), ("JPEG", ".jpg", "RGB"))


def photo(name: str) -> Image.Image:
    """``china`` or ``flower``: a 640x427 colour photograph."""
    with Image.open(SKLEARN_IMAGES / f"{name}.jpg") as image:
        return image.convert("RGB")


def encode(image: Image.Image, fmt: str, mode: str, exif_orientation: int | None = None
           ) -> bytes:
    buffer = io.BytesIO()
    extra = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        extra["exif"] = exif.tobytes()
    image.convert(mode).save(buffer, fmt, quality=90, **extra)
    return buffer.getvalue()


def write_photo_tree(root: Path, per_class: int = PER_CLASS, seed: int = 0) -> Path:
    """``root/CLASS/NNN.ext``: random crops (40-160 px) of each photo, every format."""
    rng = np.random.default_rng(seed)
    for name in ("china", "flower"):
        source = photo(name)
        (root / name).mkdir(parents=True, exist_ok=True)
        for number in range(per_class):
            side = int(rng.integers(40, 161))
            left = int(rng.integers(0, source.width - side))
            top = int(rng.integers(0, source.height - side))
            crop = source.crop((left, top, left + side, top + int(side * 0.8)))
            fmt, suffix, mode = FORMATS[number % len(FORMATS)]
            (root / name / f"{number:03d}{suffix}").write_bytes(encode(crop, fmt, mode))
    return root


def bomb_png(width: int, height: int) -> bytes:
    """A PNG header declaring ``width`` x ``height`` pixels, with almost no data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture(scope="session")
def photo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_photo_tree(tmp_path_factory.mktemp("photos") / "tree")
