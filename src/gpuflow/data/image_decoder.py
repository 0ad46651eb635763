"""Which decoder reads the training images: ``--decode auto|cpu|gpu``.

JPEG decode on the GPU (NVIDIA's nvImageCodec, the optional ``nvidia-nvimgcodec-cu13`` wheel
with its nvJPEG) needs the library and a CUDA device, and is checked by decoding a small
JPEG there once. ``auto`` takes it where that works, and otherwise decodes in the CPU loader
workers and says once why.
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import cache

import torch

from gpuflow.data.device_decoders import NvImageCodecDecoder, probe_jpeg
from gpuflow.errors import UserError

CHOICES = ("auto", "cpu", "gpu")


def _nvimgcodec_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ImportError:  # no ``nvidia`` package at all
        return False


@cache
def gpu_decode_missing() -> str | None:
    """Why JPEG decode cannot run on the GPU here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not _nvimgcodec_installed():
        return ("nvImageCodec is not installed (pip install 'gpuflow[gpu-decode]', or "
                "nvidia-nvimgcodec-cu13 and nvidia-nvjpeg)")
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        decoded = NvImageCodecDecoder(device).decode([probe_jpeg()], device)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        return f"nvImageCodec does not load ({type(exc).__name__}: {exc})"
    if decoded[0] is None:
        return ("nvImageCodec loads but decodes no JPEG on the GPU (its GPU backends need "
                "nvJPEG: pip install nvidia-nvjpeg)")
    return None


def choose_decoder(requested: str | None) -> str:
    """The decoder for ``--decode`` (None: auto): "gpu" or "cpu", or a UserError when
    "gpu" cannot run here."""
    choice = requested or "auto"
    if choice not in CHOICES:
        raise UserError(f"--decode {choice!r}: choose one of {', '.join(CHOICES)}.")
    if choice == "cpu":
        return "cpu"
    reason = gpu_decode_missing()
    if reason is None:
        return "gpu"
    if choice == "gpu":
        raise UserError(f"--decode gpu cannot decode on the GPU: {reason}. Use --decode cpu "
                        "(or auto, which falls back to the CPU and says so).")
    warnings.warn(f"images: decoding on the CPU in the loader workers: {reason}.",
                  stacklevel=2)
    return "cpu"
