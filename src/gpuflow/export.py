"""Consolidate a run's newest valid checkpoint into one safetensors file for serving."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from gpuflow import checkpoint as ckpt
from gpuflow.errors import UserError

EXPORT_FORMAT_VERSION = "1"


def export_model(run_dir: Path, out: Path) -> tuple[Path, int]:
    """Write the newest verified checkpoint's full weights to ``out``; return (path, step).

    The file carries the run's configuration in its metadata, so a server can rebuild the
    workload's model without the run dir. Checkpoints are saved unsharded whatever the
    strategy, so the export is the same for one process, DDP or FSDP.
    """
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{run_dir} is not a gpuflow run dir (no config.json).")
    found = ckpt.load_latest(run_dir / "checkpoints")
    if found is None:
        raise UserError(f"{run_dir} has no valid checkpoint to export; train it first.")
    checkpoint, model_state, _ = found
    config = json.loads(config_path.read_text())
    metadata = {
        "gpuflow_export_format": EXPORT_FORMAT_VERSION,
        "workload": str(config.get("workload")),
        "step": str(checkpoint.step),
        "config": json.dumps(config),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    save_file(model_state, str(tmp), metadata=metadata)
    tmp.replace(out)
    return out, checkpoint.step
