"""The one interface behind which every parallel layout runs a training step.

A strategy is built from a :class:`~gpuflow.parallel.dims.ParallelDims` before the model is
wrapped (the data loader and the batch probe need its ranks), then :meth:`Strategy.setup`
wraps the model. From there the trainer asks it to run a micro-batch's forward and backward,
to skip gradient sync on accumulation steps, to clip, to evaluate, to save and load its state,
and which collective waits it times; it never asks which strategy it holds. This module
knows none of the layouts: :func:`gpuflow.parallel.build_strategy` picks the one that runs
a run's dims.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims
from gpuflow.telemetry import waits as timed_waits

if TYPE_CHECKING:
    from torch.amp import GradScaler
    from torch.distributed.tensor.parallel import ParallelStyle

    from gpuflow.precision import PrecisionPolicy
    from gpuflow.telemetry.steps import StepTimer

Loss = Callable[[Any, torch.Tensor], torch.Tensor]
State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def resize_rows(tree: Any, rows: int) -> Any:
    """Every tensor in ``tree`` cut or padded (repeating its last row) to ``rows`` rows.

    A traced pipeline runs fixed micro-batch shapes: the trace needs an example of exactly
    one micro-batch, and a short last evaluation batch is padded up to a full one.
    """
    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[0] >= rows:
            return tensor[:rows]
        padding = tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, padding])

    return torch.utils._pytree.tree_map_only(torch.Tensor, resize, tree)


@dataclass(frozen=True)
class ModelParts:
    """What a strategy needs to know of a workload's model, and nothing of its data.

    ``call_model(model, inputs)`` is the workload's one rule for calling its model with a
    batch's inputs (:func:`gpuflow.workload.call_model`): the inputs stay opaque here.
    """

    blocks: Callable[[], list[nn.Module]]
    loss_fn: Loss
    tensor_plan: Callable[[int], Mapping[str, ParallelStyle] | None]
    call_model: Callable[[nn.Module, Any], Any]
    activation_checkpointing: bool = False
    saves_frozen: bool = True  # False: checkpoints leave out frozen weights (LoRA's base)


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> int:
    """Wrap each repeated block so its activations are recomputed in backward."""
    if not blocks:
        raise UserError(
            "--activation-checkpointing needs repeated blocks to wrap, and this workload has "
            "none: give the model an nn.ModuleList attribute `blocks`, or set "
            "Workload(repeated_blocks=lambda model: [...]).")
    wanted = {id(block) for block in blocks}
    parents = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if id(child) in wanted]
    for parent, name, child in parents:
        setattr(parent, name, checkpoint_wrapper(child, preserve_rng_state=True))
    return len(parents)


class Strategy(ABC):
    """How one parallel layout holds the model and runs micro-batches through it.

    Each layout says how it holds the model (:meth:`setup`) and where it waits for
    collectives (:meth:`untimed_waits`); the rest is what a whole model on each rank does,
    and a layout overrides only what it does differently. ``compile`` says whether the step
    will be compiled, which hides some waits from timing.
    """

    supports_loss_scaling = True  # fp16's GradScaler

    def __init__(self, dims: ParallelDims, device: torch.device, policy: PrecisionPolicy,
                 timer: StepTimer, compile: bool = False) -> None:
        if policy.loss_scaling and not self.supports_loss_scaling:
            raise UserError(f"--strategy {dims.strategy} supports fp32, tf32 and bf16; "
                            "use --precision bf16.")
        self.dims, self.device, self.policy, self.timer = dims, device, policy, timer
        self.compile_requested = compile
        self.mesh = dims.build_mesh(device.type)
        if self.mesh is not None:
            self.dp_rank = self.mesh["dp"].get_local_rank()
        else:
            self.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        self.model: nn.Module = nn.Module()  # set by setup()
        self.saves_frozen = True  # set by setup() from ModelParts
        self.forward_model: nn.Module = self.model
        self.waits = self.timed_waits()
        self._collective_waits: contextlib.AbstractContextManager[Any] = (
            timed_waits.TimedWaits(self.waits, timer.exposed_comm) if self.waits
            else contextlib.nullcontext())

    # --- set-up ---------------------------------------------------------------------------

    @abstractmethod
    def setup(self, model: nn.Module, parts: ModelParts, example: Any, batch_size: int
              ) -> None:
        """Wrap ``model`` for this layout: PP split, TP, activation checkpointing, then DDP or
        FSDP, in PyTorch's order, and set :attr:`model` (what holds the parameters) and
        :attr:`forward_model` (what the step calls). ``example`` is a batch's inputs, for
        tracing."""

    def describe(self) -> str:
        """The layout for the run's banner: empty for one process."""
        dims = self.dims
        if dims.world == 1:
            return ""
        return (f" x {dims.world} ranks ({dims.strategy_label()}, dp {dims.dp} x tp "
                f"{dims.tp}{self.describe_pipeline()})")

    def describe_pipeline(self) -> str:
        return ""

    # --- the step -------------------------------------------------------------------------

    @abstractmethod
    def forward_backward(self, inputs: Any, target: torch.Tensor, loss_fn: Loss,
                         micro: int, accum: int, scaler: GradScaler | None) -> torch.Tensor:
        """Forward and backward of micro-batch ``micro`` of ``accum``; the detached loss.
        The loss is divided by ``accum`` before backward and scaled by ``scaler`` (fp16)."""

    @abstractmethod
    def finish_backward(self) -> None:
        """Whatever the gradients still need before the optimizer may read them."""

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the data-parallel replicas (a collective), so that every
        rank logs the same figure and agrees on skipping a non-finite step."""
        if self.dims.world == 1:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss)
        return loss / self.loss_holders()

    def loss_holders(self) -> int:
        """How many ranks hold a loss (every one, unless the pipeline says otherwise)."""
        return self.dims.world

    def clip_grad_norm(self, max_norm: float) -> None:
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    # --- evaluation -----------------------------------------------------------------------

    @abstractmethod
    def eval_outputs(self, inputs: Any, target: torch.Tensor) -> Any:
        """The model's outputs for one batch; None on ranks that hold none."""

    def share_eval(self, result: dict[str, float]) -> dict[str, float]:
        """Every rank's copy of the evaluation's result."""
        return result

    # --- state ----------------------------------------------------------------------------

    def full_state(self, optimizer: torch.optim.Optimizer) -> State:
        """Unsharded weights and optimizer state keyed by parameter name (one process)."""
        from gpuflow.parallel import state  # torch's state-dict helpers: ~50 MB to import

        return state.full_state(self.model, optimizer, self.saves_frozen)

    def local_state(self, optimizer: torch.optim.Optimizer) -> State:
        """This rank's share of the weights and optimizer state, keyed by parameter name."""
        from gpuflow.parallel import state

        return state.local_state(self.model, optimizer, self.saves_frozen)

    def load_state(self, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                   optimizer_state: dict[str, Any], full: bool) -> None:
        """Load a complete state (``full``, as one process saves it) or this rank's share."""
        from gpuflow.parallel import state

        state.load(self.model, weights, optimizer, optimizer_state, full, self.saves_frozen)

    def load_sharded(self, optimizer: torch.optim.Optimizer, path: Path,
                     param_groups: list[dict[str, Any]]) -> None:
        """Read this rank's share of a torch.distributed.checkpoint folder written by any
        world size or strategy (a collective when distributed). ``param_groups`` carries
        the optimizer's hyperparameters, which live in the trainer state."""
        from gpuflow.parallel import state

        weights, optimizer_state = state.read_sharded(self.shard_request(optimizer, path),
                                                      path, param_groups)
        self.load_state(weights, optimizer, optimizer_state, full=False)

    def shard_request(self, optimizer: torch.optim.Optimizer, path: Path) -> State:
        """What this rank reads of a sharded checkpoint: its own local view."""
        return self.local_state(optimizer)

    # --- telemetry ------------------------------------------------------------------------

    def timed_waits(self) -> list[timed_waits.Wait] | None:
        """Functions where this layout waits for collectives not timed otherwise; None where
        one cannot be timed (it is not there, or compiled code waits inside its graph)."""
        waits = self.untimed_waits()
        if waits is None or (waits and self.device.type not in ("cpu", "cuda")):
            return None
        return waits if timed_waits.timeable(waits) else None

    @abstractmethod
    def untimed_waits(self) -> list[timed_waits.Wait] | None:
        """Where this layout waits for collectives that no other timer sees: [] where there
        are none, None where they cannot be timed."""

    @property
    def comm_measured(self) -> bool:
        """Whether exposed communication is measured: wherever its waits can be timed."""
        return self.waits is not None

    def host_collective_timer(self) -> Callable[[], contextlib.AbstractContextManager[None]
                                                ] | None:
        """On the CPU FSDP's collectives hold the host, so timing them there measures them;
        beside untimed collectives they are not timed either, so that the step's breakdown
        still adds up."""
        if self.device.type != "cpu":
            return None
        return self.timer.exposed_comm if self.comm_measured else contextlib.nullcontext


