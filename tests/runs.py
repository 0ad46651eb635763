"""Readers of a run dir's files (docs/run-dir.md), for tests that check what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def records(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of metrics.jsonl: step windows and events."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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
