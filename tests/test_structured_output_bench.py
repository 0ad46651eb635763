"""benchmarks/structured_output.py's quick mode end to end: it serves the stub model, drives
the cost windows, the TTFT repetitions and a few chat prompts, and writes the documented file.

Whether the targets are met is the full run's verdict on a quiet machine, not a unit test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "structured_output.py"


def test_quick_structured_output_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "structured_output.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]

    result = json.loads(out.read_text())
    assert result["quick"] is True
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
