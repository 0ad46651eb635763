"""Serving grayscale image classifiers: raw tensors, a base64 PNG/JPEG, or pixel rows."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpuflow.serving import (
    Decoded,
    InputError,
    InputField,
    InputSchema,
    PredictRequest,
    ServingSpec,
    TensorCodec,
    b64decode,
)


class ImageCodec(TensorCodec):
    """Pixels (0-255, 0 the background) are scaled to [0, 1] and normalised with the
    training set's mean and standard deviation, as the workload does; without those
    statistics only raw (already normalised) tensors are taken."""

    kind = "image"
    file_suffixes = (".json", ".png", ".jpg", ".jpeg", ".bmp", ".pgm")

    def __init__(self, sample_shape: Sequence[int], stats: tuple[float, float] | None) -> None:
        super().__init__(InputSchema("tensor", (InputField("inputs", "float32",
                                                           tuple(sample_shape)),)))
        self.sample_shape = tuple(sample_shape)
        self.stats = stats
        self.height, self.width = self.sample_shape[-2:]

    def accepted(self) -> tuple[str, ...]:
        return ("inputs", "image", "pixels") if self.stats else ("inputs",)

    def _normalise(self, pixels: np.ndarray) -> Decoded:
        assert self.stats is not None
        mean, std = self.stats
        image = torch.from_numpy(pixels.astype(np.float32) / 255.0)
        return Decoded(self.kind, [(((image - mean) / std).reshape(self.sample_shape),)])

    def _decode_bytes(self, data: bytes) -> Decoded:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                gray = image.convert("L").resize((self.width, self.height),
                                                 Image.Resampling.BILINEAR)
        except (UnidentifiedImageError, OSError, ValueError):
            raise InputError("image is not a readable PNG or JPEG.") from None
        return self._normalise(np.asarray(gray))

    def _decode_image(self, image: str, request: PredictRequest) -> Decoded:
        return self._decode_bytes(b64decode(image, "image"))

    def _decode_pixels(self, pixels: list[list[float]], request: PredictRequest) -> Decoded:
        array = np.asarray(pixels, dtype=np.float32)
        if array.shape != (self.height, self.width):
            raise InputError(f"pixels has shape {list(array.shape)}; this model takes "
                             f"{self.height} rows of {self.width} pixels.")
        if array.min() < 0 or array.max() > 255:
            raise InputError("pixel values must lie in [0, 255].")
        return self._normalise(array)

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        return self._decode_bytes(path.read_bytes())


def image_serving(sample_shape: Sequence[int], stats: tuple[float, float] | None
                  ) -> ServingSpec:
    """The spec of an image workload whose inputs were normalised with ``stats``."""
    def codec(model: nn.Module, state: Mapping[str, Any]) -> ImageCodec:
        saved = state.get("stats")
        return ImageCodec(state.get("shape", sample_shape),
                          (float(saved[0]), float(saved[1])) if saved else None)

    return ServingSpec(codec, {"shape": list(sample_shape),
                               "stats": [float(v) for v in stats] if stats else None})
