"""The training levers queued for a GPU (docs/training.md, "Training levers"): each is
switchable and, on the CPU, trains the same as today's step within the bound the docs state."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import train_refusal
from runs import configs, losses, summary

from gpuflow import Trainer, train
from gpuflow.config import TrainConfig
from gpuflow.errors import UserError
from gpuflow.parallel.dims import ParallelDims
from gpuflow.train.chunked_loss import HeadInput, chunked_cross_entropy, switch
from gpuflow.train.optim import build_optimizer
from gpuflow.train.trainer import seed_everything
from gpuflow.workload import IGNORE_INDEX
from gpuflow.workloads import textlm

# docs/training.md states it: fused AdamW against foreach, per logged loss, relative
# (12 steps of this model differed by at most 1.7e-7 on 2 cores).
OPTIMIZER_IMPL_RTOL = 1e-5

config = configs(max_steps=12, batch_size=8, log_every=1, eval_every=0, warmup_steps=3,
                 lr=1e-2, save_checkpoints=False)


def _losses(run_dir: Path, **overrides: object) -> list[float]:
    seed_everything(0)
    workload = textlm.build(data="synthetic", model_size="layers=2,dim=64,heads=4,seq=32")
    train(workload, config(run_dir, **overrides))
    tokens = workload.get_example_batch()[0]
    assert isinstance(workload.model(tokens), torch.Tensor)  # the head is its own again
    return losses(run_dir)


def test_fused_adamw_trains_as_foreach_does(tmp_path: Path) -> None:
    fused = _losses(tmp_path / "fused", optimizer_impl="fused")
    foreach = _losses(tmp_path / "foreach", optimizer_impl="foreach")
    assert len(fused) == 12
    assert fused == pytest.approx(foreach, rel=OPTIMIZER_IMPL_RTOL)


def test_optimizer_impl_picks_the_kernels() -> None:
    model = textlm.build(data="synthetic", model_size="layers=1,dim=32,heads=2,seq=16").model
    cpu = torch.device("cpu")
    fused = build_optimizer(model, TrainConfig(), cpu)
    foreach = build_optimizer(model, TrainConfig(optimizer_impl="foreach"), cpu)
    assert fused.defaults["fused"] and not fused.defaults["foreach"]
    assert foreach.defaults["foreach"] and not foreach.defaults["fused"]


def test_a_resumed_run_takes_the_kernels_it_asks_for(tmp_path: Path) -> None:
    """A checkpoint's param groups carry the kernels that saved them; the flag wins."""
    workload = textlm.build(data="synthetic", model_size="layers=1,dim=32,heads=2,seq=16")
    train(workload, config(tmp_path, max_steps=2, save_checkpoints=True))
    resumed = Trainer(textlm.build(data="synthetic",
                                   model_size="layers=1,dim=32,heads=2,seq=16"),
                      config(tmp_path, max_steps=4, resume=True, optimizer_impl="foreach"))
    try:
        assert resumed.position.step == 2
        assert all(group["foreach"] and not group["fused"]
                   for group in resumed.optimizer.param_groups)
        resumed.run_steps(2)
    finally:
        resumed.close()


# docs/training.md states it: the chunked loss and its gradients against the unchunked path.
CHUNKED_RTOL, CHUNKED_ATOL = 1e-5, 1e-6


def test_chunked_cross_entropy_equals_the_whole_one() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 10, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50)
    target = torch.randint(0, 50, (3, 10))
    target[0, :4] = IGNORE_INDEX
    whole = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), target.flatten(),
                                              ignore_index=IGNORE_INDEX)
    expected = torch.autograd.grad(whole, (hidden, head.weight, head.bias))
    chunked = chunked_cross_entropy(HeadInput(hidden, head.weight, head.bias), target, 4)
    got = torch.autograd.grad(chunked * 1.0, (hidden, head.weight, head.bias))
    torch.testing.assert_close(chunked, whole, rtol=CHUNKED_RTOL, atol=CHUNKED_ATOL)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=CHUNKED_RTOL, atol=CHUNKED_ATOL)


def test_a_run_with_loss_chunks_trains_as_the_whole_loss_does(tmp_path: Path) -> None:
    chunked = _losses(tmp_path / "chunked", loss_chunks=3)
    whole = _losses(tmp_path / "whole")
    assert chunked == pytest.approx(whole, rel=CHUNKED_RTOL)
    ends = [summary(tmp_path / name) for name in ("chunked", "whole")]
    assert ends[0]["final_metrics"] == pytest.approx(ends[1]["final_metrics"], rel=CHUNKED_RTOL)
    assert ends[0]["flops_per_step"] == ends[1]["flops_per_step"]  # the same products


def test_loss_chunks_refuses_what_it_cannot_chunk() -> None:
    chunked = TrainConfig(loss_chunks=4)
    lm = textlm.build(data="synthetic", model_size="layers=1,dim=32,heads=2,seq=16")
    with pytest.raises(UserError, match="--strategy fsdp"):
        switch(lm, chunked, ParallelDims(strategy="fsdp"))
    with pytest.raises(UserError, match="no LM head"):
        switch(replace(lm, loss_fn=lambda outputs, target: outputs.sum()), chunked,
               ParallelDims())
    assert switch(lm, TrainConfig(), ParallelDims()) is lm
    assert isinstance(lm.model(lm.get_example_batch()[0]), torch.Tensor)


# docs/training.md states it: whole-model compile against the eager step, per logged loss,
# relative (3 steps of this model: equal to eager's, and 1.7e-7 from per-block compile's).
COMPILE_SCOPE_RTOL = 1e-5


def test_whole_model_compile_trains_as_the_eager_step(tmp_path: Path) -> None:
    """One graph for the whole model, here under activation checkpointing, which it
    composes with. Held to the eager curve, which per-block compile follows too
    (test_trainer_options): one cold compile here rather than two (~30 s each on 2 cores)."""
    eager = _losses(tmp_path / "eager", max_steps=3)
    whole = _losses(tmp_path / "whole", compile=True, compile_scope="model",
                    activation_checkpointing=True, max_steps=3)
    assert summary(tmp_path / "whole")["compile_scope"] == "model"
    assert len(whole) == 3
    assert whole == pytest.approx(eager, rel=COMPILE_SCOPE_RTOL)


@pytest.mark.parametrize(("flags", "message"), [
    ((), "--compile-scope model says what --compile compiles"),
    (("--compile", "--strategy", "fsdp"), "--compile-scope model with --strategy fsdp"),
])
def test_whole_model_compile_is_refused_clearly(flags: tuple[str, ...], message: str,
                                                tmp_path: Path) -> None:
    assert message in train_refusal(tmp_path, "--compile-scope", "model", *flags)
