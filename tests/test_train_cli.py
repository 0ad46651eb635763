"""End-to-end runs of `gpuflow train` as a user types it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import cli_env, run_cli
from runs import events, step_records

from gpuflow.cli import main

STEP_FIELDS = ("step", "loss", "lr", "samples_per_s", "tokens_per_s", "step_time_s",
               "data_wait_s", "compute_s", "optimizer_s", "data_wait_frac", "flops_per_step",
               "achieved_flops", "mfu", "peak_mem_bytes", "skipped_steps")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    result = run_cli("train", "--workload", "digits", "--run-dir", str(run_dir),
                     "--eval-every", "50")
    assert result.returncode == 0, result.stderr
    return run_dir, result.stdout


def test_digits_reaches_95_percent(digits_run: tuple[Path, str]) -> None:
    run_dir, stdout = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"]["val_accuracy"] >= 0.95
    assert "val_accuracy" in stdout and "MFU" in stdout


def test_the_run_saves_what_its_server_needs(digits_run: tuple[Path, str]) -> None:
    """serving.json holds the codec's state (digits: its normalisation statistics), so a
    server decodes images without the training data."""
    run_dir, _ = digits_run
    state = json.loads((run_dir / "serving.json").read_text())
    assert state["spec"]["shape"] == [1, 8, 8]
    assert state["spec"]["stats"] == pytest.approx([0.305, 0.376], abs=0.01)


def test_metrics_jsonl_has_every_field_and_sane_values(digits_run: tuple[Path, str]) -> None:
    run_dir, _ = digits_run
    steps, evals = step_records(run_dir), events(run_dir, "eval")
    assert steps and evals
    assert [e["step"] for e in evals][:2] == [50, 100]
    assert {"val_loss", "val_accuracy"} <= set(evals[-1])
    for record in steps:
        assert set(STEP_FIELDS) <= set(record)
        assert 0 < record["mfu"] <= 1
        assert 0 <= record["data_wait_frac"] <= 1
        assert record["tokens_per_s"] is None
        assert record["comm_s"] == 0 and record["comm_frac"] == 0
        assert record["flops_per_step"] > 0 and record["peak_mem_bytes"] > 0
        parts = record["data_wait_s"] + record["compute_s"] + record["optimizer_s"]
        assert parts <= record["step_time_s"] * 1.05
        assert math.isclose(record["achieved_flops"],
                            record["flops_per_step"] / record["step_time_s"], rel_tol=1e-9)
    assert steps[0]["loss"] > steps[-1]["loss"]


def test_summary_names_the_peak_and_its_source(digits_run: tuple[Path, str]) -> None:
    run_dir, _ = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_flops"] > 0
    assert summary["peak_flops_source"].startswith("measured: best torch.mm fp32")
    assert 0 < summary["median"]["mfu"] <= 1
    assert summary["versions"]["torch"]
    assert summary["device"] == "cpu" and summary["precision"] == "fp32"
    assert Path(summary["checkpoint"]).is_dir()
    assert json.loads((run_dir / "config.json").read_text())["eval_every"] == 50


def test_toml_config_and_flag_override(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('workload = "user_workloads:mlp"\nmax-steps = 7\nbatch-size = 16\n')
    run_dir = tmp_path / "run"
    result = run_cli("train", "--config", str(config), "--max-steps", "4",
                     "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["global_batch"] == 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nosuch"], "Unknown workload 'nosuch'"),
        (["--workload", "no_such_module:build"], "Cannot import module 'no_such_module'"),
        (["--workload", "user_workloads:missing"], "has no callable 'missing'"),
        (["--workload", "user_workloads:not_a_workload"], "returned dict, not a gpuflow.Workload"),
        (["--workload", "user_workloads:wrong_shape"], "the model failed on a batch"),
        (["--workload", "user_workloads:single_items"], "must yield (inputs, target) pairs"),
        (["--device", "cuda"], "sees no CUDA GPU"),
        (["--device", "tpu"], "is not a device"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--batch-size", "100000"], "larger than the training set"),
        (["--max-steps", "5", "--epochs", "1"], "either --max-steps or --epochs"),
        (["--resume", "/nonexistent/run"], "is not a gpuflow run dir"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = [] if "--epochs" in args else ["--max-steps", "2"]
    code = main(["train", *steps, "--run-dir", str(tmp_path / "r"), "--no-progress", *args])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert message in stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_bad_input_from_a_subprocess_prints_no_traceback(tmp_path: Path) -> None:
    result = run_cli("train", "--workload", "user_workloads:wrong_shape",
                     "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    assert "the model failed on a batch" in result.stderr and "Traceback" not in result.stderr


def test_unknown_flag_is_rejected() -> None:
    result = run_cli("train", "--batchsize", "3")
    assert result.returncode == 2 and "unrecognized arguments: --batchsize" in result.stderr


def test_env_reports_versions_and_peak_source() -> None:
    result = run_cli("env", "--json", env=cli_env())
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["torch"].startswith("2.")
    assert report["mfu_device"] == "cpu"
    assert report["mfu_peaks"]["fp32"]["flops"] > 0
    assert "measured" in report["mfu_peaks"]["bf16"]["source"]


def test_workload_options_reach_the_factory(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "synthetic"
    assert main(["train", "--data", "synthetic", "--max-steps", "3", "--run-dir", str(run_dir),
                 "--no-progress"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["data"] == "synthetic"
    code = main(["train", "--data-dir", str(tmp_path), "--max-steps", "3", "--no-progress",
                 "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert f"--data-dir {tmp_path} holds no packed set" in capsys.readouterr().err
