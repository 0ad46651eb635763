"""benchmarks/gpu_workloads.py: its dry run walks both GPU stages on the CPU at toy sizes,
so the GPU call has no untried path, and records their figures with where they came from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_workloads.py"


def dry_run(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_dry_run_records_both_stages_figures(tmp_path: Path, small_fsdd: Path) -> None:
    result = dry_run(tmp_path / "workloads.json", "--recordings", str(small_fsdd))
    assert result["benchmark"] == "gpu_workloads" and result["dry_run"] is True
    assert result["stages"] == ["finetune", "asr"]
    assert re.fullmatch(r"[0-9a-f]{40}", result["git"]["commit"])
    assert result["versions"]["torch"] == torch.__version__
    assert "--dry-run" in result["command"] and result["created"].startswith("20")
    assert result["machine"]["usable_cores"] >= 1

    finetune = result["finetune"]
    assert finetune["ok"] and finetune["passed"], finetune
    assert finetune["mfu"] > 0 and finetune["tokens_per_s"] > 0
    assert finetune["strategy"] == "fsdp" and finetune["precision"] == "bf16"
    assert finetune["steps"] == result["settings"]["finetune"]["steps"]
    assert finetune["peak_mem_bytes"] > 0
    assert all(loss > 0 for loss in (finetune["first_step_loss"], finetune["last_step_loss"]))

    asr = result["asr"]
    assert asr["ok"], asr
    assert asr["val_wer"] >= 0 and asr["val_cer"] >= 0
    assert asr["mfu"] > 0 and asr["samples_per_s"] > 0
    assert asr["audio_s_per_s"] == asr["samples_per_s"] * asr["data"]["mean_utterance_s"]
    assert 0 <= asr["padding_frac"] < 1
    assert asr["compiled"] is False


def test_missing_recordings_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    missing = tmp_path / "no-recordings"
    result = dry_run(tmp_path / "workloads.json", "--stages", "asr", "--recordings",
                     str(missing))
    assert result["stages"] == ["asr"] and "finetune" not in result
    assert result["asr"] == {"ok": False, "error": f"no FSDD recordings at {missing}: the "
                                                   "connected-digit set cannot be built"}
