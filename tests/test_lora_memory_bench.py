"""benchmarks/lora_memory.py as the `lora-memory` GPU stage runs it, walked on the CPU at a
tiny size (``--dry-run``): the full fine-tune, LoRA and QLoRA each train in a process of their
own and the file holds their peaks and speeds, marked as no GPU's measurement.

Whether the targets are met is the full run's verdict, not a unit test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_stages  # noqa: E402


def test_the_gpu_stage_dry_runs_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "lora_memory.json"
    [stage] = [stage for stage in gpu_stages.STAGES if stage.name == "lora-memory"]
    command = stage.command("nvidia-h100", 420)
    assert command[command.index("--device") + 1] == "cuda"
    assert command[command.index("--dim") + 1] == "2048"  # the ~1B config
    done = subprocess.run([sys.executable, *command, "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]

    result = json.loads(out.read_text())
    assert result["dry_run"] is True and not stage.holds(result)
    assert {"created", "command", "git", "versions", "machine"} <= result.keys()
    assert result["model"]["dim"] == 128  # the dry run's size, not the GPU's
    [found] = result["rounds"]
    for name in ("full", "lora", "qlora"):
        assert found[name]["peak_mem_bytes"] > 0 and found[name]["tokens_per_s"] > 0
    assert found["lora"]["trainable_params"] < found["full"]["trainable_params"] / 10
    assert "QLoRA" in stage.headline(result)
