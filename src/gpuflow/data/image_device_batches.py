"""Training batches whose JPEGs are decoded on the training device (``--decode gpu``).

A loader worker does not decode a JPEG: it reads the header, draws the sample's
RandomResizedCrop box and flip from the generator of (seed, epoch, index) exactly as
``TrainCrops`` does, and passes the encoded bytes on with them (``EncodedCrops``). The
collated ``EncodedBatch`` reaches the training process, where the copy to the device
(``gpuflow.data.prefetch.move_to_device``) calls its ``to_device``: one batched decode by a
``DeviceDecoder`` on the current stream, then the same crop, resize and flip on the device
(``DeviceCrops``). Batches resume exactly and do not depend on the number of workers.

Other files (PNG, WebP, CMYK JPEGs) are decoded in the worker, as on the CPU path; a JPEG the
device decoder refuses is decoded on the CPU in the training process; both are counted. A
file that does not decode at all is skipped and counted, or stops the run under
``--strict-data`` (``DataIssues``).
"""

from __future__ import annotations

import itertools
import multiprocessing
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import torch

from gpuflow.data.device_crops import Box, crop_resize_flip
from gpuflow.data.device_decoders import DeviceDecoder, NvImageCodecDecoder, PillowDecoder
from gpuflow.data.image_batches import (
    DataIssues,
    Encoded,
    Item,
    PackedEncoded,
    as_encoded,
    collate_images,
    nothing_decoded,
)
from gpuflow.data.image_decode import (
    ImageDecodeError,
    decode_crop,
    open_image,
    orientation,
    oriented_size,
    random_resized_crop,
)

DEVICE_FORMATS = {"JPEG": ("RGB", "L")}  # what goes to the device decoder, by Pillow's names


@dataclass
class CropJob:
    """One training sample as a worker hands it on: either its encoded JPEG, with the upright
    size the box was drawn for, or pixels the worker already decoded and cropped."""

    name: str
    label: int
    box: Box
    flip: bool
    size: tuple[int, int]  # upright width, height
    encoded: bytes | None = None
    pixels: torch.Tensor | None = None


class DecodeCounts:
    """Samples decoded on the device and on the CPU, counted across loader processes."""

    def __init__(self) -> None:
        self._device = multiprocessing.Value("q", 0)
        self._cpu = multiprocessing.Value("q", 0)

    def add(self, device: int = 0, cpu: int = 0) -> None:
        for value, count in ((self._device, device), (self._cpu, cpu)):
            if count:
                with value.get_lock():
                    value.value += count

    def report(self) -> dict[str, int]:
        return {"decoded_on_device": int(self._device.value),
                "decoded_on_cpu": int(self._cpu.value)}


def _upright_size(data: bytes) -> tuple[str | None, str, tuple[int, int]]:
    """The format, mode and upright size from the header, without decoding pixels."""
    image = open_image(data)
    try:
        return image.format, image.mode, oriented_size(image, orientation(image))
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(f"cannot read the image's header ({exc})") from None


class EncodedCrops:
    """The worker's half of the training transform: ``TrainCrops``' random draws, without
    the decode of a JPEG; a ``Workload.augment``."""

    def __init__(self, size: int, issues: DataIssues, counts: DecodeCounts) -> None:
        self.size, self.issues, self.counts = size, issues, counts

    def __call__(self, item: tuple[Encoded | PackedEncoded, int],
                 rng: np.random.Generator) -> CropJob | None:
        (name, data), label = as_encoded(item[0]), int(item[1])
        try:
            fmt, mode, (width, height) = _upright_size(data)
            left, top, right, bottom = random_resized_crop(width, height, rng)
            flip = bool(rng.random() < 0.5)
            job = CropJob(name, label, (int(left), int(top), int(right), int(bottom)), flip,
                          (width, height))
            if mode in DEVICE_FORMATS.get(fmt or "", ()):
                job.encoded = data
                return job
            job.pixels = _cpu_crop(data, job, self.size)
        except ImageDecodeError as exc:
            self.issues.skip(name, exc)
            return None
        self.counts.add(cpu=1)
        return job


def _cpu_crop(data: bytes, job: CropJob, size: int) -> torch.Tensor:
    """The CPU path's crop of ``job``'s box and flip (``decode_crop``), as a tensor."""
    pixels = decode_crop(data, lambda width, height: job.box, size, "RGB")
    return torch.from_numpy(np.ascontiguousarray(pixels[:, ::-1] if job.flip else pixels))


@dataclass
class EncodedBatch:
    """A collated batch of ``CropJob``: decoded when it is moved to the device, by the
    ``DeviceCrops`` registered under ``stage`` in the training process."""

    stage: int
    jobs: list[CropJob]
    count: int  # samples in the batch, skipped ones included

    def to_device(self, device: torch.device,
                  non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return _STAGES[self.stage].decode(self, device, non_blocking)


def collate_jobs(items: Sequence[CropJob | Item | None], stage: int,
                 issues: DataIssues) -> EncodedBatch | tuple[torch.Tensor, torch.Tensor]:
    """Training's ``CropJob`` items as an ``EncodedBatch``; evaluation's, decoded on the CPU
    (the workload's one collate serves both), as ``collate_images`` collates them."""
    if any(isinstance(item, tuple) for item in items):
        return collate_images(items, issues)  # type: ignore[arg-type]
    return EncodedBatch(stage, [job for job in items if job is not None],  # type: ignore[misc]
                        len(items))


@cache
def _nvimgcodec(device: torch.device) -> DeviceDecoder:
    return NvImageCodecDecoder(device)


def default_decoder(device: torch.device) -> DeviceDecoder:
    """nvImageCodec on a CUDA device, Pillow elsewhere."""
    return _nvimgcodec(device) if device.type == "cuda" else PillowDecoder()


_TOKENS = itertools.count()
_STAGES: weakref.WeakValueDictionary[int, DeviceCrops] = weakref.WeakValueDictionary()


class DeviceCrops:
    """The training transform of ``--decode gpu``: ``crops`` and ``collate`` for the loader,
    ``decode`` for the batches on the device, ``report`` for the run's summary.

    A batch crosses from a worker process by pickling, which shared counters and decoders
    do not survive: it carries this object's token, and finds it here again.
    """

    def __init__(self, size: int, issues: DataIssues,
                 decoder_for: Callable[[torch.device], DeviceDecoder] = default_decoder
                 ) -> None:
        self.size, self.issues, self.decoder_for = size, issues, decoder_for
        self.counts = DecodeCounts()
        self.crops = EncodedCrops(size, issues, self.counts)
        self.token = next(_TOKENS)
        _STAGES[self.token] = self
        self.collate = partial(collate_jobs, stage=self.token, issues=issues)

    def decode(self, batch: EncodedBatch, device: torch.device,
               non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 ``[B, size, size, 3]`` pixels and int64 labels on ``device``; samples that
        decode nowhere are left out, as ``collate_images`` leaves them."""
        sent = [job for job in batch.jobs if job.encoded is not None]
        images = iter(self.decoder_for(device).decode(
            [job.encoded for job in sent], device) if sent else [])  # type: ignore[misc]
        kept: list[tuple[torch.Tensor, int]] = []
        for job in batch.jobs:
            if job.encoded is None:
                pixels = job.pixels.to(device, non_blocking=non_blocking)  # type: ignore[union-attr]
            else:
                pixels = self._crop(job, next(images), device)
            if pixels is not None:
                kept.append((pixels, job.label))
        if not kept:
            raise nothing_decoded(batch.count, self.issues)
        labels = torch.tensor([label for _, label in kept], dtype=torch.int64)
        return (torch.stack([pixels for pixels, _ in kept]),
                labels.to(device, non_blocking=non_blocking))

    def _crop(self, job: CropJob, image: torch.Tensor | None,
              device: torch.device) -> torch.Tensor | None:
        """The device's crop of a decoded JPEG; a CPU decode where the decoder refused it
        (or returned another size than the header's); None where nothing decodes it."""
        if image is not None and tuple(image.shape) == (job.size[1], job.size[0], 3):
            self.counts.add(device=1)
            return crop_resize_flip(image, job.box, self.size, job.flip)
        try:
            pixels = _cpu_crop(job.encoded, job, self.size)  # type: ignore[arg-type]
        except ImageDecodeError as exc:
            self.issues.skip(job.name, exc)
            return None
        self.counts.add(cpu=1)
        return pixels.to(device)

    def report(self) -> dict[str, Any]:
        """For the run's summary: skipped files, and where the samples were decoded."""
        return {**self.issues.report(), "decode": "gpu", **self.counts.report()}
