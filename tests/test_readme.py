"""The README's own-model example works exactly as printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import ROOT, cli_env, run_cli


def test_readme_workload_example_trains_from_the_cli(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = next(block for block in blocks if "def build()" in block)
    (tmp_path / "my_workload.py").write_text(example)
    run_dir = tmp_path / "run"
    result = run_cli("train", "--workload", "my_workload:build", "--max-steps", "60",
                     "--run-dir", str(run_dir), env=cli_env(PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "val_accuracy" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workload"] == "my-classifier"
    assert summary["final_metrics"]["val_accuracy"] > 0.9
