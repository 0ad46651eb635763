"""The weight average: its arithmetic, where runs use it, and exact resume with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from runs import configs, losses
from safetensors.torch import load_file
from user_workloads import mlp

from gpuflow import Trainer, train
from gpuflow import checkpoint as ckpt
from gpuflow.train.averaging import WeightAverage
from gpuflow.train.trainer import seed_everything
from gpuflow.workloads import speech


def test_the_average_follows_the_steps_and_swaps_in_and_out() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(optimizer, decay=0.75)
    assert not average.started
    with average.weights_swapped_in():  # nothing to swap before the first step
        pass
    expected = None
    for _ in range(4):
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update()
        now = [p.detach().clone() for p in model.parameters()]
        expected = now if expected is None else [0.75 * e + 0.25 * w
                                                 for e, w in zip(expected, now, strict=True)]
    assert average.started
    training = [p.detach().clone() for p in model.parameters()]
    storage = [p.data_ptr() for p in model.parameters()]
    with average.weights_swapped_in():
        for param, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-6)
    for param, before, pointer in zip(model.parameters(), training, storage, strict=True):
        assert torch.equal(param.detach(), before) and param.data_ptr() == pointer
    # The average is optimizer state, so a state dict carries it.
    saved = optimizer.state_dict()["state"][0]
    assert torch.equal(saved["ema"], optimizer.state[model.weight]["ema"])
    average.load_into_weights()
    assert torch.equal(model.weight.detach(), optimizer.state[model.weight]["ema"])


config = configs(max_steps=12, batch_size=32, log_every=1, eval_every=4, warmup_steps=3,
                 ema_decay=0.8)


def test_a_run_trains_the_same_weights_and_ends_with_their_average(tmp_path: Path) -> None:
    seed_everything(0)
    plain = Trainer(mlp(), config(tmp_path / "plain", ema_decay=None))
    expected: list[torch.Tensor] | None = None
    for _ in range(12):
        plain.run_steps(1)
        now = [p.detach().clone() for p in plain.model.parameters()]
        expected = now if expected is None else [0.8 * e + 0.2 * w
                                                 for e, w in zip(expected, now, strict=True)]
    plain.close()
    seed_everything(0)
    result = train(mlp(), config(tmp_path / "averaged"))
    for param, want in zip(result.model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-6)
    saved = load_file(ckpt.list_checkpoints(tmp_path / "averaged" / "checkpoints")[0].path
                      / ckpt.MODEL_FILE)
    for name, param in result.model.named_parameters():
        assert torch.equal(saved[name], param.detach()), name
    # Training itself is untouched: the same losses, step for step.
    assert losses(tmp_path / "averaged") == losses(tmp_path / "plain")
    summary = json.loads((tmp_path / "averaged" / "summary.json").read_text())
    assert summary["ema_decay"] == 0.8


def test_resume_continues_the_same_average_bit_for_bit(tmp_path: Path) -> None:
    seed_everything(0)
    whole = train(mlp(), config(tmp_path / "whole"))
    seed_everything(0)
    first = Trainer(mlp(), config(tmp_path / "split"))
    first.run_steps(5)
    first.save_checkpoint()
    first.close()
    resumed = train(mlp(), config(tmp_path / "split", resume=True))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_speech_averages_unless_the_flag_turns_it_off(tmp_path: Path) -> None:
    def averaged(**overrides) -> WeightAverage | None:
        trainer = Trainer(speech.build(data="synthetic", model_size="tiny"),
                          config(tmp_path, max_steps=1, **overrides))
        trainer.close()
        return trainer.average

    default = averaged(ema_decay=None)
    assert default is not None and default.decay == 0.99
    assert averaged(ema_decay=0.0) is None


@pytest.mark.parametrize("value", ["1", "-0.5", "1.5"])
def test_a_decay_outside_zero_to_one_is_refused(value: str, tmp_path: Path) -> None:
    result = run_cli("train", "--workload", "user_workloads:mlp", "--ema-decay", value,
                     "--max-steps", "1", "--run-dir", str(tmp_path), "--no-progress")
    assert result.returncode == 2
    assert "--ema-decay must be in [0, 1)" in result.stderr
    assert not (tmp_path / "checkpoints").exists()
