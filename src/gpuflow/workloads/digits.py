"""Handwritten digits: scikit-learn's bundled 8x8 images (1,797 real scans, 10 classes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from gpuflow.data.streaming import open_packed
from gpuflow.errors import UserError
from gpuflow.models.cnn import SmallCNN
from gpuflow.workload import Workload
from gpuflow.workloads.image_codec import image_serving

VAL_FRACTION = 0.2
SPLIT_SEED = 1234


def bundled_digits_file() -> Path | None:
    """scikit-learn's file of the scans, found without importing scikit-learn, whose
    import costs about 2 s of every run's start-up; None where it is not there."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    path = package / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images scaled to [0, 1] as (N, 1, 8, 8) float32, labels as int64."""
    path = bundled_digits_file()
    if path is None:  # a scikit-learn that keeps them elsewhere: its own loader
        from sklearn.datasets import load_digits

        data = load_digits()
        pixels, target = data.images, data.target
    else:  # each row: 64 pixel values, then the label
        table = np.loadtxt(path, delimiter=",")
        pixels, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(target, dtype=torch.int64)
    return images, labels


def synthetic_tensors(count: int = 1797, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels of the real set's shapes, for pure throughput runs."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(count, 1, 8, 8, generator=generator),
            torch.randint(0, 10, (count,), generator=generator))


def build(width: int = 32, depth: int = 2, data: str = "real",
          data_dir: str | None = None) -> Workload:
    """The bundled digits, or a packed copy of them in ``data_dir`` (streamed)."""
    model = SmallCNN(in_channels=1, num_classes=10, width=width, depth=depth)
    packed = open_packed(data_dir, "digits") if data == "real" else None
    if packed is not None:
        return Workload(name="digits", model=model, train_dataset=packed.train,
                        val_dataset=packed.val, example_batch=packed.example,
                        serving=image_serving(packed.example[0].shape[1:], None))
    if data_dir is not None and data == "real":
        raise UserError(f"--data-dir {data_dir} holds no packed set; the digits workload "
                        "reads scikit-learn's bundled scans, or a set made by "
                        "`gpuflow data pack --workload digits --out DIR`.")
    images, labels = load_digits_tensors() if data == "real" else synthetic_tensors()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = int(len(labels) * VAL_FRACTION)
    val_idx, train_idx = order[:n_val], order[n_val:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return Workload(
        name="digits",
        model=model,
        train_dataset=TensorDataset(images[train_idx], labels[train_idx]),
        val_dataset=TensorDataset(images[val_idx], labels[val_idx]),
        serving=image_serving(images.shape[1:], (float(mean), float(std))),
    )
