"""Whole JPEGs to uint8 HWC pixels on the training device, a batch at a time.

``NvImageCodecDecoder`` decodes on a CUDA device with NVIDIA's nvImageCodec (the optional
``nvidia-nvimgcodec-cu13`` wheel), on the current CUDA stream, restricted to its GPU backends
so that a missing nvJPEG shows as refused samples rather than as a silent CPU decode in the
training process. ``PillowDecoder`` decodes the same way with Pillow: the reference the
device pipeline is tested against on a CPU. Either returns each image upright (EXIF
orientation applied) in RGB, or None where it refuses one.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from PIL import Image, ImageOps

from gpuflow.data.image_decode import ImageDecodeError, open_image


class DeviceDecoder(Protocol):
    """Decodes a batch of encoded JPEGs into images on ``device``."""

    def decode(self, encoded: Sequence[bytes],
               device: torch.device) -> list[torch.Tensor | None]:
        """Upright RGB uint8 ``[H, W, 3]`` per file, or None where it is refused."""
        ...


class PillowDecoder:
    """Full-size decodes with Pillow, copied to ``device`` (the CPU stand-in for tests)."""

    def decode(self, encoded: Sequence[bytes],
               device: torch.device) -> list[torch.Tensor | None]:
        return [self._one(data, device) for data in encoded]

    @staticmethod
    def _one(data: bytes, device: torch.device) -> torch.Tensor | None:
        try:
            image = ImageOps.exif_transpose(open_image(data)).convert("RGB")
        except (ImageDecodeError, OSError, ValueError, SyntaxError):
            return None
        return torch.from_numpy(np.array(image, dtype=np.uint8)).to(device)


class NvImageCodecDecoder:
    """nvImageCodec's batched decode on the current CUDA stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        from nvidia import nvimgcodec  # the optional wheel: imported only where it runs

        kinds = nvimgcodec.BackendKind
        self.device = device
        self._decoder = nvimgcodec.Decoder(
            device_id=device.index if device.index is not None else torch.cuda.current_device(),
            backends=[kinds.HW_GPU_ONLY, kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU],
            options=":fancy_upsampling=1")  # libjpeg's (Pillow's) chroma upsampling
        self._params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB,
                                               apply_exif_orientation=True)

    def decode(self, encoded: Sequence[bytes],
               device: torch.device) -> list[torch.Tensor | None]:
        stream = torch.cuda.current_stream(device)
        images = self._decoder.decode(list(encoded), params=self._params,
                                      cuda_stream=stream.cuda_stream)
        if len(images) != len(encoded):  # older releases dropped failures: which ones?
            return [None] * len(encoded)
        # DLPack makes the consumer's (current) stream wait on the decode's.
        return [None if image is None else torch.from_dlpack(image) for image in images]


def probe_jpeg() -> bytes:
    """A small JPEG, for checking that a decoder runs at all."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(buffer, "JPEG")
    return buffer.getvalue()
