"""Serving colour image classifiers: an encoded JPEG/PNG/WebP file in, top-k class names out.

A request's image gets the evaluation transform of training (the centre crop, resized to the
trained size, as uint8 HWC); the model normalises on the device as it did in training. The
class names and the size are the codec's state, saved with the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuflow.data.image_batches import as_encoded
from gpuflow.data.image_decode import ImageDecodeError, centre_crop, decode_crop
from gpuflow.serving import (
    Decoded,
    InputError,
    InputField,
    InputSchema,
    PredictRequest,
    ServingSpec,
    TensorCodec,
    b64decode,
    top_labels,
)


class ColourImageCodec(TensorCodec):
    """An image (``{"image": base64}``, a raw or multipart upload, or a file) or raw uint8
    pixels (``{"inputs": [N x H x W x 3]}``); answers with class names."""

    kind = "image"
    file_suffixes = (".json", ".jpg", ".jpeg", ".png", ".webp")

    def __init__(self, classes: Sequence[str], size: int) -> None:
        super().__init__(InputSchema("tensor", (InputField("inputs", "uint8",
                                                           (size, size, 3)),)))
        self.classes, self.size = list(classes), size

    def accepted(self) -> tuple[str, ...]:
        return ("image", "inputs")

    def _decode_bytes(self, data: bytes) -> Decoded:
        try:
            pixels = decode_crop(data, centre_crop, self.size, "RGB")
        except ImageDecodeError as exc:
            raise InputError(f"image is not a readable JPEG, PNG or WebP: {exc}.") from None
        return Decoded(self.kind, [(torch.from_numpy(pixels),)])

    def _decode_image(self, image: str, request: PredictRequest) -> Decoded:
        return self._decode_bytes(b64decode(image, "image"))

    def _decode_path(self, path: Path, defaults: dict[str, Any]) -> Decoded:
        return self._decode_bytes(path.read_bytes())

    def from_sample(self, inputs: Any, defaults: dict[str, Any]) -> Decoded:
        """A packed set's sample: a file's name and bytes (``gpuflow data pack --workload
        images``), decoded as a request's image is; else pixels as the model takes them."""
        if isinstance(inputs, tuple | list) and len(inputs) == 2:
            return self._decode_bytes(as_encoded(inputs)[1])  # type: ignore[arg-type]
        return super().from_sample(inputs, defaults)

    def format(self, output: Any, request: PredictRequest) -> dict[str, Any]:
        return top_labels(output, self.classes, request.top_k)


def images_serving(classes: Sequence[str], size: int) -> ServingSpec:
    """The spec of the images workload: its class names and crop size."""
    def codec(model: nn.Module, state: Mapping[str, Any]) -> ColourImageCodec:
        return ColourImageCodec(state.get("classes", classes), int(state.get("size", size)))

    return ServingSpec(codec, {"classes": list(classes), "size": size})
