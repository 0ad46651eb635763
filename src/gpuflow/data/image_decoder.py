"""Which decoder reads the images: ``--decode auto|cpu|gpu``.

JPEG decode on the GPU (NVIDIA's nvImageCodec, the optional ``nvidia-nvimgcodec-cu13`` wheel)
needs the library and a CUDA device; this build decodes in the CPU loader workers, and
``auto`` says once why when it does so.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from gpuflow.errors import UserError

CHOICES = ("auto", "cpu", "gpu")


def gpu_decode_missing() -> str | None:
    """Why JPEG decode cannot run on the GPU here, or None when it could."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if importlib.util.find_spec("nvidia.nvimgcodec") is None:
        return "nvImageCodec is not installed (pip install nvidia-nvimgcodec-cu13)"
    return "GPU decode is not wired into this build's loader yet"


def choose_decoder(requested: str | None) -> str:
    """The decoder for ``--decode`` (None: auto): "cpu" here, or a UserError for "gpu"."""
    choice = requested or "auto"
    if choice not in CHOICES:
        raise UserError(f"--decode {choice!r}: choose one of {', '.join(CHOICES)}.")
    if choice == "cpu":
        return "cpu"
    reason = gpu_decode_missing()
    if choice == "gpu":
        raise UserError(f"--decode gpu cannot decode on the GPU: {reason}. Use --decode cpu "
                        "(or auto, which falls back to the CPU and says so).")
    warnings.warn(f"images: decoding on the CPU in the loader workers: {reason}.",
                  stacklevel=2)
    return "cpu"
