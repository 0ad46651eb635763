"""`gpuflow data pack --workload images`: encoded files in shuffled record shards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from gpuflow.data.image_batches import as_encoded
from gpuflow.data.image_sources import scan
from gpuflow.data.loader import train_batches
from gpuflow.errors import UserError
from gpuflow.workloads import images
from gpuflow.workloads.packing import pack

pytest_plugins = ("image_trees",)  # the photo_tree fixture


@pytest.fixture(scope="module")
def packed(photo_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("images-pack") / "packed"
    pack("images", photo_tree, out, shard_mb=0.05, progress=False, max_side=64)
    return out


def test_pack_holds_every_file_reencoded_shuffled_with_the_class_names(
        photo_tree: Path, packed: Path) -> None:
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["meta"]["classes"] == ["china", "flower"]
    assert len(manifest["splits"]["train"]) > 1  # several shards
    folders = scan(photo_tree)
    workload = images.build(str(packed), model_size="resnet18,width=8", image_size=16)
    train = workload.train_dataset
    names = [as_encoded(train[i][0])[0] for i in range(len(train))]
    assert sorted(names) == sorted(str(ref.path) for ref in folders.train)
    assert names != [str(ref.path) for ref in folders.train]  # in a seeded permutation
    for index in range(0, len(train), 7):
        (_, data), label = as_encoded(train[index][0]), train[index][1]
        with Image.open(io.BytesIO(data)) as image:
            assert max(image.size) <= 64
        assert int(label) == ["china", "flower"].index(Path(names[index]).parent.name)
    assert len(workload.val_dataset) == len(folders.val)


def test_every_rank_gets_as_many_batches_and_no_sample_twice(packed: Path) -> None:
    train = images.build(str(packed), model_size="resnet18,width=8",
                         image_size=16).train_dataset
    per_epoch = len(train) // 2 // 4
    ranks = [list(train.batches(0, 4, per_epoch, 0, list, rank, 2).rank_batches(epoch=1))
             for rank in range(2)]
    assert [len(batches) for batches in ranks] == [per_epoch, per_epoch]
    seen = [index for batches in ranks for batch in batches for index in batch]
    assert len(seen) == len(set(seen)) == per_epoch * 4 * 2


def test_packed_batches_are_uint8_crops_that_resume_whatever_the_workers(
        packed: Path) -> None:
    workload = images.build(str(packed), model_size="resnet18,width=8", image_size=16)
    per_epoch = len(workload.train_dataset) // 8

    def batches(start: int, workers: int, count: int) -> list[tuple[torch.Tensor, ...]]:
        stream = iter(train_batches(workload.train_dataset, 8, workload.collate, seed=0,
                                    start_batch=start, num_workers=workers,
                                    pin_memory=False, augment=workload.augment))
        return [next(stream) for _ in range(count)]

    whole = batches(0, 0, per_epoch + 1)
    pixels, labels = whole[0]
    assert pixels.dtype == torch.uint8 and pixels.shape == (8, 16, 16, 3)
    assert labels.dtype == torch.int64
    for (a_x, a_y), (b_x, b_y) in zip(whole[per_epoch - 1:], batches(per_epoch - 1, 2, 2),
                                      strict=True):
        assert torch.equal(a_x, b_x) and torch.equal(a_y, b_y)


def test_max_side_is_an_images_option_only(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--max-side: not an option of packing workload"):
        pack("digits", None, tmp_path / "out", progress=False, max_side=64)
