"""The training crop of a decoded image, on whatever device holds it.

The loader's CPU path cuts a RandomResizedCrop box out of the image and resizes it with
Pillow's bilinear filter, which widens its support when it shrinks (an antialiased
resize); ``F.interpolate(..., antialias=True)`` is the same filter, so a crop made here
from a full-size decode stays within a stated bound of the CPU path's (the tests give it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Box = tuple[int, int, int, int]  # left, top, right, bottom in the upright image


def crop_resize_flip(image: torch.Tensor, box: Box, out: int, flip: bool) -> torch.Tensor:
    """uint8 ``[out, out, C]``: ``box`` of the HWC uint8 ``image``, bilinear (antialiased)
    resized, mirrored left to right when ``flip``."""
    left, top, right, bottom = box
    crop = image[top:bottom, left:right].permute(2, 0, 1).unsqueeze(0).float()
    resized = F.interpolate(crop, size=(out, out), mode="bilinear", antialias=True,
                            align_corners=False)
    pixels = resized.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
    return (pixels.flip(1) if flip else pixels).contiguous()
