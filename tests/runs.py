"""Readers of a run dir's files (docs/run-dir.md), for tests that check what a run wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gpuflow.config import TrainConfig


def records(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole line of metrics.jsonl: step windows and events. A run still writing may
    have its last line half written; that line is left for the next read."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The per-window training records of metrics.jsonl (not its events)."""
    return [r for r in records(run_dir) if "event" not in r]


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The events of one kind (``eval``, ...) in metrics.jsonl, in order."""
    return [r for r in records(run_dir) if r.get("event") == kind]


def losses(run_dir: Path) -> list[float]:
    """The training loss of each logged window."""
    return [r["loss"] for r in step_records(run_dir)]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def newest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights of the run's newest checkpoint."""
    from safetensors.torch import load_file

    from gpuflow import checkpoint as ckpt

    return load_file(ckpt.list_checkpoints(run_dir / "checkpoints")[0].path / ckpt.MODEL_FILE)


def configs(**defaults: Any) -> Callable[..., TrainConfig]:
    """A test module's ``config(run_dir, **overrides)``: a TrainConfig without a progress
    bar, writing into ``run_dir``, from the module's ``defaults`` and then the overrides."""
    from gpuflow.config import TrainConfig

    def config(run_dir: Path, **overrides: Any) -> TrainConfig:
        return TrainConfig(**{"progress": False, **defaults, "run_dir": str(run_dir),
                              **overrides})

    return config
