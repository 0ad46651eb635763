"""Precision policies: autocast dtype, loss scaling and TF32 flags, applied the same way everywhere.

Master weights stay fp32 in every policy; only the compute inside autocast changes dtype.
The precision names, the dtype each computes in and the datasheet peak each one's MFU is
measured against are defined here once; the config, the device probe and the planner read
them. Importing this module does not import torch (the CLI builds its flags from the names).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

# The dtype autocast computes in, by its name in torch; fp32 and tf32 run without autocast.
# fp8's matmuls are torchao's float8 ones; the rest of its step runs under bf16 autocast.
_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}

# The datasheet peak (a key of gpuflow.gpu_specs) each precision's MFU is measured against:
# fp8 counts against the dense bf16 peak, as torchtitan reports it, so that its gain shows
# as a higher MFU.
PEAK_KEY: dict[str, str] = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16",
                            "fp8": "bf16"}
PEAK_KEYS: tuple[str, ...] = tuple(dict.fromkeys(PEAK_KEY.values()))


def autocast_dtype(name: str) -> torch.dtype | None:
    """The dtype autocast computes in under precision (or peak key) ``name``; None for fp32
    and tf32, which run without autocast."""
    import torch

    return getattr(torch, _AUTOCAST[name]) if name in _AUTOCAST else None


def compute_dtype(name: str) -> torch.dtype:
    """The dtype matmuls take under ``name``: its autocast dtype, else float32 (TF32 is a
    tensor-core mode of float32 data)."""
    import torch

    dtype = autocast_dtype(name)
    return torch.float32 if dtype is None else dtype


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32: bool
    device_type: str

    @property
    def peak_key(self) -> str:
        """Which datasheet peak this policy's MFU is measured against (:data:`PEAK_KEY`): tf32
        counts as fp32 where it runs as fp32 (a CPU)."""
        key = PEAK_KEY[self.name]
        return "fp32" if key == "tf32" and not self.tf32 else key

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        import torch

        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    def make_scaler(self) -> torch.amp.GradScaler | None:
        if not self.loss_scaling:
            return None
        import torch

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
    import torch

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
    return PrecisionPolicy(
        name=name,
        autocast_dtype=autocast_dtype(name),
        loss_scaling=name == "fp16",
        tf32=tf32,
        device_type=device_type,
    )
