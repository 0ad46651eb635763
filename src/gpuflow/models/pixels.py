"""The input layer of an image model fed uint8 pixels: conversion on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class UInt8Images(nn.Module):
    """Takes uint8 ``[N, H, W, C]`` pixels, as the loader collates them, and calls ``net``
    on float ``[N, C, H, W]`` in [0, 1] normalised by ``mean`` and ``std``.

    The batch crosses to the device as bytes (a quarter of float32's); the conversion runs
    there. NHWC permuted to NCHW is already the channels_last layout convolutions prefer.
    """

    def __init__(self, net: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.permute(0, 3, 1, 2).float().div_(255.0)
        x = (x - self.mean) / self.std
        return self.net(x.contiguous(memory_format=torch.channels_last))
