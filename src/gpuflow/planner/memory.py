"""Predicted peak memory of one device (the most loaded rank) for a layout.

Model state follows gpuflow's precision policy: fp32 master weights, fp32 gradients and fp32
optimizer state in every precision (bf16/fp16 only change what autocast computes in), for
the parameters that train; a LoRA run's frozen base has none of the three, only its weights
as held (in the checkpoint's 16-bit dtype, or NF4 codes).
Activations come from the model's profile. Parameters and the micro-batch are held
throughout; on top of them the peak is the largest of these moments:

* backward begins: optimizer state, all saved activations (while backward frees them it
  fills gradients, so one step holds the larger of the two, or both when earlier
  micro-batches already left gradients), backward's first gradients (an op's backward
  holds its output's and its input's: twice the largest saved tensor) and buffers
  (low-precision weight copies made by autocast, FSDP's gathered root, DDP's buckets);
* backward inside the blocks, once what was saved after them is freed: FSDP's resharded
  blocks gathered again, or checkpointing re-creating one block;
* forward's front end (up to the first block) at its transient peak;
* the optimizer step: gradients, optimizer state and the optimizer's temporaries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gpuflow.planner.layout import OPTIMIZER_STATE_BYTES, Layout
from gpuflow.planner.profile import ModelProfile

FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device; ``peak`` is what must fit."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    temporary: float
    overhead: float
    peak: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class LocalShare:
    """How many parameters one rank holds, before any FSDP sharding."""

    params: float
    block_params: float
    layers: float
    stage_fraction: float


def local_share(profile: ModelProfile, layout: Layout) -> LocalShare:
    """The most loaded pipeline stage's share of the model, split by tensor parallelism.

    Blocks are spread evenly over stages (the first ``layers % pp`` stages take one more);
    the parameters outside the blocks (embeddings, head) sit on the first and last stage,
    taken as half each when ``pp`` > 1.
    """
    layers = math.ceil(profile.layers / layout.pp) if profile.layers else 0
    fraction = layers / profile.layers if profile.layers else 1.0 / layout.pp
    tp_part = profile.tp_params * fraction / layout.tp
    rest = (profile.block_params - profile.tp_params) * fraction
    outer = (profile.params - profile.block_params) * (1.0 if layout.pp == 1 else 0.5)
    return LocalShare(outer + tp_part + rest, tp_part + rest, layers, fraction)


def model_state_bytes(params: float, dp: int, shard_optimizer: bool, shard_gradients: bool,
                      shard_parameters: bool, param_bytes: float = FP32,
                      grad_bytes: float = FP32, optimizer_bytes: float = 8) -> float:
    """Parameters + gradients + optimizer state per rank, each sharded over ``dp`` or not:
    the three ZeRO stages are (T, F, F), (T, T, F) and (T, T, T)."""
    return params * (param_bytes / (dp if shard_parameters else 1)
                     + grad_bytes / (dp if shard_gradients else 1)
                     + optimizer_bytes / (dp if shard_optimizer else 1))


def _block_local(profile: ModelProfile, layout: Layout, share: LocalShare) -> float:
    """What this rank's blocks save per sample: tensor parallelism splits its layers' share."""
    return (profile.act_block_per_sample - profile.act_tp_per_sample
            + profile.act_tp_per_sample / layout.tp) * share.stage_fraction


def _checkpointed(layout: Layout, share: LocalShare) -> bool:
    return layout.activation_checkpointing and share.layers > 0


def activation_bytes(profile: ModelProfile, layout: Layout, share: LocalShare) -> float:
    """Saved activations of the in-flight micro-batches on the most loaded stage, as
    backward begins.

    Tensor parallelism splits what its plan's layers save; activation checkpointing keeps
    each block's input (and a pipeline stage is charged one re-created block on top). A
    1F1B pipeline's first stage holds ``pp`` micro-batches at once, its last stage one at a
    time and the outputs of all of them; the busier of the two sets the peak.
    """
    block_local = _block_local(profile, layout, share)
    outer = profile.act_per_sample - profile.act_block_per_sample
    if layout.pp == 1:
        if _checkpointed(layout, share):
            block_local = share.layers * profile.block_input_per_sample
        return layout.micro_batch * (block_local + outer)
    if _checkpointed(layout, share):
        block_local = (share.layers * profile.block_input_per_sample
                       + block_local / share.layers)
    # The first stage holds what is saved before the blocks, and the output it sent on (kept
    # to run backward with the gradient that comes back), for every micro-batch in flight;
    # the last stage runs each micro-batch's backward right after its forward, but
    # torch.distributed.pipelining's schedules keep its output of every micro-batch until
    # the step ends (they return them merged).
    before = profile.act_before_blocks_per_sample
    sent = profile.block_input_per_sample
    first = (layout.micro_batch * min(layout.pp, layout.grad_accum)
             * (block_local + before + sent))
    retained = profile.output_per_sample * layout.micro_batch * layout.grad_accum
    last = layout.micro_batch * (block_local + outer - before) + retained
    return max(first, last)


def front_end_bytes(profile: ModelProfile, layout: Layout, share: LocalShare) -> float:
    """What forward holds while its front end (up to the first block) peaks: that peak, and
    on a pipeline's first stage what the earlier micro-batches in flight saved."""
    if layout.pp == 1:
        return layout.micro_batch * profile.front_peak_per_sample
    in_flight = min(layout.pp, layout.grad_accum)
    earlier = in_flight - 1
    block_local = _block_local(profile, layout, share)
    return layout.micro_batch * (earlier * (block_local + profile.act_before_blocks_per_sample)
                                 + profile.front_peak_per_sample)


def recompute_bytes(profile: ModelProfile, layout: Layout, share: LocalShare) -> float:
    """With checkpointing on one stage, what backward holds while it re-creates a block:
    every block's input, what was saved before the blocks, that block's activations and
    the gradients of its largest tensor. What was saved after the blocks is freed by then."""
    if layout.pp > 1 or not _checkpointed(layout, share):
        return 0.0
    one_block = _block_local(profile, layout, share) / share.layers
    return layout.micro_batch * (share.layers * profile.block_input_per_sample
                                 + profile.act_before_blocks_per_sample + one_block
                                 + 2 * profile.largest_block_saved_per_sample)


def _gathered_bytes(profile: ModelProfile, compute_bytes: float) -> float:
    """Bytes per parameter FSDP gathers: the compute dtype's, or less for a frozen base held
    in fewer (NF4 codes are gathered as codes)."""
    frozen_params = profile.params * (1 - profile.trained_fraction)
    if not frozen_params:
        return compute_bytes
    frozen = min(compute_bytes, profile.frozen_bytes / frozen_params)
    return compute_bytes * profile.trained_fraction + frozen * (1 - profile.trained_fraction)


def predict_memory(profile: ModelProfile, layout: Layout, overhead: float = 0.0
                   ) -> MemoryBreakdown:
    """Peak bytes on the most loaded device of ``layout``."""
    fsdp = layout.strategy == "fsdp"
    if fsdp and profile.with_low_precision_params is not None:
        profile = profile.with_low_precision_params  # what FSDP's mixed precision runs
    share = local_share(profile, layout)
    shard = layout.dp if fsdp else 1
    # Only the trained parameters (all, or a LoRA run's adapters) have fp32 master weights,
    # gradients and optimizer state; a frozen base is held as loaded (16-bit or NF4).
    trained = share.params * profile.trained_fraction
    frozen = profile.frozen_bytes * share.params / profile.params if profile.params else 0.0
    params = (FP32 * trained + frozen) / shard
    grads = FP32 * trained / shard
    optimizer = OPTIMIZER_STATE_BYTES[layout.optimizer] * trained / shard
    activations = activation_bytes(profile, layout, share)

    # An op's backward holds the gradients of its output and of its input at once; a
    # pipeline stage also holds the gradient exchanged with its neighbour.
    exchanged = profile.block_input_per_sample if layout.pp > 1 else 0.0
    backward_gradients = (profile.backward_excess_per_sample + exchanged) * layout.micro_batch
    # Buffers alive through forward and backward.
    buffers = 0.0
    gathered = _gathered_bytes(profile, 2 if layout.low_precision else FP32)
    per_block = share.block_params / max(1.0, share.layers)
    # Resharded blocks are gathered one at a time (and the next one, or --fsdp-prefetch
    # more, prefetched), in forward and again once backward reaches them; backward begins
    # with only the root's gathered.
    blocks_gathered = 0.0
    if layout.resharded_blocks:
        buffers += gathered * (share.params - share.block_params)
        blocks_gathered = gathered * (1 + (layout.fsdp_prefetch or 1)) * per_block
    elif fsdp:
        buffers += gathered * share.params
    elif layout.low_precision:
        buffers += profile.act_const * share.params / profile.params
    if layout.pp > 1:
        # A stage's micro-batches overlap these moments: its gathered blocks count throughout.
        buffers += blocks_gathered
        blocks_gathered = 0.0
    if layout.strategy == "ddp":
        buffers += FP32 * trained
    # gpuflow's fused AdamW/SGD updates in place. DTensor has no rule for fused SGD, so SGD
    # on sharded or tensor-parallel parameters takes the foreach path, which keeps about one
    # parameter-sized intermediate alive while it updates.
    foreach = layout.optimizer == "sgd" and (fsdp or layout.tp > 1)
    optimizer_temporary = FP32 * trained / shard if foreach else 0.0

    held_grads = grads if layout.grad_accum > 1 and not fsdp else 0.0
    # The front end can hold more at once than all that forward saves (a speech model's
    # spectrogram under autocast), but not while backward's temporaries exist.
    front = front_end_bytes(profile, layout, share)
    recompute = recompute_bytes(profile, layout, share)
    in_blocks = buffers + blocks_gathered
    # Inside the blocks' backward, what was saved after them (the logits) is already freed.
    after_blocks = (profile.act_per_sample - profile.act_block_per_sample
                    - profile.act_before_blocks_per_sample) * layout.micro_batch
    block_gradients = 2 * profile.largest_block_saved_per_sample * layout.micro_batch
    in_block_backward = (activations - after_blocks + held_grads + block_gradients + in_blocks
                         if blocks_gathered else 0.0)
    forward_backward = optimizer + max(
        max(activations + held_grads, grads) + backward_gradients + buffers,
        in_block_backward, recompute + held_grads + in_blocks, front + held_grads)
    optimizer_step = grads + optimizer + optimizer_temporary
    if layout.strategy == "ddp":
        optimizer_step += FP32 * trained
    batch = profile.batch_per_sample * layout.micro_batch
    peak = overhead + params + batch + max(forward_backward, optimizer_step)
    return MemoryBreakdown(params, grads, optimizer, activations,
                           backward_gradients + in_blocks, overhead, peak)
