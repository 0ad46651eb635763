"""`gpuflow train --strategy auto` and `--batch-size auto` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from gpuflow.cli import main


def test_auto_strategy_and_batch_keep_the_global_batch_and_record_predictions(
    tmp_path: Path,
) -> None:
    # 2 MiB leaves room for about 17 digits samples of activations: a real limit to find.
    result = run_cli("train", "--workload", "digits", "--strategy", "auto", "--batch-size",
                     "auto", "--global-batch", "128", "--memory-cap-gib", "0.002",
                     "--max-steps", "20", "--eval-every", "0", "--no-progress",
                     "--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--strategy auto chose single" in result.stderr
    assert "planner: step time" in result.stdout and "measured (" in result.stdout
    assert "planner: peak memory" not in result.stdout  # no tensor peak measured on a CPU
    summary = json.loads((tmp_path / "summary.json").read_text())
    plan, probe = summary["plan"]["strategy_auto"], summary["plan"]["batch_size_auto"]
    assert plan["strategy"] == "single" and plan["fits"]
    assert 1 <= probe["micro_batch"] <= probe["largest_fitting"] < 128
    assert probe["micro_batch"] * probe["grad_accum"] == 128 == summary["global_batch"]
    config = summary["config"]
    assert (config["batch_size"], config["grad_accum"]) == (probe["micro_batch"],
                                                            probe["grad_accum"])
    predicted_mem, measured_mem = summary["plan"]["predicted_vs_measured"]["peak_mem_bytes"]
    predicted_step, measured_step = summary["plan"]["predicted_vs_measured"]["step_time_s"]
    assert predicted_mem > 0 and predicted_step > 0 and measured_step > 0
    assert measured_mem is None  # the CPU's RSS measures more than the tensors predicted
    assert summary["final_metrics"]["val_accuracy"] > 0.5
    # The report shows the choice and the predictions beside the measurements.
    report = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "--out", str(report)]) == 0
    page = report.read_text()
    assert "Planner: predicted and measured" in page and "strategy auto chose" in page
    error = 100 * (predicted_step / measured_step - 1)
    assert f"{error:,.4g}" in page
    assert f"<td class=\"num\">{probe['largest_fitting']}</td>" in page


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-size", "auto", "--strategy", "fsdp"], "--batch-size auto probes one whole"),
        (["--batch-size", "16", "--global-batch", "100"], "--global-batch 100 is not"),
        (["--batch-size", "auto", "--memory-cap-gib", "0.000001"], "leaves no room"),
    ],
)
def test_bad_auto_settings_are_explained(flags: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--workload", "user_workloads:mlp", "--max-steps", "1",
                 "--no-progress", "--run-dir", str(tmp_path), *flags])
    assert code == 2
    assert message in capsys.readouterr().err
