"""What the planner assumes about the machine: GPU peaks and memory, links, efficiencies.

GPU peak FLOP/s and memory come from ``gpuflow.gpu_specs`` (datasheets, with sources). Link
bandwidths here are per GPU and per direction, the figure a ring collective's bus bandwidth
approaches; every entry names its source. Any figure can be overridden by a flag, and
``gpuflow plan --measure`` replaces the efficiency with the MFU of a short training run of
the real model on a GPU of the planned type (and the link with a probe where two GPUs are
present). Every Hardware says where its efficiency came from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuflow.errors import UserError
from gpuflow.gpu_specs import GPU_SPECS, GpuSpec, lookup_gpu

GIB = 2**30


@dataclass(frozen=True)
class Link:
    """One interconnect: bandwidth per GPU per direction (bytes/s) and per-message latency."""

    name: str
    bandwidth: float
    latency_s: float
    source: str


def _gbps(gigabytes: float) -> float:
    return gigabytes * 1e9


LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink3", _gbps(300), 5e-6,
         "NVIDIA A100 datasheet: 3rd-gen NVLink 600 GB/s per GPU, both directions"),
    Link("nvlink4", _gbps(450), 5e-6,
         "NVIDIA H100/H200 datasheets: 4th-gen NVLink 900 GB/s per GPU, both directions"),
    Link("nvlink5", _gbps(900), 5e-6,
         "NVIDIA Blackwell datasheet: 5th-gen NVLink 1.8 TB/s per GPU, both directions"),
    Link("pcie4", _gbps(32), 10e-6,
         "PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, about 32 GB/s per direction"),
    Link("pcie5", _gbps(64), 10e-6,
         "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes, about 64 GB/s per direction"),
    Link("ib-hdr", _gbps(25), 10e-6, "NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port"),
    Link("ib-ndr", _gbps(50), 10e-6,
         "NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port (one per GPU in DGX H100)"),
    Link("roce-200", _gbps(25), 15e-6, "200 GbE RoCE v2 NIC: 200 Gb/s per port"),
    Link("roce-400", _gbps(50), 15e-6, "400 GbE RoCE v2 NIC: 400 Gb/s per port"),
    Link("ethernet-100", _gbps(12.5), 30e-6, "100 GbE NIC: 100 Gb/s per port"),
)}


@dataclass(frozen=True)
class GpuType:
    """A ``--gpu-type`` name: its datasheet entry, the links it usually comes with, and the
    fraction of the dense peak a training step sustains (the calibrated efficiency)."""

    key: str
    spec_name: str
    intra: str
    inter: str
    efficiency: float


# The fallback efficiency when none is measured or given, 0.45 of the dense peak: the middle
# of the model-FLOPs utilisation published for eager FSDP training of 8B-70B transformers on
# A100/H100 (torchtitan docs/performance.md: 33-39% on H100 at 500 W, 50-58% on A100).
DEFAULT_EFFICIENCY = 0.45
DEFAULT_EFFICIENCY_SOURCE = (
    f"default {DEFAULT_EFFICIENCY}, not measured: the middle of published MFUs for FSDP "
    "training on A100/H100 (plan --measure on the GPU type measures it)")
GPU_TYPES: dict[str, GpuType] = {t.key: t for t in (
    GpuType("a100-40g", "A100 SXM4 40GB", "nvlink3", "ib-hdr", DEFAULT_EFFICIENCY),
    GpuType("a100-80g", "A100 SXM4 80GB", "nvlink3", "ib-hdr", DEFAULT_EFFICIENCY),
    GpuType("a100-pcie", "A100 PCIe 80GB", "pcie4", "ib-hdr", DEFAULT_EFFICIENCY),
    GpuType("h100", "H100 SXM", "nvlink4", "ib-ndr", DEFAULT_EFFICIENCY),
    GpuType("h100-pcie", "H100 PCIe", "pcie5", "ib-ndr", DEFAULT_EFFICIENCY),
    GpuType("h100-nvl", "H100 NVL", "pcie5", "ib-ndr", DEFAULT_EFFICIENCY),
    GpuType("h200", "H200 SXM", "nvlink4", "ib-ndr", DEFAULT_EFFICIENCY),
    GpuType("l4", "L4", "pcie4", "ethernet-100", DEFAULT_EFFICIENCY),
    GpuType("l40s", "L40S", "pcie4", "roce-200", DEFAULT_EFFICIENCY),
    GpuType("a10g", "A10G", "pcie4", "ethernet-100", DEFAULT_EFFICIENCY),
    GpuType("rtx4090", "GeForce RTX 4090", "pcie4", "ethernet-100", DEFAULT_EFFICIENCY),
)}

# CUDA context, cuBLAS/NCCL workspaces and allocator slack a CUDA process holds besides tensors.
GPU_FRAMEWORK_OVERHEAD = int(1.5 * GIB)


@dataclass(frozen=True)
class Hardware:
    """The machine a plan is for: ``nodes`` x ``gpus_per_node`` identical devices."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    efficiency: float
    framework_overhead: int
    source: str
    efficiency_source: str = DEFAULT_EFFICIENCY_SOURCE
    # GPUs run collectives on their own streams, beside compute. CPU ranks run gloo's
    # threads on the cores the compute uses, and FSDP2 has no side streams there to prefetch
    # on: every collective adds to the step.
    overlaps_communication: bool = True

    @property
    def devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def link_for(self, group: int, stride: int = 1) -> Link:
        """The slowest link a group of ``group`` ranks, ``stride`` apart, has to cross."""
        return self.intra if group * stride <= self.gpus_per_node else self.inter


def _spec(name: str) -> GpuSpec:
    return next(spec for spec in GPU_SPECS if spec.name == name)


def gpu_type_of(device_name: str) -> str | None:
    """The ``--gpu-type`` key of a ``torch.cuda.get_device_name()`` answer, if the table has
    it."""
    spec = lookup_gpu(device_name)
    return next((key for key, kind in GPU_TYPES.items()
                 if spec is not None and spec.name == kind.spec_name), None)


def resolve_link(name: str) -> Link:
    if name not in LINKS:
        raise UserError(f"Unknown interconnect {name!r}; known: {', '.join(LINKS)}.")
    return LINKS[name]


def gpu_hardware(gpu_type: str, gpus: int, nodes: int = 1, memory_gib: float | None = None,
                 intra_gbps: float | None = None, inter_gbps: float | None = None,
                 efficiency: float | None = None) -> Hardware:
    """A cluster of ``nodes`` x ``gpus`` of a known type, with flag overrides applied."""
    key = gpu_type.lower()
    if key not in GPU_TYPES:
        raise UserError(f"Unknown --gpu-type {gpu_type!r}; known: {', '.join(GPU_TYPES)}.")
    if gpus < 1 or nodes < 1:
        raise UserError(f"--gpus and --nodes must be at least 1 (got {gpus}, {nodes}).")
    kind = GPU_TYPES[key]
    spec = _spec(kind.spec_name)
    intra, inter = LINKS[kind.intra], LINKS[kind.inter]
    if intra_gbps is not None:
        intra = replace(intra, name="--intra-bw", bandwidth=_gbps(intra_gbps), source="flag")
    if inter_gbps is not None:
        inter = replace(inter, name="--inter-bw", bandwidth=_gbps(inter_gbps), source="flag")
    if efficiency is not None and not 0 < efficiency <= 1:
        raise UserError(f"--efficiency must be in (0, 1] (got {efficiency}).")
    return Hardware(
        name=spec.name,
        peak_flops={p: spec.peak_flops(p) for p in spec.dense_tflops},
        memory_bytes=int((memory_gib if memory_gib is not None else spec.memory_gib) * GIB),
        gpus_per_node=gpus, nodes=nodes, intra=intra, inter=inter,
        efficiency=efficiency if efficiency is not None else kind.efficiency,
        framework_overhead=GPU_FRAMEWORK_OVERHEAD,
        source=spec.source,
        efficiency_source="--efficiency" if efficiency is not None else
        DEFAULT_EFFICIENCY_SOURCE,
    )


# Loopback gloo between processes of one host: a memory copy through the kernel's TCP stack.
LOOPBACK = Link("loopback-gloo", _gbps(2.0), 50e-6,
                "assumed: gloo over loopback TCP, about 2 GB/s; `--measure` probes it")


def cpu_hardware(processes: int, peak_flops: dict[str, float], memory_bytes: int,
                 efficiency: float = 0.5, link: Link = LOOPBACK) -> Hardware:
    """This host's CPU as ``processes`` gloo ranks sharing its cores and memory."""
    return Hardware(
        name="cpu", peak_flops=peak_flops, memory_bytes=memory_bytes // max(1, processes),
        gpus_per_node=processes, nodes=1, intra=link, inter=link, efficiency=efficiency,
        framework_overhead=0, source="measured torch.mm peak of this CPU (gpuflow.devices)",
        efficiency_source=f"assumed {efficiency} of this CPU's measured matmul peak",
        overlaps_communication=False,
    )
