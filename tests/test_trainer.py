"""The trainer's own parts: the optimizer it builds (fused where it can, its groups' settings
restored by name across strategies), how long a run without a length trains, and the end of
a run: its checkpoint saved before the final evaluation, a stop signal on the last step
included."""

from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import Path

import pytest
import torch
from runs import configs, events
from user_workloads import mlp

from gpuflow import TrainConfig
from gpuflow.errors import Preempted
from gpuflow.train.trainer import Trainer, train
from gpuflow.workloads import speech


def test_a_run_without_a_length_trains_the_workloads_default_epochs(tmp_path: Path) -> None:
    def total_steps(**length: float) -> int:
        config = TrainConfig(workload="speech", data="synthetic", batch_size=64,
                             run_dir=str(tmp_path / "run"), save_checkpoints=False,
                             progress=False, **length)
        trainer = Trainer(speech.build(data="synthetic", model_size="tiny"), config)
        try:
            return trainer.total_steps
        finally:
            trainer.close()

    per_epoch = 2250 // 64
    assert total_steps() == math.ceil(speech.DEFAULT_EPOCHS * per_epoch) == 40 * per_epoch
    assert total_steps(epochs=2) == 2 * per_epoch
    # The --epochs help states both defaults; it must say what the trainer does.
    from gpuflow.options import flags
    from gpuflow.train.trainer import DEFAULT_EPOCHS

    epochs = next(flag for flag in flags(TrainConfig) if flag.name == "epochs")
    assert f"({DEFAULT_EPOCHS:g}; speech {speech.DEFAULT_EPOCHS:g})" in str(epochs.option.unset)


def test_optimizer_is_fused_on_cpu_where_dtensor_allows() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor

    from gpuflow.train.optim import build_optimizer

    model = mlp().model
    assert build_optimizer(model, TrainConfig(), torch.device("cpu")).defaults["fused"]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # As tensor parallelism leaves it: one layer's weight a DTensor, the rest plain.
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(),
                                                             DeviceMesh("cpu", [0])))
        mixed = build_optimizer(model, TrainConfig(), torch.device("cpu"))
        assert mixed.defaults["fused"]
        # Each group holds one kind (a fused call cannot take both), decay only on matrices.
        kinds = [{isinstance(p, DTensor) for p in group["params"]}
                 for group in mixed.param_groups]
        assert all(len(kind) == 1 for kind in kinds) and {True} in kinds
        assert all(p.dim() >= 2 for group in mixed.param_groups if group["weight_decay"]
                   for p in group["params"])
        assert sum(len(g["params"]) for g in mixed.param_groups) == len(list(model.parameters()))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        before = linear.weight.full_tensor().clone()
        mixed.step()  # one fused call per group, the DTensor one included
        assert not torch.equal(linear.weight.full_tensor(), before)
        # DTensor has no sharding rule for fused SGD at all.
        sgd = build_optimizer(model, TrainConfig(optimizer="sgd"), torch.device("cpu"))
        assert not sgd.defaults["fused"]
    finally:
        dist.destroy_process_group()


def test_saved_optimizer_settings_follow_group_names_across_strategies() -> None:
    from gpuflow.checkpoint import with_saved_settings

    # Saved by one process (two groups), resumed under TP (each split into two kinds).
    saved = [{"name": "decay", "weight_decay": 0.1, "lr": 0.5, "params": ["a", "b"]},
             {"name": "no_decay", "weight_decay": 0.0, "lr": 0.5, "params": ["c"]}]
    current = [{"name": "decay", "params": ["a"]}, {"name": "decay", "params": ["b"]},
               {"name": "no_decay", "params": ["c"]}]
    restored = with_saved_settings(saved, current)
    assert [g["weight_decay"] for g in restored] == [0.1, 0.1, 0.0]
    assert [g["params"] for g in restored] == [["a"], ["b"], ["c"]]
    # Checkpoints from before groups had names pair up by position.
    unnamed = [{"weight_decay": 0.1, "lr": 0.5}, {"weight_decay": 0.0, "lr": 0.5}]
    both = [{"name": "decay", "params": ["a", "b"]}, {"name": "no_decay", "params": ["c"]}]
    assert [g["weight_decay"] for g in with_saved_settings(unnamed, both)] == [0.1, 0.0]


ending = configs(max_steps=3, eval_every=0, log_every=1)


def test_the_final_checkpoint_is_saved_before_the_final_evaluation(tmp_path: Path) -> None:
    """A stop signal during the evaluation, which can outlast a grace period, loses no step."""
    trainer = Trainer(mlp(), ending(tmp_path))
    checkpoint_steps = []
    evaluate = trainer.evaluate

    def noting_the_checkpoint() -> dict[str, float]:
        checkpoint_steps.append(trainer.state.last.step if trainer.state.last else None)
        return evaluate()

    trainer.evaluate = noting_the_checkpoint  # type: ignore[method-assign]
    assert "val_loss" in trainer.fit().final_metrics
    assert checkpoint_steps == [3]


def test_a_stop_signal_on_the_last_step_saves_and_stops_before_evaluating(
        tmp_path: Path) -> None:
    config = ending(tmp_path)
    trainer = Trainer(mlp(), config)
    trainer.run_steps(2)
    trainer.preemption.received = signal.SIGTERM  # as the handler notes one in the last step
    with pytest.raises(Preempted, match="after step 3"):
        trainer.fit()
    assert trainer.state.last is not None and trainer.state.last.step == 3
    assert [e["step"] for e in events(tmp_path, "preempted")] == [3]
    assert not events(tmp_path, "eval")
    # The requeued job has nothing left to train: it evaluates and writes the summary.
    result = train(mlp(), dataclasses.replace(config, resume=True))
    assert result.steps == 3 and "val_loss" in result.final_metrics
    assert [e["step"] for e in events(tmp_path, "eval")] == [3]
