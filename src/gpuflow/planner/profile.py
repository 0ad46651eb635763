"""What the planner knows about a model: parameters, FLOPs and saved activations per sample.

A profile comes from tracing the workload's model (``gpuflow.planner.workload_profile``) or
from a transformer's dimensions alone (``gpuflow.planner.transformer``); the memory and
step-time models read nothing else of the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    """Per-sample figures of one model in one precision; bytes unless named otherwise."""

    name: str
    precision: str
    params: int
    block_params: int
    tp_params: int
    layers: int
    flops_per_sample: float
    act_per_sample: float
    act_block_per_sample: float
    act_tp_per_sample: float
    block_input_per_sample: float
    # Backward's largest excess over what forward saved: an op's backward holds the
    # gradients of its output and its input (twice its saved tensor) when everything saved
    # after it has been freed already. A front end's large tensors count less than a loss's.
    backward_excess_per_sample: float
    act_const: float
    tokens_per_sample: int | None
    source: str
    # The model's output (e.g. the logits): a pipeline's last stage keeps it for every
    # micro-batch of the step.
    output_per_sample: float = 0.0
    # Saved before the first block (e.g. the embedding's token ids): a pipeline's first stage
    # holds these, its last stage the rest of what lies outside the blocks.
    act_before_blocks_per_sample: float = 0.0
    # The most the front end (forward up to the first block) holds alive at once, saved or
    # not; and the micro-batch itself (inputs and target), which the step keeps throughout.
    front_peak_per_sample: float = 0.0
    batch_per_sample: float = 0.0
    # The largest tensor a block saves: checkpointing's recompute holds its gradients.
    largest_block_saved_per_sample: float = 0.0
    # Parameters that train (fp32 master weights, with gradients and optimizer state); None:
    # all of them. The rest are frozen (a LoRA run's base), held in ``frozen_bytes`` in all:
    # in their checkpoint's dtype, or NF4 codes.
    trained_params: int | None = None
    frozen_bytes: float = 0.0
    # The same model traced with its parameters in the compute dtype, as FSDP's mixed
    # precision gathers them (what flows between layers can then be low precision too);
    # None in fp32, or for this variant itself.
    with_low_precision_params: ModelProfile | None = None

    @property
    def trained_fraction(self) -> float:
        """The share of the parameters that train: a LoRA run's adapters, or all of them."""
        if self.trained_params is None or not self.params:
            return 1.0
        return self.trained_params / self.params
