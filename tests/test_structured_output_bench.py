"""benchmarks/structured_output.py's quick sizes end to end, as the GPU stage runs it
(``--dry-run``: on the CPU, the engine in its own process): it serves the stub model, drives
the cost windows, the TTFT repetitions and a few chat prompts, and writes the documented file.

Whether the targets are met is the full run's verdict on a quiet machine, not a unit test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_stages  # noqa: E402


def test_the_gpu_stage_dry_runs_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "structured_output.json"
    [stage] = [stage for stage in gpu_stages.STAGES if stage.name == "structured-output"]
    command = stage.command("nvidia-h100", 300)
    assert "--device" in command and "cuda" in command
    done = subprocess.run([sys.executable, *command, "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]

    result = json.loads(out.read_text())
    assert result["quick"] is result["dry_run"] is result["engine_process"] is True
    assert result["device"] == "cpu" and not stage.holds(result)
    assert {"created", "command", "git", "versions", "machine"} <= result.keys()
    assert result["versions"]["llguidance"]
    cost = result["cost"]
    assert cost["tokens_per_s"]["unconstrained"] > 0
    assert cost["tokens_per_s"]["half_constrained"] > 0
    for window in cost["rounds"]:
        assert window["unconstrained"]["all"]["errors"] == 0
        assert window["half_constrained"]["all"]["errors"] == 0
        assert window["unconstrained"]["grammar_mask"]["steps"] == 0
    assert cost["grammar_mask"]["steps"] > 0 and cost["grammar_mask"]["sum_s"] > 0
    ttft = result["ttft"]
    assert set(ttft["median_ms"]) == {"unconstrained", "cached_schema", "new_schema"}
    assert all(len(values) == ttft["repetitions"] for values in ttft["samples_ms"].values())
    assert set(result["targets"]) == {"tokens_per_s_ratio", "cached_ttft_added_ms",
                                      "new_ttft_added_ms"}
    quality = result["quality"]
    for mode in ("unconstrained", "constrained"):
        assert len(quality[mode]["answers"]) == quality["prompts"]
        assert 0 <= quality[mode]["valid"] <= quality[mode]["lenient"] <= 1
    # The stub's constrained answers are cut at max_tokens, never claimed complete.
    assert all(row["finish_reason"] == "length" or row["valid"]
               for row in quality["constrained"]["answers"])
    assert "half constrained at" in stage.headline(result)
