"""A full or unwritable disk: one clear message and exit 2, no traceback, no temporary
files left, and every earlier checkpoint intact, for checkpoints (one process and one rank
of two), metrics.jsonl, `gpuflow data pack` and `gpuflow export`. The disk is
``disk_faults.FullDisk``: a byte budget under a folder, so no root is needed."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from disk_faults import (
    FullDisk,
    assert_clear_message,
    assert_earlier_checkpoints_intact,
    cli_here,
    install,
)

from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.errors import UserError
from gpuflow.parallel.env import free_port
from gpuflow.telemetry.steps import MetricsLog

TRAIN = ["train", "--workload", "disk_faults:paced_mlp", "--batch-size", "16",
         "--eval-every", "0", "--no-progress", "--checkpoint-every", "4", "--max-steps", "12"]

NEEDED = 64 * 65 * 4  # the bytes of weights(): 64 x 65 float32


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=generator), "b": torch.zeros(64)}


def saved_twice(directory: Path) -> None:
    for step in (1, 2):
        ckpt.save_checkpoint(directory, step, weights(step), {"step": step}, keep=2)


def test_a_disk_filling_partway_through_a_checkpoint_keeps_every_earlier_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved_twice(tmp_path)
    # The file system still reports room (statvfs is stale, or another job fills it).
    disk = FullDisk(tmp_path, budget=6000, stale_free=True)
    install(disk, monkeypatch.setattr)
    with pytest.raises(UserError) as raised:
        ckpt.save_checkpoint(tmp_path, 3, weights(3), {"step": 3}, keep=2)
    assert disk.left == 0  # it failed partway, after writing what fitted
    message = str(raised.value)
    assert_clear_message(message, "step-00000003", "--keep-checkpoints", "--run-dir")
    assert f"needs {NEEDED:,} bytes" in message
    monkeypatch.undo()
    assert_earlier_checkpoints_intact(tmp_path, [2, 1])


def test_a_disk_known_to_be_full_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved_twice(tmp_path)
    disk = FullDisk(tmp_path, budget=6000)
    install(disk, monkeypatch.setattr)
    with pytest.raises(UserError, match=rf"needs {NEEDED:,} bytes, 6,000 bytes free"):
        ckpt.save_checkpoint(tmp_path, 3, weights(3), {"step": 3}, keep=2)
    assert disk.left == 6000
    monkeypatch.undo()
    assert_earlier_checkpoints_intact(tmp_path, [2, 1])


def test_a_checkpoint_that_reads_back_wrong_prunes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--keep-checkpoints deletes the oldest only once the new one reads back whole."""
    saved_twice(tmp_path)
    real_sha256 = ckpt._sha256
    monkeypatch.setattr(ckpt, "_sha256", lambda path: "bad" if path.name == ckpt.MODEL_FILE
                        else real_sha256(path))  # what a disk that loses bytes reads back
    with pytest.raises(UserError, match="model.safetensors fails its checksum .* read back"):
        ckpt.save_checkpoint(tmp_path, 3, weights(3), {"step": 3}, keep=2)
    monkeypatch.undo()
    assert_earlier_checkpoints_intact(tmp_path, [2, 1])


# What a sharded save of _sharded_state() writes over both ranks: the DTensor weight's two
# halves (256 x 256 float32), its replicated bias once (64), the plain tensor both ranks
# hold once (128 x 128), and rank 0's trainer state (one int64). Summing every rank's global
# sizes asked for 655,880 bytes.
SHARDED_NEEDED = 256 * 256 * 4 + 64 * 4 + 128 * 128 * 4 + 8
TRAINER_STATE = {"step": torch.tensor(5), "optimizer": {"param_groups": []}}


def _sharded_state() -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    return {"model": {"weight": distribute_tensor(torch.ones(256, 256), mesh, [Shard(0)]),
                      "bias": distribute_tensor(torch.ones(64), mesh, [Replicate()])},
            "optimizer": {"scale": torch.full((128, 128), 2.0)}}


def _sharded_save_worker(rank: int, port: int, directory: str) -> None:
    """Each rank's disk first has too little room for the save, then enough for what the
    ranks write but not for their global sizes summed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state, folder = _sharded_state(), Path(directory) / "checkpoints"
    disk = FullDisk(folder, 0)
    install(disk, setattr)

    def save(budget: int) -> str:
        disk.left = budget
        gather = lambda view: (dist.all_gather_object(views := [None, None], view),  # noqa: E731
                               views)[1]
        try:
            ckpt.save_sharded_checkpoint(folder, budget, state, TRAINER_STATE,
                                         keep=2, is_main=rank == 0, gather=gather)
        except UserError as exc:
            return str(exc)
        return "saved"

    outcomes = [save(200_000), save(SHARDED_NEEDED + 100_000)]
    Path(f"{directory}/rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
def test_a_sharded_save_asks_for_the_room_its_ranks_write_not_global_sizes(
        tmp_path: Path) -> None:
    mp.start_processes(_sharded_save_worker, args=(free_port(), str(tmp_path)), nprocs=2,
                       start_method="fork")  # nothing to import again
    for rank in (0, 1):
        refused, saved = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert f"needs {SHARDED_NEEDED:,} bytes, 200,000 bytes free" in refused
        assert saved == "saved"
    checkpoints = tmp_path / "checkpoints"
    assert [c.step for c in ckpt.list_checkpoints(checkpoints)] == [SHARDED_NEEDED + 100_000]
    weights, trainer_state = ckpt.load_checkpoint(ckpt.list_checkpoints(checkpoints)[0])
    assert torch.equal(weights["weight"], torch.ones(256, 256))
    assert torch.equal(trainer_state["optimizer"]["state"]["scale"], torch.full((128, 128), 2.0))
    assert trainer_state["step"] == 5


def test_an_unwritable_folder_is_one_clear_message(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    saved_twice(tmp_path)
    real_open = io.open

    def denied(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode and ".tmp-" in str(file):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", denied)
    with pytest.raises(UserError, match="Cannot write .*step-00000003: EACCES .*--run-dir"):
        ckpt.save_checkpoint(tmp_path, 3, weights(3), {"step": 3}, keep=2)
    monkeypatch.undo()
    assert_earlier_checkpoints_intact(tmp_path, [2, 1])


def test_a_full_disk_under_metrics_jsonl_is_one_clear_message_and_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    install(FullDisk(tmp_path, budget=100, stale_free=True), monkeypatch.setattr)
    log.open(keep_until_step=None)
    log.write({"step": 1, "loss": 0.5})
    with pytest.raises(UserError) as raised:
        for step in range(2, 10):
            log.write({"step": step, "loss": 0.25, "padding": "x" * 20})
    assert_clear_message(str(raised.value), "metrics.jsonl", "--run-dir")
    log.close()
    monkeypatch.undo()
    resumed = MetricsLog(tmp_path / "metrics.jsonl")
    resumed.open(keep_until_step=5)  # the line the disk cut short is dropped
    assert [r["step"] for r in resumed.records] == [1, 2]
    resumed.close()


def test_packing_onto_a_full_disk_exits_2_and_continues_once_there_is_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "packed"
    pack = ["data", "pack", "--workload", "digits", "--out", str(out), "--no-progress",
            "--shard-size-mb", "0.1"]
    install(FullDisk(out, budget=150_000, stale_free=True), monkeypatch.setattr)
    assert main(pack) == 2
    assert_clear_message(capsys.readouterr().err, str(out), "--out")
    assert not list(out.glob(".*.tmp"))
    monkeypatch.undo()
    assert main(pack) == 0


def test_training_on_a_disk_that_fills_up_exits_2_and_its_checkpoint_exports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(One rank of two: tests/test_preemption.py's reference run.)"""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    install(FullDisk(checkpoints, budget=1000, stale_free=True,
                     after=checkpoints / "step-00000004"), monkeypatch.setattr)
    assert cli_here(*TRAIN, "--run-dir", str(run_dir)) == 2
    assert_clear_message(capsys.readouterr().err, "step-00000008", "--keep-checkpoints",
                         "--run-dir")
    monkeypatch.undo()
    assert_earlier_checkpoints_intact(checkpoints, [4])

    out = tmp_path / "export"
    install(FullDisk(out, budget=1000, stale_free=True), monkeypatch.setattr)
    assert main(["export", str(run_dir), "--out", str(out / "model.safetensors")]) == 2
    assert_clear_message(capsys.readouterr().err, "model.safetensors", "--out")
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert main(["export", str(run_dir), "--out", str(out / "model.safetensors")]) == 0
