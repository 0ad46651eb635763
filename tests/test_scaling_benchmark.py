"""The scaling benchmarks: scaling.py's quick mode end to end and its efficiency arithmetic,
and lockstep.py's measurement.

It checks that the script drives `gpuflow train` for 1 and 2 processes under ddp and fsdp (as
one unit) and writes the documented result. Whether the efficiency target is met is the benchmark's
verdict on a quiet machine, not a unit test's: a shared CI box cannot promise it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scaling.py"


@pytest.mark.slow
def test_quick_scaling_benchmark_reports_ddp_and_fsdp_efficiency(tmp_path: Path) -> None:
    out = tmp_path / "results" / "scaling-test.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--strategies", "ddp,fsdp-model",
         "--workdir", str(tmp_path / "runs"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "efficiency" in proc.stdout

    result = json.loads(out.read_text())
    assert result["benchmark"] == "scaling"
    assert {"cpu_model", "logical_cores", "usable_cores"} <= result["machine"].keys()
    assert {"torch", "python", "gpuflow"} <= result["versions"].keys()
    assert result["settings"]["quick"] is True

    parallel = {"ddp": "ddp", "fsdp-model": "fsdp"}  # config: the strategy it trains with
    assert result["efficiency"].keys() == parallel.keys()
    for config, efficiency in result["efficiency"].items():
        assert len(efficiency["per_round"]) == 1
        for value in [*efficiency["per_round"], efficiency["median"]]:
            assert math.isfinite(value) and value > 0, (config, value)
    assert result["target"].keys() == parallel.keys()

    runs = {run["config"]: run for run in result["runs"]}
    assert runs.keys() == {"single", *parallel}
    assert runs["single"]["world_size"] == 1 and runs["single"]["strategy"] == "single"
    assert runs["single"]["torch_threads"] == 1
    for config, strategy in parallel.items():
        run = runs[config]
        assert (run["world_size"], run["strategy"]) == (2, strategy)
        assert run["global_batch"] == 2 * runs["single"]["global_batch"]
        assert run["samples_per_s"] > 0
    assert all(part["steps"] == 8 for run in runs.values() for part in run["parts"])


@pytest.mark.slow
def test_lockstep_benchmark_times_both_modes_in_every_round(tmp_path: Path) -> None:
    out = tmp_path / "lockstep.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lockstep.py"), "--batch-size", "64",
         "--steps", "1", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "lockstep" and result["settings"]["processes"] == 2
    times = result["step_s_per_round"]
    assert times.keys() == {"free", "lockstep"} and all(len(v) == 2 for v in times.values())
    medians = result["median_step_s"]
    assert result["lockstep_cost"] == pytest.approx(medians["lockstep"] / medians["free"])
    assert result["efficiency_bound"] == pytest.approx(1 / result["lockstep_cost"])


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scaling_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_efficiency_is_taken_round_by_round_against_that_rounds_single_run() -> None:
    """The control (N independent processes) is too slow for the quick smoke run, so its
    arithmetic is checked here on made-up throughputs."""
    scaling = load_benchmark()
    throughput = [{"single": 100.0, "ddp": 180.0, "independent": 200.0},
                  {"single": 50.0, "ddp": 95.0, "independent": 90.0}]
    runs = [
        {"config": name, "round": index, "samples_per_s": value, "processes": 2,
         "world_size": 1 if name != "ddp" else 2, "global_batch": 8, "torch_threads": 1,
         "foreign_cpu_share": None,
         "median_ms": {"step_time": 1.0, "comm": None}}
        for index, values in enumerate(throughput) for name, value in values.items()
    ]
    summary = scaling.summarize(runs, ["single", "ddp", "independent"], nproc=2)
    ddp = summary["efficiency"]["ddp"]
    assert ddp["per_round"] == pytest.approx([0.9, 0.95])
    assert ddp["median"] == pytest.approx(0.925)
    assert ddp["vs_independent_per_round"] == pytest.approx([0.9, 95 / 90])
    assert summary["efficiency"]["independent"]["per_round"] == pytest.approx([1.0, 0.9])
    assert summary["configs"]["single"]["median_samples_per_s"] == pytest.approx(75.0)
    assert summary["configs"]["ddp"]["median_ms"] == {"step_time": 1.0, "comm": None}
    assert "ddp" in scaling.format_table(summary, runs)
