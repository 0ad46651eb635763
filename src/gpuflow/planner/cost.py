"""Predicted time of one optimizer step: compute, communication and the pipeline bubble.

Compute is the step's FLOPs per device over the precision's dense peak times a calibrated
efficiency. Each collective costs ``steps * alpha + bytes_on_the_wire / bandwidth``
(alpha-beta model of a ring: an all-reduce moves ``2 (n-1)/n`` of the message per rank, an
all-gather or reduce-scatter ``(n-1)/n``) on the slowest link its group spans. Data-parallel
traffic runs beside backward on GPUs (DDP buckets, FSDP prefetch) and only what compute cannot
cover is exposed (on CPU ranks all of it is); tensor-parallel all-reduces and pipeline sends
sit on the critical path.
A 1F1B or GPipe pipeline idles ``(pp - 1) / m`` of the compute for ``m`` micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuflow.config_fields import DDP_DEFAULT_BUCKET_MIB
from gpuflow.planner.layout import Layout
from gpuflow.planner.machine import Hardware, Link
from gpuflow.planner.memory import FP32, local_share
from gpuflow.planner.profile import ModelProfile
from gpuflow.precision import PEAK_KEY


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: how often, how big, and on which link."""

    name: str
    count: int
    message_bytes: float
    seconds: float
    link: str
    overlapped: bool


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step; ``step_s`` = compute + recompute + bubble + exposed."""

    compute_s: float
    recompute_s: float
    bubble_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    collectives: list[Collective] = field(default_factory=list)

    @property
    def overlapped_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s


def _ring(kind: str, group: int, message: float, link: Link) -> float:
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    if kind == "all-reduce":
        return 2 * (group - 1) * link.latency_s + 2 * share * message / link.bandwidth
    if kind == "p2p":
        return link.latency_s + message / link.bandwidth
    return (group - 1) * link.latency_s + share * message / link.bandwidth


def predict_step_time(profile: ModelProfile, layout: Layout, hardware: Hardware) -> StepTime:
    """Time of one step of ``layout`` on ``hardware``."""
    share = local_share(profile, layout)
    rate = hardware.peak_flops[PEAK_KEY[layout.precision]] * hardware.efficiency
    samples = layout.micro_batch * layout.grad_accum
    compute = profile.flops_per_sample * samples / (layout.tp * layout.pp) / rate
    recompute = compute / 3 if layout.activation_checkpointing else 0.0
    compute_bytes = 2 if layout.low_precision else FP32
    micro = layout.grad_accum

    collectives: list[Collective] = []

    def add(name: str, kind: str, count: int, group: int, stride: int, message: float,
            overlapped: bool) -> None:
        if group <= 1 or count == 0:
            return
        link = hardware.link_for(group, stride)
        seconds = count * _ring(kind, group, message, link)
        collectives.append(Collective(name, count, message, seconds, link.name,
                                      overlapped and hardware.overlaps_communication))

    dp_stride = layout.tp
    if layout.strategy == "ddp":
        grads = FP32 * share.params
        bucket = (layout.bucket_mb or DDP_DEFAULT_BUCKET_MIB) * 2**20
        buckets = max(1, round(grads / bucket))
        add("grad all-reduce (DDP buckets)", "all-reduce", buckets, layout.dp, dp_stride,
            grads / buckets, True)
    elif layout.strategy == "fsdp":
        # Each block and the root, or the model as one unit; the root is gathered once. One
        # unit's collectives come before forward and after backward: nothing hides them.
        block_units = layout.fsdp_wrap == "block"
        units = max(1, round(share.layers)) + 1 if block_units else 1
        params = compute_bytes * share.params / units
        gathers = micro * ((2 if layout.resharded_blocks else 1) * (units - 1) + 1)
        add("param all-gather (FSDP)", "all-gather", gathers, layout.dp, dp_stride,
            params, block_units)
        # On CPU ranks gpuflow reduces FSDP's gradients with gloo's all-reduce, faster there
        # than its reduce-scatter (gpuflow.telemetry.host_collectives).
        reduction = "reduce-scatter" if hardware.overlaps_communication else "all-reduce"
        add(f"grad {reduction} (FSDP)", reduction, units, layout.dp, dp_stride,
            FP32 * share.params / units, block_units)
    if layout.tp > 1:
        activation = profile.block_input_per_sample * compute_bytes / FP32 * layout.micro_batch
        per_block = 4 + (2 if layout.activation_checkpointing else 0)
        add("activation all-reduce (TP)", "all-reduce", int(per_block * share.layers * micro),
            layout.tp, 1, activation, False)
    if layout.pp > 1:
        activation = profile.block_input_per_sample * compute_bytes / FP32 * layout.micro_batch
        add("activation send/recv (PP)", "p2p", 2 * micro, 2, layout.dp * layout.tp,
            activation, False)

    comm = sum(c.seconds for c in collectives)
    hidden_under = compute + recompute
    overlappable = sum(c.seconds for c in collectives if c.overlapped)
    # The last DDP bucket / FSDP unit can only start when backward is done with it.
    tail = max((c.seconds / c.count for c in collectives if c.overlapped), default=0.0)
    exposed_dp = max(overlappable - hidden_under, tail if overlappable else 0.0)
    exposed = exposed_dp + sum(c.seconds for c in collectives if not c.overlapped)
    bubble = (compute + recompute) * (layout.pp - 1) / micro if layout.pp > 1 else 0.0
    return StepTime(compute, recompute, bubble, comm, exposed,
                    compute + recompute + bubble + exposed, collectives)
