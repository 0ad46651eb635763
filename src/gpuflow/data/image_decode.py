"""Encoded image bytes to uint8 pixels of one crop: the decode the loader workers run.

A JPEG is decoded at 1/2, 1/4 or 1/8 of its size in the DCT domain (Pillow's ``draft``)
when the reduced image still holds the crop at the output resolution: most of a large
photo's decode time buys pixels the crop throws away. EXIF orientation is applied, any
mode (greyscale, palette, CMYK, alpha) is converted to the model's channels, and the crop
is cut and resized (``resize_crop``). Pixels stay uint8 (HWC) until the device.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

# Larger images are refused before decoding: a decompression bomb costs memory and time.
MAX_PIXELS = 64_000_000
# ImageNet's evaluation convention: the centre square of 87.5% of the shorter side.
CENTRE_FRACTION = 0.875
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # RandomResizedCrop's area and aspect ranges
_SWAPPED = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees
_X_REVERSED, _Y_REVERSED = {2, 3, 6, 7}, {3, 4, 7, 8}  # upright axes that run backwards

Box = tuple[float, float, float, float]  # left, top, right, bottom in the oriented image
BoxFn = Callable[[int, int], Box]


class ImageDecodeError(ValueError):
    """Bytes that are not a readable image: corrupt, truncated, unknown or too large."""


def open_image(data: bytes) -> Image.Image:
    """The image's header read (no pixels yet), refused when it is not an image or holds
    more than ``MAX_PIXELS`` pixels."""
    try:
        with warnings.catch_warnings():  # refused below, at a lower bound, as an error
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageDecodeError("not a readable image (no known image format)") from None
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(f"not a readable image ({exc})") from None
    if image.width * image.height > MAX_PIXELS:
        raise ImageDecodeError(f"{image.width}x{image.height} pixels is more than the "
                               f"{MAX_PIXELS:,} an image may hold")
    return image


def orientation(image: Image.Image) -> int:
    """The EXIF orientation tag: 1 (or absent) is upright."""
    return int(image.getexif().get(0x0112, 1) or 1)


def oriented_size(image: Image.Image, turned: int) -> tuple[int, int]:
    """Width and height once orientation ``turned`` is applied."""
    return (image.height, image.width) if turned in _SWAPPED else (image.width, image.height)


def random_resized_crop(width: int, height: int, rng: np.random.Generator,
                        scale: tuple[float, float] = SCALE,
                        ratio: tuple[float, float] = RATIO) -> Box:
    """RandomResizedCrop's box: a random area fraction and aspect ratio, ten tries, then the
    centre crop clamped to the ratio range (the tutorial transform's rule)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def centre_crop(width: int, height: int) -> Box:
    """The centre square of ``CENTRE_FRACTION`` of the shorter side."""
    side = min(width, height) * CENTRE_FRACTION
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def draft_request(size: tuple[int, int], box: Box, out: int) -> tuple[int, int]:
    """The smallest decoded size at which the crop still has ``out`` pixels a side."""
    width, height = size
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    return (math.ceil(width * out / max(crop_w, 1e-6)),
            math.ceil(height * out / max(crop_h, 1e-6)))


def decode_crop(data: bytes, box_fn: BoxFn, out: int, mode: str = "RGB",
                draft: bool = True) -> np.ndarray:
    """The crop ``box_fn(width, height)`` of the oriented image, resized to ``out`` x ``out``
    uint8 pixels (HWC) in ``mode`` ("RGB" or "L"). ``draft`` allows the reduced-size decode
    of a JPEG when the crop keeps its resolution."""
    image = open_image(data)
    try:
        turned = orientation(image)
        width, height = oriented_size(image, turned)
        box = box_fn(width, height)
        factor = 1.0
        if draft and image.format == "JPEG":
            request = draft_request((width, height), box, out)
            stored_width = image.width
            drafted = image.draft(mode if image.mode in ("RGB", "L") else None,
                                  request[::-1] if turned in _SWAPPED else request)
            if drafted is not None:  # the reduced image's exact extent: 1/2, 1/4 or 1/8
                factor = drafted[1][2] / stored_width
        if turned != 1:
            image = ImageOps.exif_transpose(image)
        if image.mode != mode:
            image = image.convert(mode)
        # A reduced decode's last row and column are partial; an axis the orientation
        # reverses starts with them, shifting its coordinates by what they lack.
        shift_x = image.width - width * factor if turned in _X_REVERSED else 0.0
        shift_y = image.height - height * factor if turned in _Y_REVERSED else 0.0
        scaled = (box[0] * factor + shift_x, box[1] * factor + shift_y,
                  min(box[2] * factor + shift_x, image.width),
                  min(box[3] * factor + shift_y, image.height))
        return resize_crop(image, scaled, out)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(f"cannot decode the image ({exc})") from None


def resize_crop(image: Image.Image, box: Box, out: int) -> np.ndarray:
    """The crop ``box`` of ``image`` resized to ``out`` x ``out`` (bilinear, antialiased),
    as writable uint8 HWC. A crop of whole pixels (every training crop of a full-size
    decode) is cut, then resized by torch's uint8 channels-last kernel, two to three times
    faster than Pillow's; a fractional box (a reduced decode, the centre crop), or one not
    inside the image, goes through Pillow's resize, which takes it as it is."""
    left, top, right, bottom = box
    inside = 0 <= left < right <= image.width and 0 <= top < bottom <= image.height
    if inside and all(float(edge).is_integer() for edge in box):
        pixels = torch.from_numpy(np.array(image.crop(tuple(map(int, box)))))
        nhwc = (pixels[..., None] if pixels.ndim == 2 else pixels)[None]
        resized = F.interpolate(nhwc.permute(0, 3, 1, 2), size=(out, out), mode="bilinear",
                                antialias=True)
        return resized[0].permute(1, 2, 0).contiguous().numpy()
    pixels = np.array(image.resize((out, out), Image.Resampling.BILINEAR, box=box),
                      dtype=np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels
