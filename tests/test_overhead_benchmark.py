"""The overhead benchmark in its quick mode.

Beyond checking that the script runs and writes the documented result, this is a parity
test: gpuflow's Trainer (telemetry and logging on) must leave the same weights, bit for
bit, as a hand-written PyTorch loop on the same data, order, optimizer and precision.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"


def test_quick_overhead_benchmark_matches_plain_loop_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "results" / "overhead-test.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--models", "linear,cnn", "--precisions",
         "fp32", "--threads", "1", "--no-fabric", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpuflow ms" in proc.stdout

    result = json.loads(out.read_text())
    assert result["benchmark"] == "overhead"
    assert {"cpu_model", "logical_cores", "torch_threads"} <= result["machine"].keys()
    assert result["machine"]["torch_threads"] == 1
    assert {"torch", "python", "gpuflow"} <= result["versions"].keys()
    assert result["fabric"] is None
    assert "--no-fabric" in result["fabric_reason"]

    cases = result["cases"]
    assert [(c["model"], c["precision"]) for c in cases] == [("linear", "fp32"), ("cnn", "fp32")]
    for case in cases:
        where = f"{case['model']}/{case['precision']}"
        assert case["weights_changed"], f"{where}: training did not move the weights"
        assert case["bitwise_equal"], f"{where}: {case['weights_vs_plain']['gpuflow']}"
        assert case["gpuflow_steps_run"] == case["total_steps"] == 3 * 10
        assert len(case["round_times_s"]["plain"]) == len(case["round_times_s"]["gpuflow"]) == 2
        assert set(case["median_step_ms"]) == {"plain", "control", "gpuflow"}
        assert case["weights_vs_plain"]["control"]["bitwise_equal"], where
        assert case["median_step_ms"]["gpuflow"] > 0
        assert {"median_ratio", "extra_ms_per_step"} <= case["gpuflow"].keys()
        assert {"metric", "value", "limit", "met"} <= case["target"].keys()
        assert "fabric" not in case
    assert result["all_bitwise_equal"] is True
