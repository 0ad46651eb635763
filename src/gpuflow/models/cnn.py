"""A small residual CNN for image classification."""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection; shapes are preserved."""

    def __init__(self, channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels)
        self.dropout = nn.Dropout2d(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.dropout(self.norm2(self.conv2(y)))
        return torch.relu(x + y)


class SmallCNN(nn.Module):
    """Stem, ``depth`` residual blocks, global pooling and a linear classifier.

    ``stem_stride`` 2 halves the resolution once, which is what 28x28 inputs want.
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 32, depth: int = 2,
        dropout: float = 0.1, stem_stride: int = 1,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=stem_stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.blocks = nn.ModuleList(ConvBlock(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))
