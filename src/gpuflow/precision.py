"""Precision policies: autocast dtype, loss scaling and TF32 flags, applied the same way everywhere.

Master weights stay fp32 in every policy; only the compute inside autocast changes dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32: bool
    device_type: str

    @property
    def peak_key(self) -> str:
        """Which datasheet peak this policy's MFU is measured against: fp8 counts against the
        dense bf16 peak, as torchtitan reports it, so that its gain shows as a higher MFU."""
        if self.autocast_dtype is torch.bfloat16:
            return "bf16"
        if self.autocast_dtype is torch.float16:
            return "fp16"
        return "tf32" if self.tf32 else "fp32"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    def make_scaler(self) -> torch.amp.GradScaler | None:
        if not self.loss_scaling:
            return None
        return torch.amp.GradScaler(self.device_type)

    def describe(self) -> str:
        parts = {
            "fp32": "fp32 weights and compute",
            "tf32": "fp32 weights, TF32 tensor-core matmuls",
            "bf16": "fp32 master weights, bf16 autocast",
            "fp16": "fp32 master weights, fp16 autocast, dynamic loss scaling",
            "fp8": "fp32 master weights, fp8 matmuls (torchao float8) in the converted linear "
                   "layers, bf16 autocast elsewhere; MFU against the bf16 peak",
        }
        return parts[self.name]


def make_policy(name: str, device: torch.device) -> PrecisionPolicy:
    """Build the policy and set the process-wide TF32 flags it implies."""
    device_type = device.type
    tf32 = name == "tf32"
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    elif tf32:
        warnings.warn(
            "TF32 is a CUDA tensor-core mode; on the CPU the run computes in plain fp32.",
            stacklevel=2,
        )
        tf32 = False
    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(name)
    return PrecisionPolicy(
        name=name,
        autocast_dtype=dtype,
        loss_scaling=name == "fp16",
        tf32=tf32,
        device_type=device_type,
    )
