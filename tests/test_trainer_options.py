"""The trainer's options on a small user model: precisions, activation checkpointing, compile,
checkpoints, loader workers, gradient accumulation and TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runs import configs, losses
from user_workloads import mlp

from gpuflow import TrainConfig, Trainer, train
from gpuflow.train.trainer import seed_everything

config = configs(max_steps=8, batch_size=32, log_every=2, eval_every=4, warmup_steps=2)


def fresh_mlp():
    seed_everything(0)
    return mlp()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_trains_and_learns(precision: str, tmp_path: Path) -> None:
    result = train(fresh_mlp(), config(tmp_path, precision=precision, max_steps=30, lr=1e-2))
    curve = losses(tmp_path)
    assert all(torch.isfinite(torch.tensor(curve)))
    assert curve[-1] < curve[0]
    assert result.final_metrics["val_accuracy"] > 0.5
    assert result.summary["precision"] == precision
    assert all(p.dtype == torch.float32 for p in result.model.parameters())


def test_fp16_uses_a_loss_scaler_and_bf16_does_not(tmp_path: Path) -> None:
    fp16 = Trainer(fresh_mlp(), config(tmp_path / "a", precision="fp16"))
    bf16 = Trainer(fresh_mlp(), config(tmp_path / "b", precision="bf16"))
    assert fp16.scaler is not None and fp16.scaler.is_enabled()
    assert bf16.scaler is None
    assert fp16.policy.peak_key == "fp16" and bf16.policy.peak_key == "bf16"
    fp16.close()
    bf16.close()


def test_tf32_on_cpu_says_it_runs_fp32(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="TF32 is a CUDA tensor-core mode"):
        trainer = Trainer(fresh_mlp(), config(tmp_path, precision="tf32"))
    assert trainer.policy.peak_key == "fp32"
    trainer.close()


def test_activation_checkpointing_wraps_blocks_and_keeps_the_loss_curve(tmp_path: Path) -> None:
    plain = train(fresh_mlp(), config(tmp_path / "plain"))
    checkpointed = train(fresh_mlp(), config(tmp_path / "ac", activation_checkpointing=True))
    wrapped = [m for m in checkpointed.model.modules()
               if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == 2
    assert losses(tmp_path / "plain") == pytest.approx(losses(tmp_path / "ac"), rel=1e-6)
    assert plain.model.state_dict().keys() == checkpointed.model.state_dict().keys()


def test_activation_checkpointing_without_blocks_is_a_clear_error(tmp_path: Path) -> None:
    workload = fresh_mlp()
    workload.repeated_blocks = lambda model: []
    with pytest.raises(Exception, match="needs repeated blocks"):
        Trainer(workload, config(tmp_path, activation_checkpointing=True))


def test_compile_compiles_each_block_and_keeps_the_eager_loss_curve(tmp_path: Path) -> None:
    eager = train(fresh_mlp(), config(tmp_path / "eager", max_steps=4, eval_every=0))
    compiled = train(fresh_mlp(), config(tmp_path / "compiled", compile=True, max_steps=4,
                                         eval_every=0))
    assert compiled.summary["compiled"] is True
    assert compiled.summary["compile_scope"] == "2 blocks"
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    # compiled in place: checkpoints keep the eager parameter names
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()


def test_no_checkpoints_writes_none_and_contradicting_flags_are_refused(tmp_path: Path) -> None:
    result = train(fresh_mlp(), config(tmp_path, save_checkpoints=False, max_steps=2))
    assert result.summary["checkpoint"] is None
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(Exception, match="--checkpoint-every and --no-checkpoints"):
        TrainConfig(save_checkpoints=False, checkpoint_every=5).validate()
    with pytest.raises(Exception, match="--max-restarts resumes .* --no-checkpoints"):
        TrainConfig(save_checkpoints=False, max_restarts=2).validate()


def test_compile_failure_falls_back_to_eager_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_compile(model, *args, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("backend exploded")
        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.warns(UserWarning, match="torch.compile failed .*backend exploded.*eager"):
        result = train(fresh_mlp(), config(tmp_path, compile=True, max_steps=2, eval_every=0))
    assert result.summary["compiled"] is False and result.steps == 2


def test_loader_workers_see_the_same_batches_as_the_main_process(tmp_path: Path) -> None:
    inline = train(fresh_mlp(), config(tmp_path / "inline", num_workers=0))
    workers = train(fresh_mlp(), config(tmp_path / "workers", num_workers=2))
    for name, tensor in inline.model.state_dict().items():
        assert torch.equal(tensor, workers.model.state_dict()[name]), name


def test_grad_accum_matches_a_larger_batch(tmp_path: Path) -> None:
    """Two micro-batches of 16 take the same step as one batch of 32 (up to rounding)."""
    big = train(fresh_mlp(), config(tmp_path / "big", batch_size=32, max_steps=4, eval_every=0))
    accum = train(fresh_mlp(), config(tmp_path / "accum", batch_size=16, grad_accum=2,
                                      max_steps=4, eval_every=0))
    for name, tensor in big.model.state_dict().items():
        torch.testing.assert_close(tensor, accum.model.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_tensorboard_receives_the_same_scalars(tmp_path: Path) -> None:
    # The tensorboard extra comes with make install: a missing one fails here, not skips.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(fresh_mlp(), config(tmp_path, tensorboard=True))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "train/mfu", "eval/val_accuracy"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
