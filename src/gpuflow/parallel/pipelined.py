"""Pipeline stages (``--strategy pp``, or ``fsdp`` with ``--pp N``): each rank runs its share
of the model under a schedule, with FSDP sharding each stage over ``dp`` when asked."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpuflow.errors import UserError
from gpuflow.parallel.sharded import apply_fsdp
from gpuflow.parallel.strategy import (
    Loss,
    ModelParts,
    State,
    Strategy,
    apply_activation_checkpointing,
    resize_rows,
)
from gpuflow.telemetry import waits as timed_waits

if TYPE_CHECKING:
    from torch.amp import GradScaler

    from gpuflow.parallel.dims import ParallelDims
    from gpuflow.parallel.pipeline import Pipeline
    from gpuflow.precision import PrecisionPolicy
    from gpuflow.telemetry.steps import StepTimer


class Pipelined(Strategy):
    """The schedule runs a batch's micro-batches through the stages; only last stages hold
    the loss and outputs, and tied parameters' gradients are summed across stages."""

    supports_loss_scaling = False

    def __init__(self, dims: ParallelDims, device: torch.device, policy: PrecisionPolicy,
                 timer: StepTimer, compile: bool = False) -> None:
        super().__init__(dims, device, policy, timer, compile)
        if self.compile_requested:
            raise UserError("--compile is not supported with pipeline parallelism yet; "
                            "drop --compile or use fsdp/tp.")
        self.microbatches = 1
        self.batch_size = 1

    def setup(self, model: nn.Module, parts: ModelParts, example: Any, batch_size: int
              ) -> None:
        """Split the model into stages; this rank keeps its own, under FSDP when asked."""
        from gpuflow.parallel.pipeline import Pipeline  # torch's pipelining: ~30 MB to import

        assert self.mesh is not None
        dims = self.dims
        self.batch_size = batch_size
        self.microbatches = dims.pipeline_microbatches(batch_size)
        inputs = resize_rows(example, batch_size // self.microbatches)
        self.pipeline: Pipeline = Pipeline(
            model, parts.blocks(), inputs, self.mesh["pp"], dims.pp_schedule,
            self.microbatches, parts.loss_fn, self.device, split=dims.pp_split)
        self.model = self.forward_model = self.pipeline.parts
        stages = self.pipeline.stages
        if parts.activation_checkpointing:
            apply_activation_checkpointing(
                self.model, [block for stage in stages for block in self.pipeline.blocks_of(stage)])
        if dims.sharded:
            for stage in stages:
                apply_fsdp(stage.submod, self.pipeline.blocks_of(stage),
                           self.policy.autocast_dtype, dims.reshard_after_forward,
                           mesh=self.mesh["dp"], blocking_comm=self.host_collective_timer(),
                           wrap=dims.fsdp_wrap, prefetch=dims.fsdp_prefetch)
            self.pipeline.grad_shards = (dims.dp, self.dp_rank)

    def describe_pipeline(self) -> str:
        manual = ", manual stages" if self.pipeline.manual else ""
        return (f" x pp {self.dims.pp} ({self.dims.pp_schedule}, {self.microbatches} "
                f"micro-batches{manual})")

    # --- the step -------------------------------------------------------------------------

    def forward_backward(self, inputs: Any, target: torch.Tensor, loss_fn: Loss,
                         micro: int, accum: int, scaler: GradScaler | None) -> torch.Tensor:
        """The whole schedule for one batch (loss scaling is refused with pipelines); the
        schedule calls ``loss_fn`` on each of its micro-batches."""
        with self._collective_waits, self.policy.autocast():
            return self.pipeline.forward_backward(inputs, target, 1 / accum, loss_fn).detach()

    def finish_backward(self) -> None:
        self.pipeline.sync_tied_grads()

    def loss_holders(self) -> int:
        """Only last stages hold a loss; the others add zeros."""
        return self.dims.world // self.dims.pp

    def clip_grad_norm(self, max_norm: float) -> None:
        self.pipeline.clip_grad_norm(max_norm)

    # --- evaluation -----------------------------------------------------------------------

    def eval_outputs(self, inputs: Any, target: torch.Tensor) -> Any:
        """A pipeline runs full batches only: a short last batch is padded and the
        padding's outputs dropped."""
        size = int(target.shape[0])
        full = self.batch_size
        outputs = self.pipeline.forward(resize_rows(inputs, full), resize_rows(target, full))
        return None if outputs is None else resize_rows(outputs, size)

    def share_eval(self, result: dict[str, float]) -> dict[str, float]:
        return self.pipeline.broadcast_from_last(result)

    # --- state ----------------------------------------------------------------------------

    def local_state(self, optimizer: torch.optim.Optimizer) -> State:
        return self.pipeline.state_to_save(optimizer)

    def load_state(self, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                   optimizer_state: dict[str, Any], full: bool) -> None:
        self.pipeline.load(weights, optimizer, optimizer_state, full=full)

    def shard_request(self, optimizer: torch.optim.Optimizer, path: Path) -> State:
        from gpuflow.parallel import state

        return self.pipeline.state_to_load(optimizer, state.saved_model_keys(path))

    # --- telemetry ------------------------------------------------------------------------

    def untimed_waits(self) -> list[timed_waits.Wait] | None:
        waits = timed_waits.pipeline_waits()
        if self.dims.sharded and self.device.type != "cpu":
            waits += timed_waits.fsdp_waits()
        return waits

