"""A run dir read back into memory: the one place that knows its file layout (docs/run-dir.md).

A run that is still going (or crashed) has no ``summary.json`` yet; it is still worth a
report, so the summary is optional and the per-step medians are computed from the records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflow.errors import UserError
from gpuflow.telemetry.steps import PER_STEP_FIELDS, medians


@dataclass(frozen=True)
class Run:
    """One run dir's metrics, summary and configuration."""

    path: Path
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    summary: dict[str, Any] | None
    config: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    def measured(self, key: str) -> bool:
        """Whether any training record holds a value for ``key`` (null means not measured)."""
        return any(record.get(key) is not None for record in self.steps)

    @property
    def median(self) -> dict[str, float | None]:
        """Median of each per-step figure; the summary's when present, else from the records."""
        if self.summary is not None and self.summary.get("median"):
            return {key: self.summary["median"].get(key) for key in PER_STEP_FIELDS}
        return medians(self.steps)

    @property
    def facts(self) -> dict[str, Any]:
        """The summary's fields, filled in from the records when the run has not finished."""
        last = self.steps[-1]
        partial = {"peak_mem_bytes": last.get("peak_mem_bytes"), "steps": last["step"],
                   "world_size": last.get("world_size", 1)}
        return {**partial, **(self.summary or {}), "median": self.median, "config": self.config}


# The figures --strategy auto predicts, with their display name, scale and unit.
PREDICTED_FIGURES = {"step_time_s": ("step time", 1e3, "ms"),
                     "peak_mem_bytes": ("peak memory", 2**-20, "MiB")}


@dataclass(frozen=True)
class Prediction:
    """The planner's prediction of one figure beside the run's measurement, in display
    units."""

    name: str
    unit: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def planner_predictions(facts: dict[str, Any]) -> list[Prediction]:
    """What a --strategy auto run predicted and also measured (summary.json's ``plan``)."""
    pairs = (facts.get("plan") or {}).get("predicted_vs_measured") or {}
    found = []
    for key, (name, scale, unit) in PREDICTED_FIGURES.items():
        predicted, measured = pairs.get(key, (None, None))
        if predicted and measured:
            found.append(Prediction(name, unit, predicted * scale, measured * scale))
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}).") from None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # The last line of a run killed mid-write may be cut short; anything else is damage.
            if number == len(lines):
                break
            raise UserError(f"{path}, line {number}: not valid JSON.") from None
    return records


def load_run(path: str | Path) -> Run:
    """Read a run dir; a folder without ``metrics.jsonl`` is not one (UserError)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; expected a gpuflow run dir.")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path} is not a gpuflow run dir (no metrics.jsonl).")
    records = _read_metrics(metrics)
    steps = [r for r in records if "event" not in r]
    if not steps:
        raise UserError(f"{path}: metrics.jsonl holds no training records yet.")
    summary_path = path / "summary.json"
    summary = _read_json(summary_path) if summary_path.is_file() else None
    config_path = path / "config.json"
    if summary is not None:
        config = summary.get("config", {})
    elif config_path.is_file():
        config = _read_json(config_path)
    else:
        config = {}
    return Run(path=path, steps=steps, evals=[r for r in records if r.get("event") == "eval"],
               summary=summary, config=config)
