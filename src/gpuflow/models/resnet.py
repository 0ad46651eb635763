"""Residual networks (He et al. 2016) as plain ``nn.Module``s: resnet18 and resnet50.

The residual blocks are held in one ``nn.ModuleList`` named ``blocks``, in order, so
activation checkpointing wraps and FSDP shards them one by one (``Workload.blocks``).
Inputs of at most ``SMALL_INPUT`` pixels a side get the small-image stem (a 3x3 convolution,
no max-pool), as 32x32 images want; larger ones the ImageNet stem (7x7 stride 2, max-pool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

SMALL_INPUT = 64
WIDTHS = (64, 128, 256, 512)
LAYOUTS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}


def _norm(channels: int, zero: bool = False) -> nn.BatchNorm2d:
    norm = nn.BatchNorm2d(channels)
    if zero:  # the block starts as the identity: deep residual nets train from step one
        nn.init.zeros_(norm.weight)
    return norm


class _Block(nn.Module, ABC):
    """The residual sum and the projection shortcut both block types share."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.shortcut = (nn.Identity() if stride == 1 and inputs == outputs else
                         nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                       _norm(outputs)))

    @abstractmethod
    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The block's own path, added to the shortcut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


class BasicBlock(_Block):
    """Two 3x3 convolutions (resnet18, resnet34)."""

    expansion = 1

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__(inputs, width, stride)
        self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
        self.norm1 = _norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.norm2 = _norm(width, zero=True)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))


class Bottleneck(_Block):
    """1x1 down, 3x3 (strided, as in torchvision's v1.5), 1x1 up by 4 (resnet50 and deeper)."""

    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__(inputs, width * 4, stride)
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.norm1 = _norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.norm2 = _norm(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.norm3 = _norm(width * 4, zero=True)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = torch.relu(self.norm2(self.conv2(y)))
        return self.norm3(self.conv3(y))


class ResNet(nn.Module):
    """Stem, four stages of residual blocks (stride 2 from the second), global average
    pooling and a linear classifier, on float ``[N, C, H, W]`` inputs."""

    def __init__(self, kind: str = "resnet18", num_classes: int = 1000, in_channels: int = 3,
                 image_size: int = 224, width: int = 64) -> None:
        super().__init__()
        if kind not in LAYOUTS:
            raise ValueError(f"unknown ResNet {kind!r}; known: {', '.join(LAYOUTS)}")
        block_type, depths = LAYOUTS[kind]
        block = BasicBlock if block_type == "basic" else Bottleneck
        small = image_size <= SMALL_INPUT
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3 if small else 7, 1 if small else 2,
                      1 if small else 3, bias=False),
            _norm(width), nn.ReLU(),
            nn.Identity() if small else nn.MaxPool2d(3, 2, 1))
        blocks, inputs = [], width
        for stage, depth in enumerate(depths):
            planes = width * WIDTHS[stage] // WIDTHS[0]
            for index in range(depth):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(block(inputs, planes, stride))
                inputs = planes * block.expansion
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(inputs, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))
