"""The engine's options on a small user model: precisions, checkpointing, compile, workers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from runs import losses
from user_workloads import mlp

from gpuflow import TrainConfig, Trainer, train
from gpuflow.train.trainer import seed_everything


def config(run_dir: Path, **overrides) -> TrainConfig:
    values = dict(max_steps=8, batch_size=32, log_every=2, eval_every=4, progress=False,
                  run_dir=str(run_dir), warmup_steps=2)
    values.update(overrides)
    return TrainConfig(**values)


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


def test_tensorboard_receives_the_same_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is installed by make test")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(fresh_mlp(), config(tmp_path, tensorboard=True))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "train/mfu", "eval/val_accuracy"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]


def test_grad_accum_matches_a_larger_batch(tmp_path: Path) -> None:
    """Two micro-batches of 16 take the same step as one batch of 32 (up to rounding)."""
    big = train(fresh_mlp(), config(tmp_path / "big", batch_size=32, max_steps=4, eval_every=0))
    accum = train(fresh_mlp(), config(tmp_path / "accum", batch_size=16, grad_accum=2,
                                      max_steps=4, eval_every=0))
    for name, tensor in big.model.state_dict().items():
        torch.testing.assert_close(tensor, accum.model.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_blocking_collectives_count_as_comm_only_inside_a_timed_step() -> None:
    from gpuflow.telemetry.steps import StepTimer

    timer = StepTimer(torch.device("cpu"))
    with timer.exposed_comm():  # e.g. an evaluation forward's all-gather: not a step's
        time.sleep(0.3)
    timer.window.steps = 1
    timer.compute.begin()
    with timer.exposed_comm():
        time.sleep(0.3)
    time.sleep(0.02)
    timer.compute.end()
    window = timer.close_window()
    # Bounds a slow machine cannot break: each would fail by a whole 0.3 s sleep.
    assert 0.3 <= window["comm_s"] < 0.6  # the step's collective, not the other one
    assert 0.02 <= window["compute_s"] < 0.3  # forward+backward without the collective
    assert window["compute_s"] + window["comm_s"] <= window["step_time_s"]


def test_fsdp_waits_are_timed_each_once_during_a_step_then_restored() -> None:
    """On CUDA FSDP's exposed communication is the compute stream's time in its waiting
    methods. The same methods run on the CPU, where the patching and the rule that a wait
    inside another counts once are checked."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from gpuflow.parallel.sharded import apply_fsdp
    from gpuflow.telemetry.steps import StepTimer
    from gpuflow.telemetry.waits import TimedWaits, fsdp_waits, timeable

    assert timeable(fsdp_waits())

    untimed = FSDPParamGroup.post_backward
    timer = StepTimer(torch.device("cpu"))
    nested: list[bool] = []

    @contextlib.contextmanager
    def timed():
        nested.append(timer.comm.running)
        with timer.exposed_comm():
            time.sleep(0.2 if nested[-1] else 0.01)
            yield

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 1))
        apply_fsdp(model, [model[0], model[2]], None, reshard_after_forward=True)
        waits = TimedWaits(fsdp_waits(), timed)
        timer.window.steps = 1
        timer.compute.begin()
        with waits:
            assert FSDPParamGroup.post_backward is not untimed
            model(torch.randn(4, 8)).sum().backward()
        timer.compute.end()
    finally:
        dist.destroy_process_group()
    assert FSDPParamGroup.post_backward is untimed
    # Three units (two blocks and the root, which owns the last layer): a wait before each
    # runs forward and again before its backward, the second block's post-backward, and the
    # end-of-backward callback, which runs the post-backward of the root and of the first
    # block itself (their inputs need no gradient, so autograd does not): those two nest.
    assert nested.count(False) >= 3 + 3 + 1 + 1
    assert nested.count(True) == 2
    window = timer.close_window()
    # Outermost waits slept 10 ms each, nested ones 200 ms inside them: counted twice, these
    # would add another 0.4 s, more than this tiny model's own work in the waits.
    least = 0.01 * nested.count(False) + 0.2 * nested.count(True)
    assert least <= window["comm_s"] < least + 0.3


def _gathered_early(prefetch: int | None) -> tuple[set[str], set[str]]:
    """The blocks whose all-gather FSDP has started when the first block's forward ends, and
    when the last block's gradients are reduced, in a 1-rank gloo job of 5 blocks."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from gpuflow.parallel.sharded import apply_fsdp

    events: list[tuple[str, str]] = []
    unshard, post_backward = FSDPParamGroup.unshard, FSDPParamGroup.post_backward
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        blocks = list(model[:5])
        apply_fsdp(model, blocks, None, reshard_after_forward=True, prefetch=prefetch)
        names = {id(block): f"b{index}" for index, block in enumerate(blocks)}

        def recorded(kind: str, method):
            def call(group, *args, **kwargs):
                events.append((kind, names.get(id(group.modules[0]), "root")))
                return method(group, *args, **kwargs)
            return call

        blocks[0].register_forward_hook(lambda *_: events.append(("forward", "b0")))
        FSDPParamGroup.unshard = recorded("gather", unshard)
        FSDPParamGroup.post_backward = recorded("reduce", post_backward)
        model(torch.randn(4, 8)).sum().backward()
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.post_backward = unshard, post_backward
        dist.destroy_process_group()
    forward_end = events.index(("forward", "b0"))
    backward_start = events.index(("gather", "root"), forward_end)
    first_reduce = events.index(("reduce", "b4"))

    def gathered(span: list[tuple[str, str]]) -> set[str]:
        return {name for kind, name in span if kind == "gather"} - {"root"}

    return gathered(events[:forward_end]), gathered(events[backward_start:first_reduce])


def test_fsdp_prefetch_gathers_that_many_blocks_ahead_in_forward_and_backward() -> None:
    """FSDP on its own starts one block's all-gather at a time in forward (its implicit
    prefetch needs a device stream) and the next one in backward; --fsdp-prefetch 2 starts
    the two after the running block in forward and the two before it in backward."""
    assert _gathered_early(None) == ({"b0"}, {"b4", "b3"})
    assert _gathered_early(2) == ({"b0", "b1", "b2"}, {"b4", "b3", "b2"})


def test_fsdp_prefetch_needs_blocks_to_prefetch() -> None:
    from gpuflow.errors import UserError
    from gpuflow.parallel.sharded import apply_fsdp

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with pytest.raises(UserError, match="--fsdp-prefetch 2 gathers the next blocks early, "
                                        "and --fsdp-wrap model"):
        apply_fsdp(model, [model[0]], None, True, wrap="model", prefetch=2)


def test_optimizer_is_fused_on_cpu_where_dtensor_allows() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor

    from gpuflow.train.optim import build_optimizer

    model = fresh_mlp().model
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
