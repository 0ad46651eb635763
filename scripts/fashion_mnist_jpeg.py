"""Write Fashion-MNIST as a JPEG class-folder tree, the layout image tutorials use.

Reads the IDX files of Debian's ``dataset-fashion-mnist`` package (or ``--idx-dir``) and
writes ``OUT/train/CLASS/NNNNN.jpg`` (60,000) and ``OUT/val/CLASS/NNNNN.jpg`` (10,000, the
test split): real 28x28 greyscale product photos, stored as JPEG (quality 90). With
``--shards`` the same samples, in the same order, also go to ``OUT-shards/`` as tar shards.

    python scripts/fashion_mnist_jpeg.py --out data/fashion-jpeg --limit 2000
    gpuflow train --workload images --data-dir data/fashion-jpeg --image-size 32
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from gpuflow.data.idx import find_split, read_idx
from gpuflow.data.image_sources import scan, shard_tree

DEFAULT_IDX = Path("/usr/share/datasets/fashion-mnist")
# Index-prefixed so that sorting the folder names keeps Fashion-MNIST's label numbers.
CLASSES = ("0-tshirt-top", "1-trouser", "2-pullover", "3-dress", "4-coat", "5-sandal",
           "6-shirt", "7-sneaker", "8-bag", "9-ankle-boot")


def jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def write_split(idx_dir: Path, prefix: str, out: Path, limit: int | None) -> int:
    """The first ``limit`` images of a split (all when None) as JPEG files by class."""
    images = read_idx(find_split(idx_dir, prefix, "images"))[:limit]
    labels = read_idx(find_split(idx_dir, prefix, "labels"))[:limit]
    for name in CLASSES:
        (out / name).mkdir(parents=True, exist_ok=True)
    for number, (pixels, label) in enumerate(zip(images, labels, strict=True)):
        (out / CLASSES[int(label)] / f"{number:05d}.jpg").write_bytes(jpeg(pixels))
    return len(labels)


def write_tree(out: Path, idx_dir: Path = DEFAULT_IDX, train: int | None = None,
               val: int | None = None) -> tuple[int, int]:
    """The train and val trees under ``out``; the counts written."""
    return (write_split(idx_dir, "train", out / "train", train),
            write_split(idx_dir, "t10k", out / "val", val))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--idx-dir", type=Path, default=DEFAULT_IDX)
    parser.add_argument("--limit", type=int, help="at most this many images per split")
    parser.add_argument("--shards", action="store_true", help="also write OUT-shards/")
    args = parser.parse_args(argv)
    counts = write_tree(args.out, args.idx_dir, args.limit, args.limit)
    print(f"wrote {counts[0]} training and {counts[1]} validation JPEGs under {args.out}")
    if args.shards:
        shards = args.out.with_name(args.out.name + "-shards")
        shard_tree(scan(args.out), shards)
        print(f"wrote the same samples as tar shards under {shards}")


if __name__ == "__main__":
    main()
