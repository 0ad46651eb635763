"""Data parallelism on 2 gloo ranks through the elastic launcher, as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli_env, run_cli
from runs import events, losses, newest_weights, step_records
from safetensors.torch import load_file

from gpuflow import checkpoint as ckpt
from gpuflow.cli import main
from gpuflow.parallel.env import free_port

pytestmark = pytest.mark.slow
COMMON = ["train", "--workload", "user_workloads:mlp", "--schedule", "constant",
          "--warmup-steps", "0", "--log-every", "1", "--eval-every", "0", "--lr", "0.01",
          "--no-progress"]


def assert_exposed_comm_measured(records: list[dict]) -> None:
    """Some communication was left exposed, and the breakdown's parts add up to the step."""
    assert records and all(0 <= r["comm_frac"] <= 1 for r in records)
    assert any(r["comm_s"] > 0 for r in records)
    for r in records:
        parts = (r["data_wait_s"] + r["compute_s"] + r["comm_s"] + r["optimizer_s"]
                 + r["host_s"])
        assert parts == pytest.approx(r["step_time_s"], rel=1e-6), r


def assert_same_curve(measured: list[float], reference: list[float], tolerance: float) -> None:
    """Equal loss curves, step for step, within ``tolerance``; prints the largest difference
    (``pytest -s``), the figure the docs quote."""
    worst = max(abs(a - b) for a, b in zip(measured, reference, strict=True))
    print(f"max |difference| {worst:.1e} over {len(measured)} steps")
    assert worst <= tolerance, (measured, reference)


def train(run_dir: Path, *args: str) -> dict:
    """`gpuflow train` with the COMMON flags, launched as a user would."""
    result = run_cli(*COMMON, "--run-dir", str(run_dir), *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def in_one_process(*argv: str) -> None:
    """`gpuflow ARGV` for one process: this one, with the CLI's own code (the reference
    curves, and checkpoints resumed in one process), sparing a start of torch per run; the
    launches of several ranks are the ones under test."""
    assert main(list(argv)) == 0


def train_here(run_dir: Path, *args: str) -> dict:
    """``train`` in this process."""
    in_one_process(*COMMON, "--run-dir", str(run_dir), *args)
    return json.loads((run_dir / "summary.json").read_text())


def stopped_at(run_dir: Path, step: int, copy: Path) -> Path:
    """A copy of a finished run as if it had stopped after ``step``'s checkpoint: a resume
    drops the records after it."""
    shutil.copytree(run_dir, copy)
    for checkpoint in ckpt.list_checkpoints(copy / "checkpoints"):
        if checkpoint.step > step:
            shutil.rmtree(checkpoint.path)
    return copy


@pytest.fixture(scope="module")
def single_20_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 steps in one process, a checkpoint at 10 for the runs that resume from it."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train_here(run_dir, "--batch-size", "32", "--max-steps", "20", "--checkpoint-every", "10")
    return run_dir


@pytest.fixture(scope="module")
def single_20(single_20_run: Path) -> list[float]:
    return losses(single_20_run)


# Momentum SGD, whose step doubles when every gradient doubles (AdamW's hardly changes), so
# the curves below also show a reduction that sums where it should average. Measured here: a
# doubled learning rate moves the 8-step curve by up to 0.6.
SGD = ("--optimizer", "sgd", "--max-steps", "8")


@pytest.fixture(scope="module")
def sgd_single(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("sgd") / "single"
    train_here(run_dir, *SGD, "--batch-size", "32")
    return losses(run_dir)


def assert_two_ranks_reproduce(run_dir: Path, reference: list[float]) -> dict:
    """The run's loss curve is the one-process one, on 2 ranks of a global batch of 32,
    with its exposed communication measured; its summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 32
    records = step_records(run_dir)
    assert len(records) == 8 and all(r["world_size"] == 2 for r in records)
    # Exposed communication is measured for both: DDP's after backward, FSDP's collectives
    # (which hold the host on the CPU) inside it; either way a part of the step.
    assert_exposed_comm_measured(records)
    # Measured here: max |difference| about 1e-7 (fp32 reduction order).
    assert losses(run_dir) == pytest.approx(reference, abs=1e-5)
    return summary


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp-model"])
def test_two_ranks_reproduce_the_single_process_loss_curve(
    strategy: str, sgd_single: list[float], tmp_path: Path
) -> None:
    """fsdp: per block, each gathering the next two ahead. fsdp-model: the whole model one
    FSDP unit, its gradients reduced in one collective. (ddp: the two-node job below.)"""
    flags = {"fsdp": ["--fsdp-prefetch", "2"], "fsdp-model": ["--fsdp-wrap", "model"]}[strategy]
    train(tmp_path, *SGD, "--strategy", "fsdp", *flags, "--nproc", "2", "--batch-size", "16")
    summary = assert_two_ranks_reproduce(tmp_path, sgd_single)
    assert summary["strategy"] == "fsdp" and summary["config"]["bucket_mb"] is None
    assert summary["config"]["fsdp_prefetch"] == (2 if strategy == "fsdp" else None)


def test_fsdp_checkpoint_resumes_in_one_process_and_back(
    single_20: list[float], single_20_run: Path, tmp_path: Path
) -> None:
    fsdp_first = tmp_path / "fsdp-first"
    train(fsdp_first, "--nproc", "2", "--strategy", "fsdp", "--batch-size", "16",
          "--max-steps", "10")
    # Each rank wrote its own shards; nothing was gathered.
    shards = sorted(p.name for p in (fsdp_first / "checkpoints" / "step-00000010" / "state")
                    .glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    in_one_process("export", str(fsdp_first), "--out", str(tmp_path / "model.safetensors"))
    assert load_file(tmp_path / "model.safetensors")["head.weight"].shape == (4, 16)
    train_here(fsdp_first, "--resume", "--nproc", "1", "--strategy", "single",
               "--batch-size", "32", "--max-steps", "20")
    assert losses(fsdp_first) == pytest.approx(single_20, abs=1e-5)

    single_first = stopped_at(single_20_run, 10, tmp_path / "single-first")
    summary = train(single_first, "--resume", "--nproc", "2", "--strategy", "fsdp",
                    "--batch-size", "16", "--max-steps", "20")
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert losses(single_first) == pytest.approx(single_20, abs=1e-5)


def test_the_weight_average_reshards_from_fsdp_to_one_process(tmp_path: Path) -> None:
    """The average lives in the optimizer state, so FSDP's sharded checkpoint carries it."""
    ema = ("--ema-decay", "0.8")
    whole = tmp_path / "single"
    train_here(whole, "--batch-size", "32", "--max-steps", "20", *ema)
    split = tmp_path / "fsdp-first"
    train(split, "--nproc", "2", "--strategy", "fsdp", "--batch-size", "16",
          "--max-steps", "20", "--checkpoint-every", "10", *ema)
    # As if it had stopped at step 10: a finished run ends with the average as its weights.
    shutil.rmtree(split / "checkpoints" / "step-00000020")
    summary = train_here(split, "--resume", "--nproc", "1", "--strategy", "single",
                         "--batch-size", "32", "--max-steps", "20")
    assert summary["ema_decay"] == 0.8
    final = [newest_weights(run) for run in (whole, split)]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, rtol=0, atol=1e-5)


def killing_rank_1(run_dir: Path, checkpoint_every: int, *args: str
                   ) -> subprocess.CompletedProcess[str]:
    """2 ranks of ``killed_mlp`` checkpointing every ``checkpoint_every`` steps: rank 1
    SIGKILLs itself once the first checkpoint is written."""
    marker = run_dir / "checkpoints" / f"step-{checkpoint_every:08d}"
    return run_cli("train", "--workload", "user_workloads:killed_mlp", "--nproc", "2",
                   "--checkpoint-every", str(checkpoint_every), "--batch-size", "16",
                   "--eval-every", "0", "--no-progress", "--run-dir", str(run_dir), *args,
                   env=cli_env(KILL_RANK="1", KILL_AFTER_CHECKPOINT=str(marker)))


def test_a_killed_rank_is_restarted_and_the_job_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = killing_rank_1(run_dir, 4, "--max-restarts", "1", "--max-steps", "12")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "SIGKILL" in result.stderr or "Signals.SIGKILL" in result.stderr or \
        "exitcode: -9" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2
    steps = [r["step"] for r in step_records(run_dir)]
    assert steps == [10, 12] or steps[-1] == 12


def test_a_failing_rank_is_named_and_the_job_exits_nonzero(tmp_path: Path) -> None:
    result = killing_rank_1(tmp_path / "run", 2, "--max-steps", "8")
    assert result.returncode == 1
    assert "Distributed job failed: rank 1 exited with code -9" in result.stderr


def test_two_launchers_form_a_two_node_job_over_loopback(sgd_single: list[float],
                                                        tmp_path: Path) -> None:
    """DDP over two nodes of one rank each, with 10 KiB buckets: its gradients in several
    all-reduces, averaged as in one process."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "gpuflow.cli", *COMMON, *SGD, "--strategy", "ddp",
             "--bucket-mb", "0.01", "--batch-size", "16", "--run-dir", str(run_dir),
             "--nnodes", "2", "--nproc", "1", "--node-rank", str(rank),
             "--rdzv-endpoint", endpoint],
            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    summary = assert_two_ranks_reproduce(run_dir, sgd_single)
    assert summary["strategy"] == "ddp" and summary["steps"] == 8
    assert summary["config"]["bucket_mb"] == 0.01 and summary["config"]["nnodes"] == 2


# Tensor, sequence and pipeline parallelism against one process, fp32: measured here, every
# curve within one fp32 rounding step of the loss (4.8e-7 near 5 nats; tp alone: identical).
# docs/parallelism.md states this bound.
CURVE_TOLERANCE = 1e-6
GPT = ["train", "--workload", "user_workloads:tiny_gpt", "--schedule", "constant",
       "--warmup-steps", "0", "--log-every", "1", "--eval-every", "0", "--no-progress"]


def gpt_losses(run_dir: Path, *args: str) -> list[float]:
    result = run_cli(*GPT, "--run-dir", str(run_dir), *args)
    assert result.returncode == 0, result.stderr[-4000:]
    return losses(run_dir)


@pytest.fixture(scope="module")
def gpt_single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 steps at a constant learning rate: its first 10 are also a 10-step run's; a
    checkpoint at 5 for the runs that resume from it."""
    run_dir = tmp_path_factory.mktemp("gpt") / "run"
    in_one_process(*GPT, "--run-dir", str(run_dir), "--batch-size", "16", "--max-steps", "12",
                   "--checkpoint-every", "5")
    return run_dir


@pytest.fixture(scope="module")
def gpt_single(gpt_single_run: Path) -> list[float]:
    return losses(gpt_single_run)


def test_tensor_parallel_matches_one_process_and_resumes_in_one(
    gpt_single: list[float], tmp_path: Path
) -> None:
    run_dir = tmp_path / "tp"
    assert_same_curve(gpt_losses(run_dir, "--nproc", "2", "--strategy", "tp", "--batch-size",
                                 "16", "--max-steps", "10"), gpt_single[:10], CURVE_TOLERANCE)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 1, "tp": 2, "pp": 1} and summary["global_batch"] == 16
    # DTensor's collectives are waited for on the host on the CPU; those waits are timed.
    assert_exposed_comm_measured(step_records(run_dir))
    in_one_process("train", "--resume", str(run_dir), "--nproc", "1", "--strategy", "single",
                   "--tp", "1", "--max-steps", "12", "--no-progress")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12


def test_fsdp_by_sequence_parallel_tp_on_a_2x2_mesh(gpt_single: list[float],
                                                    tmp_path: Path) -> None:
    """Tensor parallelism that also splits the norms and the residual stream along the
    sequence, inside each of two FSDP groups (plain tp: the test above)."""
    measured = gpt_losses(tmp_path, "--workload", "user_workloads:tiny_gpt_sequence_parallel",
                          "--nproc", "4", "--strategy", "fsdp", "--tp", "2",
                          "--batch-size", "8", "--max-steps", "10")
    assert_same_curve(measured, gpt_single[:10], CURVE_TOLERANCE)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 2, "tp": 2, "pp": 1} and summary["global_batch"] == 16
    # FSDP's collectives and DTensor's waits both hold the host on the CPU: both are timed.
    assert_exposed_comm_measured(step_records(tmp_path))


def test_pipeline_matches_one_process_and_resumes_in_one(
    gpt_single: list[float], tmp_path: Path
) -> None:
    run_dir = tmp_path / "pp"
    # 1F1B over 2 stages, 4 micro-batches.
    measured = gpt_losses(run_dir, "--nproc", "2", "--strategy", "pp", "--batch-size", "16",
                          "--max-steps", "10")
    assert_same_curve(measured, gpt_single[:10], CURVE_TOLERANCE)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 1, "tp": 1, "pp": 2} and summary["global_batch"] == 16
    assert summary["config"]["pp_schedule"] == "1f1b"
    # The last stage evaluates (the tied head and embedding live on different ranks).
    assert summary["final_metrics"]["val_loss"] > 0
    # The schedule's waits for sends and receives (the bubble with them) hold the host.
    assert_exposed_comm_measured(step_records(run_dir))
    assert_same_curve(resumed_in_one_process(run_dir), gpt_single, CURVE_TOLERANCE)


def resumed_in_one_process(run_dir: Path) -> list[float]:
    """The pipelined run continued to step 12 in one process: its whole loss curve."""
    in_one_process("train", "--resume", str(run_dir), "--nproc", "1", "--strategy", "single",
                   "--pp", "1", "--max-steps", "12", "--no-progress")
    return losses(run_dir)


def test_one_process_checkpoint_resumes_under_interleaved_pipeline(
    gpt_single: list[float], gpt_single_run: Path, tmp_path: Path
) -> None:
    run_dir = stopped_at(gpt_single_run, 5, tmp_path / "run")
    # Two stages per rank: 4 blocks over 4 stages, tied weights on ranks 0 and 1.
    resumed = run_cli("train", "--resume", str(run_dir), "--nproc", "2", "--strategy", "pp",
                      "--pp-schedule", "interleaved-1f1b", "--max-steps", "12", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_curve(losses(run_dir), gpt_single, CURVE_TOLERANCE)


def test_an_untraceable_model_is_cut_into_manual_stages_and_resumes_in_one(
    gpt_single: list[float], tmp_path: Path
) -> None:
    """torch.export cannot trace a forward that checks its token ids; the pipeline says so
    and cuts the model at its blocks by hand, with the loss curve of one process."""
    checked = ["--workload", "user_workloads:checked_gpt", "--run-dir", str(tmp_path)]
    result = run_cli(*GPT, *checked, "--nproc", "2", "--strategy", "pp", "--batch-size", "16",
                     "--max-steps", "10")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "cutting it into pipeline stages at its repeated blocks" in result.stderr
    assert "micro-batches, manual stages)" in result.stdout + result.stderr
    assert_same_curve(losses(tmp_path), gpt_single[:10], CURVE_TOLERANCE)
    assert events(tmp_path, "eval")[-1]["val_loss"] > 0
    assert_same_curve(resumed_in_one_process(tmp_path), gpt_single, CURVE_TOLERANCE)


def test_manual_stages_under_fsdp_and_interleaved_resume_a_one_process_run(
    gpt_single: list[float], tmp_path: Path
) -> None:
    """Two manual stages per rank hold the embedding and tied head twice on one rank; FSDP
    shards each stage; the checkpoint of one process loads into all of them."""
    checked = ["--workload", "user_workloads:checked_gpt", "--run-dir", str(tmp_path)]
    in_one_process(*GPT, *checked, "--batch-size", "16", "--max-steps", "5")
    resumed = run_cli("train", "--resume", str(tmp_path), "--nproc", "2", "--strategy", "fsdp",
                      "--pp", "2", "--pp-split", "manual", "--pp-schedule", "interleaved-1f1b",
                      "--clip-grad", "1e9", "--max-steps", "12", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The clip (far above the norm) runs the global norm without changing the step.
    assert_same_curve(losses(tmp_path), gpt_single, CURVE_TOLERANCE)


def test_fsdp_by_pipeline_on_a_2x2_mesh(gpt_single: list[float], tmp_path: Path) -> None:
    measured = gpt_losses(tmp_path, "--nproc", "4", "--strategy", "fsdp", "--pp", "2",
                          "--pp-schedule", "gpipe", "--batch-size", "8", "--max-steps", "10")
    assert_same_curve(measured, gpt_single[:10], CURVE_TOLERANCE)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 2, "tp": 1, "pp": 2} and summary["global_batch"] == 16
    # FSDP's collectives and the pipeline's waits both hold the host on the CPU.
    assert_exposed_comm_measured(step_records(tmp_path))


def test_fsdp_with_bf16_parameters_trains_a_batch_norm_model(tmp_path: Path) -> None:
    """Batch norm's running statistics stay fp32, so under FSDP's bf16 parameters each batch
    norm is kept in fp32; before, the digits CNN failed in its first forward. DDP under
    autocast casts the same weights to bf16 per op and normalises over the same per-rank
    batches, so the curves agree."""
    args = ["--workload", "digits", "--data", "synthetic", "--precision", "bf16",
            "--max-steps", "6", "--nproc", "2", "--batch-size", "16"]
    train(tmp_path / "ddp", *args, "--strategy", "ddp")
    train(tmp_path / "fsdp", *args, "--strategy", "fsdp")
    ddp, fsdp = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    print("max |fsdp - ddp| loss:", max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True)))
    # Measured here: identical curves (each conv sees the same bf16 weights either way).
    assert fsdp == pytest.approx(ddp, abs=1e-3)


def test_batches_shaped_unlike_the_traced_one_are_explained_under_pp(tmp_path: Path) -> None:
    """Speech pads each batch to its longest clip; pipeline stages exchange fixed shapes."""
    result = run_cli(*COMMON, "--run-dir", str(tmp_path), "--workload", "speech",
                     "--data", "synthetic", "--model-size", "tiny", "--strategy", "pp",
                     "--nproc", "2", "--max-steps", "2")
    assert result.returncode != 0
    assert "cannot be pipelined; use --strategy fsdp or ddp" in result.stderr + result.stdout
