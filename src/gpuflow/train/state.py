"""Everything a run continues from, bit for bit: saved, and restored on --resume.

The strategy saves and loads the weights and optimizer state in its own layout (one full
file from one process, torch.distributed.checkpoint shards otherwise); this module adds
the rest: where the run stands, the schedule, the loss scale, the RNG streams and every
rank's place in a streaming data set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gpuflow import checkpoint as ckpt
from gpuflow.data.iterable import StreamBatches, StreamPosition
from gpuflow.errors import NonFiniteLossError, UserError
from gpuflow.parallel.strategy import Strategy
from gpuflow.train.optim import keep_kernels, restore_schedule


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch: a run's first state, before any checkpoint holds one."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Position:
    """Where a run stands."""

    step: int = 0
    batches_consumed: int = 0
    skipped_steps: int = 0
    samples_seen: int = 0


class RunState:
    """The run's position and the objects whose state a checkpoint holds."""

    def __init__(self, directory: Path, strategy: Strategy, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LambdaLR,
                 scaler: torch.amp.GradScaler | None, keep: int) -> None:
        self.directory, self.strategy, self.keep = directory, strategy, keep
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.position = Position()
        self.last: ckpt.Checkpoint | None = None
        self.stream_start: StreamPosition | None = None  # a stream's saved position
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def save(self, stream: StreamBatches | None, streaming: bool) -> ckpt.Checkpoint:
        """One process writes the full state; in a distributed job every rank writes its
        own shards in parallel (a collective), with nothing gathered. ``stream`` is the
        train stream's batches when ``streaming``."""
        step = self.position.step
        positions = self._stream_positions(stream) if streaming else None
        if self.world == 1:
            weights, optimizer_state = self.strategy.full_state(self.optimizer)
            self.last = ckpt.save_checkpoint(self.directory, step, weights,
                                             self._trainer_state(optimizer_state, positions),
                                             self.keep)
            return self.last
        weights, optimizer_state = self.strategy.local_state(self.optimizer)
        # The shards hold the optimizer's tensors; its hyperparameters go with the trainer.
        trainer_state = self._trainer_state({"param_groups": optimizer_state["param_groups"]},
                                            positions)
        self.last = ckpt.save_sharded_checkpoint(
            self.directory, step, {"model": weights, "optimizer": optimizer_state["state"]},
            trainer_state, self.keep, is_main=self.rank == 0, gather=self._gather)
        return self.last

    def _gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def _trainer_state(self, optimizer_state: dict[str, Any],
                       stream_positions: list[dict[str, Any]] | None) -> dict[str, Any]:
        position = self.position
        return {
            "step": position.step,
            "batches_consumed": position.batches_consumed,
            "skipped_steps": position.skipped_steps,
            "samples_seen": position.samples_seen,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": ckpt.capture_rng_state(),
            "data_stream": stream_positions,
        }

    def _stream_positions(self, stream: StreamBatches | None) -> list[dict[str, Any]] | None:
        """Every rank's position in its train stream after the batches trained on, by
        global rank (a collective when distributed); None where a stream cannot say."""
        mine = (stream.position_after(self.position.batches_consumed) if stream is not None
                else self.stream_start)
        positions = [mine.as_dict() if mine is not None else None]
        if self.world > 1:
            positions = self._gather(mine.as_dict() if mine is not None else None)
        return None if any(p is None for p in positions) else positions

    def diverged(self, streak: int) -> NonFiniteLossError:
        """What stops a run after ``streak`` non-finite losses up to this step: where it may
        resume from, and what to change."""
        step = self.position.step
        where = (f"the last good checkpoint is {self.last.path}" if self.last
                 else "no checkpoint was saved before it")
        return NonFiniteLossError(
            f"The loss was NaN/inf for {streak} consecutive steps ({step - streak + 1}-{step}); "
            f"training stopped and {where}. Try a lower --lr, --clip-grad 1.0, a longer "
            "--warmup-steps, or --precision bf16 instead of fp16.")

    def resume(self) -> None:
        """Restore the newest checkpoint whose checksums hold."""
        # Rank 0 verifies the checksums once and tells the others which checkpoint to read.
        choice = [ckpt.latest_verified(self.directory) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        checkpoint = choice[0]
        if checkpoint is None:
            raise UserError(f"--resume: no valid checkpoint in {self.directory}. Check the "
                            "run dir, or start without --resume.")
        state = self._load_weights(checkpoint)
        keep_kernels(self.optimizer)
        restore_schedule(self.scheduler, state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        ckpt.restore_rng_state(state["rng"])
        self.position = Position(state["step"], state["batches_consumed"],
                                 state["skipped_steps"], state["samples_seen"])
        positions = state.get("data_stream")
        if positions is not None and len(positions) == self.world:
            self.stream_start = StreamPosition(**positions[self.rank])
        self.last = checkpoint

    def _load_weights(self, checkpoint: ckpt.Checkpoint) -> dict[str, Any]:
        """Weights and optimizer state into the strategy; the trainer state back."""
        state = ckpt.load_trainer_state(checkpoint)
        try:
            if ckpt.is_sharded(checkpoint):
                self.strategy.load_sharded(self.optimizer, checkpoint.path / ckpt.STATE_DIR,
                                           state["optimizer"]["param_groups"])
            else:
                weights, state = ckpt.load_checkpoint(checkpoint)
                self.strategy.load_state(weights, self.optimizer, state["optimizer"],
                                         full=True)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise UserError(
                f"--resume: the state in {checkpoint.path} does not fit this workload's model "
                f"({str(exc).splitlines()[0]}). Resume with the workload that wrote it."
            ) from None
        return state
