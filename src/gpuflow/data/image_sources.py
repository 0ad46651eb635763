"""Where encoded images live: a class-folder tree, or tar shards of ``key.jpg`` + ``key.cls``.

Both layouts index into the same thing, a list of ``ImageRef`` (a file, or a byte range of a
shard), so one dataset reads either by random access, and a tree and the shards written from
it (``write_shards``) give the same samples in the same order. A sample's key is its path
relative to the split's root without the suffix (``3/000123``); a tree or shard set without
``train``/``val`` subfolders is split by a stable hash of the key, the same in both layouts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuflow.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
CLASSES_FILE = "classes.json"
LABEL_SUFFIX = ".cls"


@dataclass(frozen=True)
class ImageRef:
    """One sample: its key, class index, file suffix, and bytes ``[offset, offset + size)``
    of ``path`` (``size`` -1: the whole file)."""

    key: str
    label: int
    suffix: str
    path: str
    offset: int = 0
    size: int = -1

    def read(self) -> bytes:
        with open(self.path, "rb") as file:
            if self.size < 0:
                return file.read()
            return os.pread(file.fileno(), self.size, self.offset)


@dataclass(frozen=True)
class ImageSplits:
    """The class names and each split's samples."""

    classes: list[str]
    train: list[ImageRef]
    val: list[ImageRef]
    layout: str  # "folders" or "shards"


def in_val(key: str, val_percent: float) -> bool:
    """A stable split: the key's SHA-1 in [0, 100) below ``val_percent``."""
    digest = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")
    return digest % 10_000 < val_percent * 100


def _class_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _tree_refs(root: Path, classes: Sequence[str]) -> list[ImageRef]:
    index = {name: i for i, name in enumerate(classes)}
    refs = []
    for name in _class_dirs(root):
        if name not in index:
            raise UserError(f"{root / name}: a class folder that the training tree does not "
                            f"have; the classes are {', '.join(classes)}.")
        for path in sorted((root / name).rglob("*")):
            if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
                key = path.relative_to(root).with_suffix("").as_posix()
                refs.append(ImageRef(key, index[name], path.suffix.lower(), str(path)))
    return refs


def _shard_refs(shards: Iterable[Path], classes: Sequence[str]) -> list[ImageRef]:
    refs = []
    for shard in shards:
        images: dict[str, tarfile.TarInfo] = {}
        labels: dict[str, int] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, dot, suffix = member.name.rpartition(".")
                if not member.isfile() or not dot:
                    continue
                if "." + suffix.lower() in IMAGE_SUFFIXES:
                    images[key] = member
                elif "." + suffix == LABEL_SUFFIX:
                    labels[key] = int(tar.extractfile(member).read())  # type: ignore[union-attr]
        for key, member in images.items():
            if key not in labels or not 0 <= labels[key] < len(classes):
                raise UserError(f"{shard}: sample {key!r} has no {LABEL_SUFFIX} member holding "
                                f"a class index below {len(classes)}.")
            suffix = "." + member.name.rpartition(".")[2].lower()
            refs.append(ImageRef(key, labels[key], suffix, str(shard), member.offset_data,
                                 member.size))
    return refs


def _shard_classes(root: Path) -> list[str]:
    path = root / CLASSES_FILE
    if not path.is_file():
        raise UserError(f"{root} holds tar shards but no {CLASSES_FILE} naming the classes "
                        '(a JSON list, e.g. ["cat", "dog"]); write one beside the shards.')
    classes = json.loads(path.read_text())
    if not isinstance(classes, list) or not classes:
        raise UserError(f"{path} must hold a non-empty JSON list of class names.")
    return [str(name) for name in classes]


def _hash_split(refs: list[ImageRef], val_percent: float) -> tuple[list[ImageRef],
                                                                   list[ImageRef]]:
    val = [ref for ref in refs if in_val(ref.key, val_percent)]
    held = {ref.key for ref in val}
    return [ref for ref in refs if ref.key not in held], val


def scan(root: str | Path, val_percent: float = 10.0) -> ImageSplits:
    """The samples under ``root``: tar shards (``*.tar``, with ``classes.json``) or class
    folders, each either in ``train/`` and ``val/`` or split by key hash."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--data-dir {root} is not a directory.")
    split_dirs = (root / "train").is_dir() and (root / "val").is_dir()
    tops = [root / "train", root / "val"] if split_dirs else [root]
    if any(sorted(top.glob("*.tar")) for top in tops):
        classes = _shard_classes(root)
        found = [_shard_refs(sorted(top.glob("*.tar")), classes) for top in tops]
        layout = "shards"
    else:
        classes = _class_dirs(tops[0])
        found = [_tree_refs(top, classes) for top in tops]
        layout = "folders"
    train, val = found if split_dirs else _hash_split(found[0], val_percent)
    if not classes or not train:
        raise UserError(f"--data-dir {root} holds no images: give class folders "
                        f"(DIR/CLASS/*.jpg, or DIR/train/CLASS and DIR/val/CLASS) or tar "
                        f"shards (DIR/*.tar with {CLASSES_FILE}); images are "
                        f"{', '.join(IMAGE_SUFFIXES)}.")
    return ImageSplits(classes, train, val, layout)


def write_shards(refs: Sequence[ImageRef], out: str | Path, per_shard: int = 1000) -> None:
    """``refs`` in order as tar shards ``000000.tar``...: ``key.<suffix>`` holding the
    encoded file as it is, ``key.cls`` its class index."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, len(refs), per_shard)):
        with tarfile.open(out / f"{number:06d}.tar", "w") as tar:
            for ref in refs[start:start + per_shard]:
                for name, data in ((ref.key + ref.suffix, ref.read()),
                                   (ref.key + LABEL_SUFFIX, str(ref.label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def shard_tree(splits: ImageSplits, out: str | Path, per_shard: int = 1000) -> None:
    """Both splits as shards in ``out/train`` and ``out/val``, with ``classes.json``: the
    same samples, in the same order, as the layout they were scanned from."""
    out = Path(out)
    for name, refs in (("train", splits.train), ("val", splits.val)):
        write_shards(refs, out / name, per_shard)
    (out / CLASSES_FILE).write_text(json.dumps(splits.classes))
