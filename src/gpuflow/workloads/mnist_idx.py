"""MNIST or Fashion-MNIST from the standard IDX files: a residual CNN on 28x28 images."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from gpuflow.data.idx import IdxRecords, find_split, pixel_stats, read_idx
from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.cnn import SmallCNN
from gpuflow.workload import Workload
from gpuflow.workloads.image_codec import image_serving

# Where Debian's dataset-fashion-mnist package puts the set.
DEFAULT_DIRS = (Path("/usr/share/datasets/fashion-mnist"),)
PRESETS = {"small": (32, 2), "medium": (64, 4), "large": (128, 6)}
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 6000, 1000
EXAMPLE_ITEMS = 8

if TYPE_CHECKING:
    from gpuflow.data.pack_sources import RecordSource


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


def _check_pair(directory: Path, prefix: str, images: tuple[int, ...],
                labels: tuple[int, ...]) -> None:
    if len(images) != 3 or len(labels) != 1 or images[0] != labels[0]:
        raise UserError(
            f"{directory}: {prefix} images {images} and labels {labels} do not "
            "pair up (expected N x H x W images and N labels)."
        )


def _scaled(images: np.ndarray) -> torch.Tensor:
    """Bytes to float32 pixels in [0, 1], channel first: one image or a stack of them."""
    return torch.from_numpy(images.astype("float32") / 255.0).unsqueeze(-3)


def _load(directory: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """The split's images (bytes) and labels, read whole."""
    images = read_idx(find_split(directory, prefix, "images"))
    labels = read_idx(find_split(directory, prefix, "labels"))
    _check_pair(directory, prefix, images.shape, labels.shape)
    return images, labels


class IdxPairs(Dataset):
    """A split read from its IDX files one image at a time, normalised as training
    normalises it: the packer's reader, whose memory does not grow with the set."""

    def __init__(self, directory: Path, prefix: str, mean: torch.Tensor,
                 std: torch.Tensor) -> None:
        self.images = IdxRecords(find_split(directory, prefix, "images"))
        self.labels = IdxRecords(find_split(directory, prefix, "labels"))
        _check_pair(directory, prefix, self.images.shape, self.labels.shape)
        self.mean, self.std = mean, std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = (_scaled(self.images[index]) - self.mean) / self.std
        return image, torch.from_numpy(self.labels[index].astype("int64"))


def _stats(histogram: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of the pixels, as the float32 scalars training uses."""
    mean, std = pixel_stats(histogram)
    return torch.tensor(mean), torch.tensor(std)


def pack_source(data_dir: str | None) -> RecordSource:
    """The train and test splits read lazily, for ``gpuflow data pack``: the items the
    raw path trains on, normalised by the training images' statistics (one counting pass)."""
    from gpuflow.data.pack_sources import RecordSource

    directory = _locate(data_dir)
    mean, std = _stats(IdxRecords(find_split(directory, "train", "images")).histogram())
    train = IdxPairs(directory, "train", mean, std)
    example = default_collate([train[i] for i in range(min(EXAMPLE_ITEMS, len(train)))])
    return RecordSource("mnist-idx", {"train": train, "val": IdxPairs(directory, "t10k", mean,
                                                                       std)}, example)


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
        mean, std = train_x.mean(), train_x.std()
    else:
        directory = _locate(data_dir)
        (train_u8, train_labels), (test_u8, test_labels) = (_load(directory, "train"),
                                                            _load(directory, "t10k"))
        mean, std = _stats(np.bincount(train_u8.ravel(), minlength=256))
        train_x, test_x = _scaled(train_u8), _scaled(test_u8)
        train_y = torch.from_numpy(train_labels.astype("int64"))
        test_y = torch.from_numpy(test_labels.astype("int64"))
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
