"""Streams in the workload contract, and bounded evaluation with --eval-batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli_env, run_cli, sigkill_at_gate
from runs import events, step_records
from safetensors.torch import load_file
from stream_workloads import Counter, endless_counter, write_jsonl_shards
from torch.utils.data import Dataset
from user_workloads import TinyMLP, _separable

import gpuflow
from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.data.eval_set import eval_set
from gpuflow.data.iterable import StreamBatches
from gpuflow.train import record
from gpuflow.train.trainer import Trainer, train


def hf_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return cli_env(HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), **extra)


def seen_ids(folder: Path, rank: int) -> list[int]:
    return [int(word) for word in (folder / f"seen-{rank}.txt").read_text().split()]


def test_endless_stream_on_two_ranks_sees_every_sample_once(tmp_path: Path) -> None:
    """Each rank keeps every other sample of the counter: over 6 steps of 8 per rank the
    two ranks trained on 0..95, each id once; epochs are not reported for a stream."""
    seen = tmp_path / "seen"
    seen.mkdir()
    run_dir = tmp_path / "run"
    result = run_cli("train", "--workload", "stream_workloads:endless_counter", "--nproc",
                     "2", "--max-steps", "6", "--batch-size", "8", "--log-every", "3",
                     "--no-progress", "--run-dir", str(run_dir),
                     env=cli_env(SEEN_DIR=str(seen)))
    assert result.returncode == 0, result.stderr
    ranks = [seen_ids(seen, 0), seen_ids(seen, 1)]
    assert all(len(ids) == 6 * 8 == len(set(ids)) for ids in ranks)
    assert sorted(ranks[0] + ranks[1]) == list(range(2 * 6 * 8))
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [3, 6]
    assert all(r["epoch"] is None and isinstance(r["data_wait_s"], float) for r in records)


def test_ranks_and_loader_workers_split_a_stream_without_duplicates() -> None:
    """2 ranks x 2 loader workers: the four readers keep disjoint quarters of the counter."""
    taken = []
    for rank in (0, 1):
        stream = iter(StreamBatches(Counter(), 4, None, rank, 2, {"num_workers": 2}))
        taken += [int(i) for _ in range(4) for i in next(stream)[0][1]]
    assert sorted(taken) == list(range(32))


def test_a_stream_without_length_needs_max_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--workload", "stream_workloads:endless_counter",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the train dataset is a stream without a length" in err and "--max-steps N" in err
    assert main(["train", "--workload", "stream_workloads:endless_counter", "--epochs", "1",
                 "--no-progress"]) == 2


def test_hf_streaming_dataset_is_split_by_its_own_hook(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of a 4-file Hugging Face stream read 2 files each (split_dataset_by_node),
    together every row once."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    from datasets import load_dataset

    write_jsonl_shards(tmp_path / "data", shards=4, rows=8)
    stream = load_dataset("json", data_files=sorted(map(str, (tmp_path / "data").glob("*"))),
                          split="train", streaming=True)
    rows = []
    for rank in (0, 1):
        batches = iter(StreamBatches(stream, 4, list, rank, 2, {"num_workers": 0}))
        rows.append([json.dumps(row) for _ in range(4) for row in next(batches)])
    assert not set(rows[0]) & set(rows[1])
    everything = [json.dumps(row) for row in stream]
    assert sorted(rows[0] + rows[1]) == sorted(everything) and len(everything) == 32


def test_hf_stream_resumes_exactly_after_sigkill(tmp_path: Path) -> None:
    """200 rows in 2 files, 16 a step: 20 steps run past the stream's end into its second
    pass. Killed after the step-7 checkpoint and resumed, the run ends with the weights and
    the per-step losses of an uninterrupted one."""
    write_jsonl_shards(tmp_path / "data", shards=2, rows=100)
    common = ["train", "--workload", "stream_workloads:hf_stream", "--data-dir",
              str(tmp_path / "data"), "--max-steps", "20", "--checkpoint-every", "7",
              "--batch-size", "16", "--log-every", "1", "--no-progress"]
    reference = tmp_path / "reference"
    result = run_cli(*common, "--run-dir", str(reference), env=hf_env(tmp_path))
    assert result.returncode == 0, result.stderr

    run_dir = tmp_path / "killed"
    gate = run_dir / "checkpoints" / f"step-{7:08d}"
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.cli", *common, "--run-dir", str(run_dir)],
        env=hf_env(tmp_path, GATE_CHECKPOINT=str(gate)), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sigkill_at_gate(process, gate)
    assert [c.step for c in ckpt.list_checkpoints(run_dir / "checkpoints")] == [7]

    resumed = run_cli("train", "--resume", str(run_dir), "--no-progress", env=hf_env(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    banner = " ".join((resumed.stdout + resumed.stderr).split())
    assert "the train stream resumes at its saved position" in banner
    newest = [ckpt.list_checkpoints(d / "checkpoints")[0].path / ckpt.MODEL_FILE
              for d in (reference, run_dir)]
    ref_weights, new_weights = (load_file(path) for path in newest)
    assert all(torch.equal(ref_weights[name], new_weights[name]) for name in ref_weights)
    losses = [{r["step"]: r["loss"] for r in step_records(d)} for d in (reference, run_dir)]
    assert [losses[1][step] for step in range(8, 21)] == [losses[0][step]
                                                          for step in range(8, 21)]


def test_a_stream_without_state_resumes_from_a_fresh_iterator_and_says_so(
        tmp_path: Path) -> None:
    config = gpuflow.TrainConfig(max_steps=3, batch_size=4, progress=False,
                                 run_dir=str(tmp_path), eval_every=0)
    train(endless_counter(), config)
    resumed = Trainer(endless_counter(), gpuflow.TrainConfig(
        max_steps=5, batch_size=4, progress=False, run_dir=str(tmp_path), resume=True))
    banner = record.banner(resumed.description)
    resumed.close()
    assert "resumed at step 3" in banner
    assert "cannot be resumed exactly (it has no state_dict/load_state_dict)" in banner
    assert "fresh iterator" in banner


class Logged(Dataset):
    """A map-style set that records every index read."""

    def __init__(self, base: Dataset) -> None:
        self.base, self.reads = base, []

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        self.reads.append(index)
        return self.base[index]


def test_eval_batches_reads_the_same_spread_subset_every_time(tmp_path: Path) -> None:
    val = Logged(_separable(1000, seed=1))
    workload = gpuflow.Workload(name="mlp", model=TinyMLP(), train_dataset=_separable(256),
                                val_dataset=val)
    trainer = Trainer(workload, gpuflow.TrainConfig(
        max_steps=6, eval_every=3, eval_batches=3, batch_size=16, progress=False,
        run_dir=str(tmp_path)))
    assert "evaluates 3 of 63 validation batches (48 of 1,000 samples, the same each time)" \
        in record.banner(trainer.description)
    trainer.fit()
    assert len(val.reads) == 2 * 48  # at step 3, then the final evaluation at step 6
    first, second = val.reads[:48], val.reads[48:]
    assert first == second
    assert first == [*range(0, 16), *range(333, 349), *range(666, 682)]
    assert [e["step"] for e in events(tmp_path, "eval")] == [3, 6]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["eval_time_s"] < summary["wall_time_s"]


def test_small_validation_sets_and_streams_are_evaluated_whole_or_bounded() -> None:
    small = eval_set(_separable(50), batch_size=16, eval_batches=20)
    assert small.whole and len(small.dataset) == 50
    assert small.describe() == "the whole validation set (50 samples)"
    assert eval_set(_separable(50), batch_size=16, eval_batches=0).whole
    stream = eval_set(Counter(), batch_size=4, eval_batches=2)
    batches = [list(map(int, batch[0][1])) for batch in stream.loader(None, 0, False)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(map(int, b[0][1])) for b in stream.loader(None, 0, False)] == batches
    with pytest.raises(gpuflow.UserError, match="cannot be evaluated whole: give --eval-batches"):
        eval_set(Counter(), batch_size=4, eval_batches=0)
