"""Checkpoints are atomic and verified, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, cli_env, sigkill_at_gate
from hub_models import one_thread
from runs import configs, newest_weights, step_records
from user_workloads import gated_digits, mlp

from gpuflow import Trainer, train
from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.parallel import state as parallel_state
from gpuflow.parallel.env import free_port
from gpuflow.train.averaging import STATE_KEY, WeightAverage
from gpuflow.train.trainer import seed_everything

config = configs(max_steps=12, batch_size=32, log_every=3, eval_every=0, warmup_steps=3)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_in_process_is_bitwise_exact_with_grad_accum(tmp_path: Path) -> None:
    seed_everything(0)
    train(gated_digits(), config(tmp_path / "full", grad_accum=2))

    seed_everything(0)
    first = Trainer(gated_digits(), config(tmp_path / "split", grad_accum=2))
    first.run_steps(5)
    first.save_checkpoint()
    first.close()
    result = train(gated_digits(), config(tmp_path / "split", grad_accum=2,
                                          resume=True))
    assert result.steps == 12
    assert_same_weights(newest_weights(tmp_path / "full"), newest_weights(tmp_path / "split"))
    assert [r["step"] for r in step_records(tmp_path / "split")] == [3, 6, 9, 12]


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """All three runs (reference and resume here, the killed one in a subprocess) on one
    torch thread: left to itself, each picks its threads from how busy the machine is when
    it starts, and a different count sums in a different order (not bit-identical under
    a loaded full suite)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the subprocess's, and no choosing here
    with one_thread():
        _sigkill_then_resume(tmp_path)


def _sigkill_then_resume(tmp_path: Path) -> None:
    n = 15
    common = ["train", "--workload", "user_workloads:gated_digits", "--max-steps", str(2 * n),
              "--checkpoint-every", str(n), "--eval-every", "0", "--batch-size", "32",
              "--no-progress"]
    reference = tmp_path / "reference"
    assert main([*common, "--run-dir", str(reference)]) == 0

    run_dir = tmp_path / "killed"
    gate = run_dir / "checkpoints" / f"step-{n:08d}"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.cli", *common, "--run-dir", str(run_dir)],
        env=cli_env(GATE_CHECKPOINT=str(gate)), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    sigkill_at_gate(process, gate)
    assert [c.step for c in ckpt.list_checkpoints(run_dir / "checkpoints")] == [n]

    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 * n
    assert_same_weights(newest_weights(reference), newest_weights(run_dir))
    ref_state = torch.load(ckpt.list_checkpoints(reference / "checkpoints")[0].path
                           / ckpt.TRAINER_FILE, weights_only=True)
    new_state = torch.load(ckpt.list_checkpoints(run_dir / "checkpoints")[0].path
                           / ckpt.TRAINER_FILE, weights_only=True)
    for key, value in ref_state["optimizer"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, new_state["optimizer"]["state"][key][name])


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(mlp(), config(run_dir, checkpoint_every=4))
    checkpoints = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [c.step for c in checkpoints] == [12, 8, 4]
    newest = checkpoints[0].path / ckpt.MODEL_FILE
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))

    with pytest.warns(UserWarning, match="fails its checksum"):
        trainer = Trainer(mlp(), config(run_dir, checkpoint_every=4, max_steps=14, resume=True))
    assert trainer.step == 8
    trainer.close()


def test_every_checkpoint_corrupt_is_a_clear_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(mlp(), config(run_dir, max_steps=3))
    for checkpoint in ckpt.list_checkpoints(run_dir / "checkpoints"):
        (checkpoint.path / ckpt.MANIFEST_FILE).write_text("{")
    with pytest.warns(UserWarning, match="unreadable manifest"), \
            pytest.raises(Exception, match="no valid checkpoint"):
        Trainer(mlp(), config(run_dir, resume=True))


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
@pytest.mark.parametrize("sharded", [False, True])
def test_saves_killed_midway_are_never_listed_and_gone_after_the_next_save(
        tmp_path: Path, sharded: bool) -> None:
    """Either layout's save removes what any killed save left (a sharded one's folder was
    kept before), ahead of counting its room."""
    directory = tmp_path / "checkpoints"
    for leftover in (".tmp-step-00000009-sharded/state", ".tmp-step-00000008-123",
                     f".tmp-step-00000007-{os.getpid()}"):
        (directory / leftover).mkdir(parents=True)
        (directory / leftover / ckpt.MODEL_FILE).write_bytes(b"partial")
    assert ckpt.list_checkpoints(directory) == []
    weights = torch.nn.Linear(2, 2).state_dict()
    if sharded:
        saved = ckpt.save_sharded_checkpoint(directory, 3, {"model": weights}, {"step": 3},
                                             keep=2, is_main=True, gather=lambda view: [view])
    else:
        saved = ckpt.save_checkpoint(directory, 3, weights, {"step": 3}, keep=2)
    assert [path.name for path in directory.iterdir()] == ["step-00000003"]
    assert ckpt.verify_checkpoint(saved)["step"] == 3


def test_keep_checkpoints_prunes_oldest(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(mlp(), config(run_dir, checkpoint_every=2, keep_checkpoints=2))
    assert [c.step for c in ckpt.list_checkpoints(run_dir / "checkpoints")] == [12, 10]


def test_nonfinite_loss_stops_with_exit_3_and_keeps_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DIVERGE_AFTER", "6")
    run_dir = tmp_path / "run"
    code = main(["train", "--workload", "user_workloads:diverging", "--max-steps", "40",
                 "--checkpoint-every", "5", "--max-nonfinite-steps", "4", "--batch-size", "16",
                 "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "NaN/inf for 4 consecutive steps (7-10)" in err
    checkpoints = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [c.step for c in checkpoints] == [5]
    ckpt.verify_checkpoint(checkpoints[0])
    assert all(torch.isfinite(t).all() for t in newest_weights(run_dir).values())
    assert not (run_dir / "summary.json").exists()


def _averaged_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   average: WeightAverage, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    average.update()


def _ema_resume_worker(rank: int, port: int, out: str) -> None:
    """A one-process run's weights, optimizer and weight average (two steps), loaded into
    the same model sharded over two ranks, one more step on each."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    alone, inputs = torch.nn.Linear(8, 8), torch.randn(4, 8)
    sharded = fully_shard(torch.nn.Linear(8, 8))
    runs = []
    for model in (alone, sharded):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        runs.append((model, optimizer, WeightAverage(optimizer, 0.5)))
    for _ in range(2):
        _averaged_step(*runs[0], inputs)
    # What a one-process checkpoint holds, on every rank (full_state() gives rank 0 alone),
    # copied as a file would be: the one-process run goes on updating its own.
    saved = copy.deepcopy((alone.state_dict(), get_optimizer_state_dict(
        alone, runs[0][1], options=StateDictOptions(full_state_dict=True))))
    parallel_state.load(sharded, saved[0], runs[1][1], saved[1], full=True)
    for run in runs:  # the sharded run's step failed: a whole average and sharded weights
        _averaged_step(*run, inputs)
    expected = runs[0][1].state[alone.weight][STATE_KEY]
    got = runs[1][1].state[sharded.weight][STATE_KEY]
    Path(f"{out}.{rank}").write_text(json.dumps(
        [type(got).__name__, torch.equal(got.full_tensor(), expected)]))
    dist.destroy_process_group()


def test_a_weight_average_from_one_process_resumes_sharded(tmp_path: Path) -> None:
    """`gpuflow train --ema-decay D` saved by one process and resumed with `--nproc 2
    --strategy fsdp` crashed in torch._foreach_lerp_ (a plain average, DTensor weights)."""
    out = str(tmp_path / "ema")
    mp.start_processes(_ema_resume_worker, args=(free_port(), out), nprocs=2,
                       start_method="fork")  # nothing to import again
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.{rank}").read_text()) == ["DTensor", True]
