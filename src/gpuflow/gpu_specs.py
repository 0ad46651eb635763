"""Datasheet peak FLOP/s of NVIDIA GPUs, the denominator of model-FLOPs utilisation (MFU).

Every figure is the *dense* rate: NVIDIA quotes tensor-core numbers "with sparsity" (marked with
an asterisk, "one-half lower without sparsity"), and a dense model never reaches those, so each
asterisked figure here is halved. Tensor figures are the FP32-accumulate rate, the one PyTorch's
matmuls run at. "fp32" is the plain CUDA-core rate (no TF32).

A name this table does not know returns ``None``: an MFU computed against some other card's peak
looks plausible and is wrong, so it is better to report none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gpuflow.precision import PEAK_KEYS

#: The precisions every entry carries, as ``PrecisionPolicy.peak_key`` names them.
PRECISIONS: tuple[str, ...] = PEAK_KEYS


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's dense datasheet peaks, and the device names that identify it.

    ``patterns`` are regular expressions that must match the *whole* normalised device name
    (see :func:`normalise_device_name`), so "a10" cannot match "a100" or "a10g", and a MIG slice
    ("a100-sxm4-40gb mig 1g.5gb"), which has a fraction of the card's compute, matches nothing.
    ``memory_gib`` is the datasheet's nominal capacity, not what ``torch`` reports as usable.
    """

    name: str
    patterns: tuple[str, ...]
    dense_tflops: dict[str, float] = field(hash=False)
    memory_gib: float
    source: str

    def __post_init__(self) -> None:
        # Fail at import rather than report a silently wrong MFU from a malformed entry.
        if set(self.dense_tflops) != set(PRECISIONS):
            raise ValueError(
                f"{self.name}: dense_tflops keys must be exactly {PRECISIONS}, "
                f"got {tuple(self.dense_tflops)}"
            )
        for precision, tflops in self.dense_tflops.items():
            if not (math.isfinite(tflops) and tflops > 0):
                raise ValueError(f"{self.name}: {precision} peak must be positive, got {tflops}")
        if not self.patterns:
            raise ValueError(f"{self.name}: needs at least one device-name pattern")
        for pattern in self.patterns:
            re.compile(pattern)
        if not (self.memory_gib > 0):
            raise ValueError(f"{self.name}: memory_gib must be positive, got {self.memory_gib}")

    def matches(self, device_name: str) -> bool:
        """Whether ``device_name`` (as torch reports it) is this model."""
        normalised = normalise_device_name(device_name)
        return any(re.fullmatch(pattern, normalised) for pattern in self.patterns)

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s (not TFLOP/s) for one of :data:`PRECISIONS`."""
        if precision not in self.dense_tflops:
            raise KeyError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
        return self.dense_tflops[precision] * 1e12


def normalise_device_name(device_name: str) -> str:
    """Lower-case, collapse whitespace and drop the "NVIDIA " prefix drivers put on names."""
    name = " ".join(device_name.lower().split())
    return name.removeprefix("nvidia ")


def _tflops(fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}


_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (FP32 19.5; TF32 156 | 312*; BF16/FP16 312 | 624*), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
# All A100 form factors and memory sizes share one compute column on the datasheet.
_A100_TFLOPS = (19.5, 156.0, 312.0, 312.0)

_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet, {column} column ({figures}; * with sparsity), "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet "
    "(also https://www.nvidia.com/en-us/data-center/h100/)"
)
_H200_SOURCE = (
    "NVIDIA H200 Tensor Core GPU specifications, {column} column ({figures}; * with sparsity), "
    "https://www.nvidia.com/en-us/data-center/h200/"
)

GPU_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="A100 SXM4 80GB",
        patterns=(r"a100-sxm4?-80gb",),
        dense_tflops=_tflops(*_A100_TFLOPS),
        memory_gib=80.0,
        source=_A100_SOURCE,
    ),
    GpuSpec(
        name="A100 SXM4 40GB",
        patterns=(r"a100-sxm4?-40gb",),
        dense_tflops=_tflops(*_A100_TFLOPS),
        memory_gib=40.0,
        source=_A100_SOURCE,
    ),
    GpuSpec(
        name="A100 PCIe 80GB",
        patterns=(r"a100 80gb pcie", r"a100-pcie-80gb"),
        dense_tflops=_tflops(*_A100_TFLOPS),
        memory_gib=80.0,
        source=_A100_SOURCE,
    ),
    GpuSpec(
        name="A100 PCIe 40GB",
        patterns=(r"a100-pcie-40gb", r"a100 40gb pcie"),
        dense_tflops=_tflops(*_A100_TFLOPS),
        memory_gib=40.0,
        source=_A100_SOURCE,
    ),
    GpuSpec(
        name="H100 SXM",
        # torch reports the SXM5 part as "NVIDIA H100 80GB HBM3".
        patterns=(r"h100 80gb hbm3", r"h100[- ]sxm5?[- ]80gb"),
        dense_tflops=_tflops(67.0, 494.5, 989.5, 989.5),
        memory_gib=80.0,
        source=_H100_SOURCE.format(
            column="H100 SXM", figures="FP32 67; TF32 989*; BF16/FP16 1,979*"
        ),
    ),
    GpuSpec(
        name="H100 PCIe",
        patterns=(r"h100(?: 80gb)? pcie",),
        dense_tflops=_tflops(51.0, 378.0, 756.5, 756.5),
        memory_gib=80.0,
        source=_H100_SOURCE.format(
            column="H100 PCIe", figures="FP32 51; TF32 756*; BF16/FP16 1,513*"
        ),
    ),
    GpuSpec(
        name="H100 NVL",
        patterns=(r"h100 nvl",),
        dense_tflops=_tflops(60.0, 417.5, 835.5, 835.5),
        memory_gib=94.0,
        source=_H100_SOURCE.format(
            column="H100 NVL", figures="FP32 60; TF32 835*; BF16/FP16 1,671*"
        ),
    ),
    GpuSpec(
        name="H200 SXM",
        # Plain "NVIDIA H200" is the SXM part; the H200 NVL is a separate, lower-power card.
        patterns=(r"h200", r"h200[- ]sxm5?(?:[- ]141gb)?"),
        dense_tflops=_tflops(67.0, 494.5, 989.5, 989.5),
        memory_gib=141.0,
        source=_H200_SOURCE.format(
            column="H200 SXM", figures="FP32 67; TF32 989*; BF16/FP16 1,979*"
        ),
    ),
    GpuSpec(
        name="H200 NVL",
        patterns=(r"h200 nvl",),
        dense_tflops=_tflops(60.0, 417.5, 835.5, 835.5),
        memory_gib=141.0,
        source=_H200_SOURCE.format(
            column="H200 NVL", figures="FP32 60; TF32 835*; BF16/FP16 1,671*"
        ),
    ),
    GpuSpec(
        name="L4",
        patterns=(r"l4",),
        dense_tflops=_tflops(30.3, 60.0, 121.0, 121.0),
        memory_gib=24.0,
        source=(
            "NVIDIA L4 Tensor Core GPU datasheet/specifications "
            "(FP32 30.3; TF32 120*; BF16/FP16 242*; * with sparsity), "
            "https://www.nvidia.com/en-us/data-center/l4/"
        ),
    ),
    # No L40 entry on purpose: its datasheet's tensor figures (BF16 181.05 | 362.1*) are half of
    # what the same AD102 die is rated at per SM and clock on the L40S and RTX 6000 Ada, and
    # nothing measured settles which is right, so "NVIDIA L40" returns None.
    GpuSpec(
        name="L40S",
        patterns=(r"l40s",),
        # The datasheet prints the dense BF16/FP16 figure itself (362.05), so it is used as is.
        dense_tflops=_tflops(91.6, 183.0, 362.05, 362.05),
        memory_gib=48.0,
        source=(
            "NVIDIA L40S GPU datasheet (FP32 91.6; TF32 183 | 366*; BF16/FP16 362.05 | 733*), "
            "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
        ),
    ),
    GpuSpec(
        name="A10G",
        # AWS's variant: more SMs and FP32 than the A10 but half the A10's tensor rate.
        # Measured bf16 matmuls on A10G top out near 69 TFLOP/s, so the A10's 125 can't apply.
        patterns=(r"a10g",),
        dense_tflops=_tflops(35.0, 35.0, 70.0, 70.0),
        memory_gib=24.0,
        source=(
            "NVIDIA A10G Tensor Core GPU datasheet for AWS "
            "(FP32 35 TF; TF32 35 | 70*; BF16/FP16 70 | 140*), "
            "https://d1.awsstatic.com/product-marketing/ec2/"
            "NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf"
        ),
    ),
    GpuSpec(
        name="A10",
        patterns=(r"a10",),
        dense_tflops=_tflops(31.2, 62.5, 125.0, 125.0),
        memory_gib=24.0,
        source=(
            "NVIDIA A10 Tensor Core GPU datasheet "
            "(FP32 31.2; TF32 62.5 | 125*; BF16/FP16 125 | 250*), "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/"
            "a10-datasheet.pdf"
        ),
    ),
    GpuSpec(
        name="GeForce RTX 4090",
        # GeForce Ada runs FP16/BF16 with FP32 accumulate at half the FP16-accumulate rate
        # (330.3); torch accumulates in FP32, so the 165.2 column is the reachable peak.
        patterns=(r"(?:geforce )?rtx 4090",),
        dense_tflops=_tflops(82.6, 82.6, 165.2, 165.2),
        memory_gib=24.0,
        source=(
            "NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090 column (FP32 82.6; "
            "TF32 82.6; BF16 and FP16 with FP32 accumulate 165.2, dense), "
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
            "nvidia-ada-gpu-architecture.pdf"
        ),
    ),
)


def lookup_gpu(device_name: str) -> GpuSpec | None:
    """The entry for ``torch.cuda.get_device_name()``'s answer, or ``None`` if unknown.

    ``None`` also when several entries match, so a table mistake can never hand back some other
    card's peak.
    """
    matches = [spec for spec in GPU_SPECS if spec.matches(device_name)]
    return matches[0] if len(matches) == 1 else None
