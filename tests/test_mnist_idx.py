"""The mnist-idx workload on IDX files the test writes itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuflow.cli import main
from gpuflow.data.idx import read_idx, write_idx
from gpuflow.errors import UserError
from gpuflow.workloads.mnist_idx import build, parse_model_size


def make_idx_set(directory: Path, train: int = 512, test: int = 128, gz: bool = True) -> None:
    """Ten classes of noisy stripes: vertical or horizontal, with periods of 2 to 6 pixels."""
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    coords = np.arange(28)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 60, (count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            orientation, period = divmod(int(label), 5)
            phase = rng.integers(0, 6)
            on = ((coords + phase) % (period + 2)) == 0
            if orientation:
                images[i, on, :] = 250
            else:
                images[i, :, on] = 250
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("a.idx3-ubyte.gz" if gz else "a.idx3-ubyte")
    write_idx(path, array)
    assert np.array_equal(read_idx(path), array)


def test_truncated_and_foreign_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "x-idx3-ubyte"
    write_idx(path, np.zeros((4, 2, 2), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(UserError, match="x-idx3-ubyte is truncated"):
        read_idx(path)
    path.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(UserError, match="not an IDX file"):
        read_idx(path)


def test_missing_files_and_bad_sizes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="No train-images-idx3-ubyte"):
        build(data_dir=str(tmp_path))
    with pytest.raises(UserError, match="is not a directory"):
        build(data_dir=str(tmp_path / "nope"))
    with pytest.raises(UserError, match="width=W,depth=D"):
        parse_model_size("huge")
    assert parse_model_size("width=48,depth=3") == (48, 3)
    assert parse_model_size("medium") == (64, 4)


def test_workload_reads_the_split_and_learns(tmp_path: Path) -> None:
    make_idx_set(tmp_path, gz=False)
    workload = build(data_dir=str(tmp_path), model_size="width=16,depth=1")
    assert len(workload.train_dataset) == 512 and len(workload.val_dataset) == 128
    run_dir = tmp_path / "run"
    assert main(["train", "--workload", "mnist-idx", "--data-dir", str(tmp_path),
                 "--model-size", "width=16,depth=1", "--max-steps", "100", "--batch-size", "32",
                 "--eval-every", "0", "--run-dir", str(run_dir), "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"]["val_accuracy"] > 0.8


def test_synthetic_data_needs_no_files(tmp_path: Path) -> None:
    workload = build(data="synthetic", model_size="width=8,depth=1")
    image, label = workload.train_dataset[0]
    assert image.shape == (1, 28, 28) and 0 <= int(label) < 10
