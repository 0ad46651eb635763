"""MNIST or Fashion-MNIST from the standard IDX files: a residual CNN on 28x28 images."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from gpuflow.data.idx import find_split, read_idx
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.cnn import SmallCNN
from gpuflow.workload import Workload
from gpuflow.workloads.image_codec import image_serving

# Where Debian's dataset-fashion-mnist package puts the set.
DEFAULT_DIRS = (Path("/usr/share/datasets/fashion-mnist"),)
PRESETS = {"small": (32, 2), "medium": (64, 4), "large": (128, 6)}
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 6000, 1000


def parse_model_size(model_size: str | None) -> tuple[int, int]:
    """A preset name or ``width=W,depth=D``."""
    if model_size is None:
        return PRESETS["small"]
    if model_size in PRESETS:
        return PRESETS[model_size]
    try:
        fields = dict(part.split("=", 1) for part in model_size.split(","))
        if set(fields) != {"width", "depth"}:
            raise ValueError
        width, depth = int(fields["width"]), int(fields["depth"])
        if width < 1 or depth < 0:
            raise ValueError
    except ValueError:
        raise UserError(
            f"--model-size {model_size!r} for mnist-idx: use one of "
            f"{', '.join(PRESETS)} or width=W,depth=D (e.g. width=48,depth=3)."
        ) from None
    return width, depth


def _locate(data_dir: str | None) -> Path:
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise UserError(f"--data-dir {data_dir} is not a directory.")
        return path
    for candidate in DEFAULT_DIRS:
        if candidate.is_dir():
            return candidate
    raise UserError(
        "mnist-idx needs the MNIST or Fashion-MNIST IDX files: pass --data-dir DIR, or install "
        "Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist), "
        f"which puts them in {DEFAULT_DIRS[0]}."
    )


def _load(directory: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx(find_split(directory, prefix, "images"))
    labels = read_idx(find_split(directory, prefix, "labels"))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(
            f"{directory}: {prefix} images {images.shape} and labels {labels.shape} do not "
            "pair up (expected N x H x W images and N labels)."
        )
    return (torch.from_numpy(images.astype("float32") / 255.0).unsqueeze(1),
            torch.from_numpy(labels.astype("int64")))


def _synthetic(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(count, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (count,), generator=generator))


def build(data_dir: str | None = None, data: str = "real",
          model_size: str | None = None) -> Workload:
    width, depth = parse_model_size(model_size)
    packed = open_packed(data_dir, "mnist-idx") if data == "real" else None
    if packed is not None:
        return Workload(
            name="mnist-idx",
            model=SmallCNN(in_channels=1, num_classes=max(packed.meta["num_classes"], 2),
                           width=width, depth=depth, stem_stride=2),
            train_dataset=packed.train, val_dataset=packed.val, example_batch=packed.example,
            serving=image_serving(packed.example[0].shape[1:], None),
        )
    if data == "synthetic":
        (train_x, train_y), (test_x, test_y) = (_synthetic(SYNTHETIC_TRAIN, 0),
                                                _synthetic(SYNTHETIC_TEST, 1))
    else:
        directory = _locate(data_dir)
        (train_x, train_y), (test_x, test_y) = _load(directory, "train"), _load(directory, "t10k")
    mean, std = train_x.mean(), train_x.std()
    classes = int(max(train_y.max(), test_y.max())) + 1
    return Workload(
        name="mnist-idx",
        model=SmallCNN(in_channels=1, num_classes=max(classes, 2), width=width, depth=depth,
                       stem_stride=2),
        train_dataset=TensorDataset((train_x - mean) / std, train_y),
        val_dataset=TensorDataset((test_x - mean) / std, test_y),
        serving=image_serving(train_x.shape[1:],
                              None if data == "synthetic" else (float(mean), float(std))),
    )
