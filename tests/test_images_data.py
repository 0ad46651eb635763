"""The images input pipeline: decode, layouts, seeded batches, files that do not decode."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from image_trees import bomb_png, encode, photo
from PIL import Image

from gpuflow.data.augment import EpochKeys
from gpuflow.data.image_batches import (
    DataIssues,
    EncodedImages,
    EvalImages,
    TrainCrops,
    collate_images,
)
from gpuflow.data.image_decode import (
    ImageDecodeError,
    centre_crop,
    decode_crop,
    draft_request,
    random_resized_crop,
    resize_crop,
)
from gpuflow.data.image_decoder import choose_decoder, gpu_decode_missing
from gpuflow.data.image_sources import scan, shard_tree
from gpuflow.data.loader import train_batches
from gpuflow.errors import UserError

pytest_plugins = ("image_trees",)  # the photo_tree fixture

PSNR_FLOOR_DB = 35.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def fixed(box: tuple[float, float, float, float]):  # noqa: ANN201
    return lambda width, height: box


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_whole_pixel_crops_resize_as_pillow_resizes_the_cut_crop(mode: str) -> None:
    """Training crops of a full-size decode go through torch's uint8 kernel: the tutorial's
    crop-then-resize by Pillow to the stated bound; a fractional box through Pillow."""
    with Image.open(io.BytesIO(encode(photo("flower"), "JPEG", mode))) as image:
        image.load()
        rng = np.random.default_rng(1)
        outside = []
        for _ in range(8):
            box = random_resized_crop(*image.size, rng)
            ours = resize_crop(image, box, 64)
            tutorial = np.array(image.crop(box).resize((64, 64), Image.Resampling.BILINEAR))
            assert ours.shape == (64, 64, 3 if mode == "RGB" else 1) and ours.flags.writeable
            apart = np.abs(ours.astype(int) - tutorial.reshape(ours.shape)).max()
            assert apart <= 1 and psnr(ours, tutorial.reshape(ours.shape)) >= PSNR_FLOOR_DB
            # Pillow's box resize reads past the box's edges: not what this path does.
            boxed = np.array(image.resize((64, 64), Image.Resampling.BILINEAR, box=box))
            outside.append(np.abs(boxed.astype(int) - tutorial).max())
        assert max(outside) > 1  # so the bound above tells the two paths apart
        box = centre_crop(*image.size)
        whole = np.array(image.resize((64, 64), Image.Resampling.BILINEAR, box=box))
        assert np.array_equal(resize_crop(image, box, 64), whole.reshape(64, 64, -1))


def test_draft_decode_matches_full_decode_and_keeps_the_crop_resolution() -> None:
    data = encode(photo("china"), "JPEG", "RGB")
    rng = np.random.default_rng(0)
    reduced = 0
    for _ in range(12):
        box = random_resized_crop(640, 427, rng)
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", draft_request((640, 427), box, 32))
            scale = image.size[0] / 640
        assert (box[2] - box[0]) * scale >= 32 and (box[3] - box[1]) * scale >= 32
        reduced += scale < 1
        fast = decode_crop(data, fixed(box), 32)
        full = decode_crop(data, fixed(box), 32, draft=False)
        assert fast.shape == full.shape == (32, 32, 3) and fast.dtype == np.uint8
        assert psnr(fast, full) >= PSNR_FLOOR_DB, box
    assert reduced >= 6  # small crops of a 640-pixel photo do decode at reduced size


@pytest.mark.parametrize("turned", [3, 6])  # both axes reversed; x reversed and swapped
def test_draft_decode_of_a_turned_jpeg_lines_up_with_its_full_decode(turned: int) -> None:
    data = encode(photo("china"), "JPEG", "RGB", exif_orientation=turned)
    size = (427, 640) if turned == 6 else (640, 427)
    rng = np.random.default_rng(0)
    scores = []
    for _ in range(12):
        box = random_resized_crop(*size, rng)
        scores.append(psnr(decode_crop(data, fixed(box), 32),
                           decode_crop(data, fixed(box), 32, draft=False)))
    # Measured here, the worst crop: 33.8 dB (3) and 35.7 dB (6); 24.9 and 23.6 dB before a
    # reversed axis was shifted by the reduced decode's partial last row or column.
    assert min(scores) >= 30 and np.mean(scores) >= PSNR_FLOOR_DB, scores


def test_exif_orientation_and_every_mode_become_upright_rgb() -> None:
    upright = photo("flower").crop((100, 50, 340, 210))  # wider than tall
    rotated = upright.transpose(Image.Transpose.ROTATE_90)  # stored turned; EXIF 6 undoes it
    tagged = decode_crop(encode(rotated, "JPEG", "RGB", exif_orientation=6), centre_crop, 48)
    plain = decode_crop(encode(upright, "JPEG", "RGB"), centre_crop, 48)
    assert psnr(tagged, plain) >= 30
    for fmt, mode in (("JPEG", "CMYK"), ("PNG", "P"), ("PNG", "L"), ("WEBP", "RGBA"),
                      ("PNG", "LA")):
        pixels = decode_crop(encode(upright, fmt, mode), centre_crop, 24)
        assert pixels.shape == (24, 24, 3) and pixels.dtype == np.uint8, (fmt, mode)
    assert decode_crop(encode(upright, "PNG", "RGB"), centre_crop, 24, mode="L").shape == \
        (24, 24, 1)


def test_unreadable_bytes_raise_decode_errors() -> None:
    jpeg = encode(photo("china"), "JPEG", "RGB")
    for data in (jpeg[: len(jpeg) // 2], b"not an image", b"", bomb_png(10_000, 10_000)):
        with pytest.raises(ImageDecodeError):
            decode_crop(data, centre_crop, 16)


def test_folders_and_shards_give_the_same_batches(photo_tree: Path, tmp_path: Path) -> None:
    folders = scan(photo_tree, val_percent=25)
    shard_tree(folders, tmp_path / "shards", per_shard=7)
    shards = scan(tmp_path / "shards")
    assert (folders.layout, shards.layout) == ("folders", "shards")
    assert folders.classes == shards.classes == ["china", "flower"]
    assert 0 < len(folders.val) < len(folders.train)
    assert [r.key for r in shards.train] == [r.key for r in folders.train]
    runs = []
    for splits in (folders, shards):
        crops = TrainCrops(24, "RGB", DataIssues())
        source = iter(train_batches(EncodedImages(splits.train), 8, collate_images,
                                    seed=3, start_batch=0, num_workers=0, pin_memory=False,
                                    augment=crops))
        runs.append([next(source) for _ in range(3)])
    for (a_x, a_y), (b_x, b_y) in zip(*runs, strict=True):
        assert a_x.dtype == torch.uint8 and a_x.shape == (8, 24, 24, 3)
        assert torch.equal(a_x, b_x) and torch.equal(a_y, b_y)


def test_batches_resume_mid_epoch_whatever_the_workers(photo_tree: Path) -> None:
    dataset = EncodedImages(scan(photo_tree, val_percent=25).train)
    per_epoch = len(dataset) // 8

    def batches(start: int, workers: int, count: int) -> list[tuple[torch.Tensor, ...]]:
        source = iter(train_batches(dataset, 8, collate_images, seed=5,
                                    start_batch=start, num_workers=workers, pin_memory=False,
                                    augment=TrainCrops(16, "RGB", DataIssues())))
        return [next(source) for _ in range(count)]

    whole = batches(0, 0, per_epoch + 2)
    resumed = batches(per_epoch - 1, 2, 3)  # the last batch of epoch 0, then epoch 1
    for (a_x, a_y), (b_x, b_y) in zip(whole[per_epoch - 1:], resumed, strict=True):
        assert torch.equal(a_x, b_x) and torch.equal(a_y, b_y)
    assert not torch.equal(whole[0][0], whole[per_epoch][0])  # a new epoch, new crops


def test_ranks_see_every_sample_once_per_epoch(photo_tree: Path) -> None:
    size = len(scan(photo_tree, val_percent=25).train)
    seen = [index for rank in range(2)
            for _, index in EpochKeys(size, seed=1, rank=rank, world_size=2)]
    assert len(seen) == len(set(seen)) == size // 2 * 2


def test_corrupt_files_are_skipped_and_counted_or_stop_the_run(photo_tree: Path,
                                                               tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for source in sorted(photo_tree.rglob("*.*"))[:10]:
        target = tree / source.relative_to(photo_tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    broken = tree / "china" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 a truncated JPEG")
    refs = scan(tree, val_percent=0).train
    issues = DataIssues()
    decoded = EvalImages(EncodedImages(refs), 16, "RGB", issues)
    pixels, labels = collate_images([decoded[i] for i in range(len(refs))],
                                           issues=issues)
    assert pixels.shape[0] == len(refs) - 1 == labels.shape[0]
    report = issues.report()
    assert report["skipped_files"] == 1 and str(broken) in report["first_skipped"]
    strict = EvalImages(EncodedImages(refs), 16, "RGB", DataIssues(strict=True))
    with pytest.raises(UserError, match="broken.jpg"):
        for index in range(len(refs)):
            strict[index]
    # From a loader worker, the stop reaches the training process as the message alone.
    batches = iter(train_batches(EncodedImages(refs), len(refs), collate_images, seed=0,
                                 start_batch=0, num_workers=2, pin_memory=False,
                                 augment=TrainCrops(16, "RGB", DataIssues(strict=True))))
    with pytest.raises(UserError) as stopped:
        next(batches)
    assert str(stopped.value).startswith(f"{broken}: not a readable image")
    assert "Traceback" not in str(stopped.value)


def test_gpu_decode_is_refused_where_it_cannot_run() -> None:
    reason = gpu_decode_missing()
    assert reason is not None  # no CUDA device here
    with pytest.raises(UserError, match=re.escape(f"cannot decode on the GPU: {reason}")):
        choose_decoder("gpu")
    with pytest.warns(UserWarning, match="decoding on the CPU"):
        assert choose_decoder("auto") == "cpu"
    assert choose_decoder("cpu") == "cpu"
