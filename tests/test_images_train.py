"""The images workload trained: it learns, resumes bit for bit, and reports skipped files."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from image_trees import write_photo_tree
from runs import configs, newest_weights, summary

from gpuflow.cli import main
from gpuflow.train.trainer import Trainer, seed_everything, train
from gpuflow.workloads import images

pytest_plugins = ("image_trees",)  # the photo_tree fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY = dict(model_size="resnet18,width=8", image_size=16)
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fashion_mnist_jpeg.py"
FASHION_FLOOR = 0.3


config = configs(max_steps=6, batch_size=8, log_every=3, eval_every=0, warmup_steps=1, lr=3e-3,
                 workload="images")


def test_overfits_the_photo_tree_and_reports_no_skips(photo_tree: Path,
                                                      tmp_path: Path) -> None:
    seed_everything(0)
    workload = images.build(str(photo_tree), **TINY)
    assert workload.example_batch[0].dtype == torch.uint8
    result = train(workload, config(tmp_path / "run", max_steps=24, save_checkpoints=False))
    # Two photographs' crops, 16 pixels a side: told apart once trained a little.
    assert result.final_metrics["val_accuracy"] >= 0.8, result.final_metrics
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"] == {"skipped_files": 0, "first_skipped": None}
    served = json.loads((tmp_path / "run" / "serving.json").read_text())["spec"]
    assert served == {"classes": ["china", "flower"], "size": 16}


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_bitwise_exact(photo_tree: Path, tmp_path: Path,
                                           workers: int) -> None:
    seed_everything(0)
    train(images.build(str(photo_tree), **TINY), config(tmp_path / "full",
                                                        num_workers=workers))
    seed_everything(0)
    first = Trainer(images.build(str(photo_tree), **TINY),
                    config(tmp_path / "split", num_workers=workers))
    first.run_steps(4)  # 4 of an epoch's 4-5 batches: the resume starts mid-epoch or at its end
    first.save_checkpoint()
    first.close()
    train(images.build(str(photo_tree), **TINY),
          config(tmp_path / "split", num_workers=workers, resume=True))
    full, split = newest_weights(tmp_path / "full"), newest_weights(tmp_path / "split")
    assert full.keys() == split.keys()
    for name in full:
        assert torch.equal(full[name], split[name]), name


def fashion_mnist_script():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("fashion_mnist_jpeg", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fashion_mnist_jpeg_folders_reach_an_accuracy_floor(tmp_path: Path) -> None:
    script = fashion_mnist_script()
    if not script.DEFAULT_IDX.is_dir():
        if os.environ.get("GPUFLOW_REQUIRE_FASHION_MNIST") == "1":
            pytest.fail(f"{script.DEFAULT_IDX} is missing though CI installed it")
        pytest.skip("needs Debian's dataset-fashion-mnist (.ci/run installs it)")
    assert script.write_tree(tmp_path / "fashion", train=480, val=160) == (480, 160)
    seed_everything(0)
    workload = images.build(str(tmp_path / "fashion"), model_size="resnet18,width=8",
                            image_size=28)
    assert len(workload.train_dataset) == 480 and len(workload.val_dataset) == 160
    result = train(workload, config(tmp_path / "run", max_steps=60, batch_size=16, lr=5e-3,
                                    save_checkpoints=False))
    # Chance is 10%; 60 steps on 480 photos with RandomResizedCrop give about 40%.
    assert result.final_metrics["val_accuracy"] >= FASHION_FLOOR, result.final_metrics


def test_resnets_have_the_published_sizes_and_declare_their_blocks(photo_tree: Path) -> None:
    from gpuflow.models.resnet import ResNet

    # torchvision's resnet18 and resnet50 (ImageNet, 1,000 classes) hold exactly these.
    assert sum(p.numel() for p in ResNet("resnet18").parameters()) == 11_689_512
    assert sum(p.numel() for p in ResNet("resnet50").parameters()) == 25_557_032
    workload = images.build(str(photo_tree), **TINY)
    assert len(workload.blocks()) == 8  # resnet18: 2 + 2 + 2 + 2 residual blocks


def test_two_ranks_count_the_files_skipped_on_both(tmp_path: Path) -> None:
    """Under --nproc 2 each rank's loader meets its own share of the corrupt files; the
    summary counts them all, as one process reading the same batches does (rank 0 alone
    would count about half)."""
    data = tmp_path / "data"
    write_photo_tree(data / "train", per_class=8)
    write_photo_tree(data / "val", per_class=1)
    broken = [data / "train" / name / f"{number:03d}.jpg"
              for name in ("china", "flower") for number in (0, 5, 6)]
    for path in broken:
        path.write_bytes(path.read_bytes()[:200])  # truncated
    common = ["train", "--workload", "images", "--data-dir", str(data), "--image-size", "16",
              "--model-size", "resnet18,width=8", "--max-steps", "1", "--num-workers", "0",
              "--no-progress"]
    # A batch of 16 is an epoch: each training file is met once a batch read (the loader
    # reads a few batches ahead), by one process or by one of the two ranks.
    assert main([*common, "--batch-size", "16", "--run-dir", str(tmp_path / "one")]) == 0
    result = run_cli(*common, "--nproc", "2", "--strategy", "ddp", "--batch-size", "8",
                     "--run-dir", str(tmp_path / "two"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert two["world_size"] == 2
    count = one["data"]["skipped_files"]
    assert count > 0 and count % len(broken) == 0, one["data"]
    assert two["data"]["skipped_files"] == count, (one["data"], two["data"])
    assert two["data"]["first_skipped"].split(":")[0] in map(str, broken)
