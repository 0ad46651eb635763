"""Fake-tensor traces that fall back to real ones say so, once, with what it costs."""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpuflow import Trainer
from gpuflow.config import TrainConfig
from gpuflow.planner.workload_profile import profile_workload
from gpuflow.telemetry.flops import count_training_flops
from gpuflow.workload import Workload, resolve_workload

FLOPS_PER_SAMPLE = 2 * 4 * 2 * 2  # Linear(4, 2): forward and weight gradient


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if x.sum().item() > 0 else 1.0  # a value fake tensors do not have
        return self.layer(x) * scale


def data_dependent() -> Workload:
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    return Workload(name="data-dependent", model=DataDependent(), train_dataset=data)


def test_the_planner_warns_once_when_it_traces_a_model_for_real() -> None:
    with pytest.warns(UserWarning) as caught:
        profile = profile_workload(data_dependent(), "bf16")  # traced twice: bf16 for FSDP
    said = [str(w.message) for w in caught if "fake tensors" in str(w.message)]
    assert len(said) == 1, said
    assert re.search(r"cannot trace 'data-dependent'.*on real CPU tensors instead.*"
                     r"allocates the model's weights", said[0]), said[0]
    assert profile.source == "traced (real CPU tensors)"
    assert profile.with_low_precision_params is not None
    assert profile.with_low_precision_params.source == "traced (real CPU tensors)"
    assert profile.flops_per_sample == FLOPS_PER_SAMPLE


def test_a_model_fake_tensors_can_run_is_profiled_without_a_word() -> None:
    workload = resolve_workload("digits", {"data": "synthetic"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = profile_workload(workload, "bf16")
    assert profile.source == "traced (fake tensors)"


def test_the_flop_count_warns_when_it_runs_a_real_step(tmp_path: Path) -> None:
    workload = data_dependent()
    inputs, target = workload.get_example_batch()
    with pytest.raises(Exception):  # noqa: B017 (whatever fake tensors raise here)
        count_training_flops(workload.model, inputs, target, workload.loss_fn,
                             contextlib.nullcontext())
    with pytest.warns(UserWarning, match=r"Workload 'data-dependent': its FLOPs cannot be "
                                         r"counted on fake tensors.*one real forward and "
                                         r"backward.*time and memory"):
        trainer = Trainer(workload, TrainConfig(batch_size=8, max_steps=1, progress=False,
                                                run_dir=str(tmp_path)))
    assert trainer.flops_per_step == 8 * FLOPS_PER_SAMPLE
    trainer.close()
