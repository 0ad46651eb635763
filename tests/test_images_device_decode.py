"""``--decode gpu`` on a CPU: workers draw, the device stage decodes, crops and flips.

Every step but nvImageCodec's own call runs here, with Pillow's full-size decode standing in
for it (``PillowDecoder``): the crops equal the CPU path's to a stated bound, from the same
(seed, epoch, index) draws, resume exactly whatever the workers, and files the device
decoder refuses or that do not decode are handled as the CPU path handles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from image_trees import encode, photo

from gpuflow.data import image_decoder
from gpuflow.data.image_batches import DataIssues, EncodedImages, TrainCrops, collate_images
from gpuflow.data.image_decode import decode_crop
from gpuflow.data.image_decoder import gpu_decode_missing
from gpuflow.data.image_device_batches import DeviceCrops, EncodedBatch
from gpuflow.data.image_sources import scan
from gpuflow.data.loader import train_batches
from gpuflow.data.prefetch import DevicePrefetcher, move_to_device
from gpuflow.errors import UserError
from gpuflow.workloads import images

pytest_plugins = ("image_trees",)  # the photo_tree fixture

# Against Pillow's full-size decode and resize of the same box (the reference). Against the
# CPU path's batches, which may decode a JPEG at reduced size (draft), the issue's bound.
REFERENCE_FLOOR_DB = 40.0
PSNR_FLOOR_DB = 35.0
CPU = torch.device("cpu")
# nvImageCodec on CUDA where it decodes (the GPU stage); Pillow on the CPU everywhere.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    gpu_decode_missing() is not None, reason=f"GPU decode: {gpu_decode_missing()}"))]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def fixed(box: tuple[int, int, int, int]):  # noqa: ANN201
    return lambda width, height: box


class Refuses:
    """A device decoder that refuses every file, as nvImageCodec refuses what it cannot read."""

    def decode(self, encoded: Sequence[bytes], device: torch.device) -> list[None]:
        return [None for _ in encoded]


def batches(dataset: EncodedImages, augment, collate, start: int = 0,  # noqa: ANN001
            workers: int = 0, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    source = iter(train_batches(dataset, 8, collate, seed=5, start_batch=start,
                                num_workers=workers, pin_memory=False, augment=augment))
    return [move_to_device(next(source), CPU) for _ in range(count)]


@pytest.mark.parametrize("device", DEVICES)
def test_device_crops_match_a_full_size_decode_from_the_same_draws(device: str) -> None:
    data = [encode(photo(name), "JPEG", "RGB", exif_orientation=turn)
            for name in ("china", "flower") for turn in (None, 6)]
    stage = DeviceCrops(48, DataIssues())
    cpu = TrainCrops(48, "RGB", DataIssues())
    worst = float("inf")
    for index in range(16):
        item = ((f"photo{index % 4}", data[index % 4]), index % 2)
        job = stage.crops(item, np.random.default_rng([1, 0, index]))
        assert job is not None and job.encoded is not None  # a JPEG goes to the device
        pixels, labels = EncodedBatch(stage.token, [job], 1).to_device(torch.device(device))
        assert pixels.shape == (1, 48, 48, 3) and pixels.dtype == torch.uint8
        assert pixels.device.type == device
        pixels, labels = pixels.cpu(), labels.cpu()
        # The CPU path draws the same box, flip and label from the same generator.
        expected, label = cpu(item, np.random.default_rng([1, 0, index]))
        assert labels.tolist() == [label]
        reference = torch.from_numpy(decode_crop(data[index % 4], fixed(job.box), 48,
                                                 draft=False))
        reference = reference.flip(1) if job.flip else reference
        assert psnr(expected, reference) >= 20  # the same crop, mirrored the same way
        worst = min(worst, psnr(pixels[0], reference))
    # Pillow here is the reference's own decoder; nvImageCodec's IDCT and upsampling differ.
    assert worst >= (REFERENCE_FLOOR_DB if device == "cpu" else PSNR_FLOOR_DB), worst
    assert stage.counts.report() == {"decoded_on_device": 16, "decoded_on_cpu": 0}


def test_batches_resume_whatever_the_workers_and_track_the_cpu_path(photo_tree: Path) -> None:
    dataset = EncodedImages(scan(photo_tree, val_percent=25).train)
    per_epoch = len(dataset) // 8
    stage = DeviceCrops(16, DataIssues())
    whole = batches(dataset, stage.crops, stage.collate, count=per_epoch + 2)
    resumed = batches(dataset, stage.crops, stage.collate, start=per_epoch - 1, workers=2)
    for (a_x, a_y), (b_x, b_y) in zip(whole[per_epoch - 1:], resumed, strict=True):
        assert torch.equal(a_x, b_x) and torch.equal(a_y, b_y)
    cpu = batches(dataset, TrainCrops(16, "RGB", DataIssues()), collate_images)
    for (x, y), (cpu_x, cpu_y) in zip(whole, cpu, strict=False):
        assert torch.equal(y, cpu_y) and psnr(x, cpu_x) >= PSNR_FLOOR_DB
    report = stage.report()
    # The tree's PNG, WebP and CMYK JPEG files are decoded in the workers, as on the CPU path.
    assert report["decoded_on_device"] > 0 and report["decoded_on_cpu"] > 0
    assert report["skipped_files"] == 0 and report["decode"] == "gpu"


def test_refused_jpegs_decode_on_the_cpu_and_broken_files_are_skipped(
        photo_tree: Path, tmp_path: Path) -> None:
    refs = scan(photo_tree, val_percent=0).train[:8]
    broken = tmp_path / "broken.jpg"
    whole = encode(photo("china"), "JPEG", "RGB")
    broken.write_bytes(whole[:len(whole) // 2])  # a readable header, half the scan
    dataset = EncodedImages([*refs, refs[0].__class__("broken", 0, ".jpg", str(broken))])
    stage = DeviceCrops(16, DataIssues(), decoder_for=lambda device: Refuses())
    pixels, labels = move_to_device(stage.collate(
        [stage.crops(dataset[i], np.random.default_rng([0, 0, i])) for i in range(9)]), CPU)
    cpu = TrainCrops(16, "RGB", DataIssues())
    expected = collate_images([cpu(dataset[i], np.random.default_rng([0, 0, i]))
                               for i in range(9)])
    # A refused JPEG goes the CPU path's way: the same crop, bit for bit.
    assert torch.equal(pixels, expected[0]) and torch.equal(labels, expected[1])
    report = stage.report()
    assert report["decoded_on_device"] == 0 and report["decoded_on_cpu"] == 8
    assert report["skipped_files"] == 1 and str(broken) in report["first_skipped"]
    strict = DeviceCrops(16, DataIssues(strict=True), decoder_for=lambda device: Refuses())
    jobs = [strict.crops(dataset[i], np.random.default_rng([0, 0, i])) for i in (0, 8)]
    with pytest.raises(UserError, match="broken.jpg"):
        move_to_device(strict.collate(jobs), CPU)


@pytest.mark.parametrize("device", DEVICES)
def test_auto_takes_the_gpu_where_it_decodes_and_the_workload_loads_through_it(
        photo_tree: Path, monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setattr(image_decoder, "gpu_decode_missing", lambda: None)
    assert image_decoder.choose_decoder("auto") == image_decoder.choose_decoder("gpu") == "gpu"
    workload = images.build(str(photo_tree), model_size="resnet18,width=8", image_size=16)
    # The trainer's path: the loader, then the prefetcher's copy, where the batch decodes.
    source = train_batches(workload.train_dataset, 8, workload.collate_fn, seed=0,
                           start_batch=0, num_workers=0, pin_memory=False,
                           augment=workload.augment)
    prefetcher = DevicePrefetcher(source, torch.device(device), background=True)
    pixels, labels = next(prefetcher)
    prefetcher.close()
    assert pixels.shape == (8, 16, 16, 3) and pixels.dtype == torch.uint8
    assert pixels.device.type == labels.device.type == device
    cpu_path = train_batches(workload.train_dataset, 8, collate_images, seed=0, start_batch=0,
                             num_workers=0, pin_memory=False,
                             augment=TrainCrops(16, "RGB", DataIssues()))
    cpu_pixels, cpu_labels = next(iter(cpu_path))
    assert torch.equal(labels.cpu(), cpu_labels)
    assert psnr(pixels.cpu(), cpu_pixels) >= PSNR_FLOOR_DB
    # Evaluation's items are decoded on the CPU and collated as they are without --decode.
    val = workload.val_dataset
    pixels, labels = workload.collate_fn([val[i] for i in range(4)])
    assert pixels.shape == (4, 16, 16, 3) and labels.shape == (4,)
    report = workload.data_report()
    assert report["decode"] == "gpu" and report["skipped_files"] == 0
    assert report["decoded_on_device"] + report["decoded_on_cpu"] >= 8


def test_the_nvimagecodec_call_restricts_backends_and_keeps_positions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """nvImageCodec's call with a stand-in module (its 0.9 names, read off the wheel): GPU
    backends only, upright sRGB, the current stream, a refused file's None in its place."""
    import sys
    import types
    from enum import Enum

    from gpuflow.data.device_decoders import NvImageCodecDecoder

    calls: dict = {}
    kinds = Enum("BackendKind", "CPU_ONLY GPU_ONLY HYBRID_CPU_GPU HW_GPU_ONLY")

    class Decoder:
        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            calls["decoder"] = kwargs

        def decode(self, srcs: list, params: dict, cuda_stream: int) -> list:
            calls["decode"] = (params, cuda_stream)
            return [None if data == b"refused" else np.full((2, 3, 3), len(data), np.uint8)
                    for data in srcs]

    fake = types.SimpleNamespace(BackendKind=kinds, Decoder=Decoder, DecodeParams=dict,
                                 ColorSpec=types.SimpleNamespace(SRGB="srgb"))
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(nvimgcodec=fake))
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=1234))
    decoder = NvImageCodecDecoder(torch.device("cuda", 0))
    images = decoder.decode([b"four", b"refused", b"ok"], torch.device("cuda", 0))
    assert calls["decoder"]["device_id"] == 0
    assert kinds.CPU_ONLY not in calls["decoder"]["backends"]
    assert calls["decode"] == ({"color_spec": "srgb", "apply_exif_orientation": True}, 1234)
    assert images[1] is None and images[0].shape == (2, 3, 3)
    assert int(images[0][0, 0, 0]) == 4 and int(images[2][0, 0, 0]) == 2
