"""One self-contained HTML page for one run, or two side by side.

Everything the page shows is inside the file: SVG plots inline, CSS in a ``<style>`` tag, no
scripts, no fonts or images fetched, so it opens anywhere, offline, and can be mailed around.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from gpuflow.report.diagnose import Diagnosis, diagnose
from gpuflow.report.plots import figures
from gpuflow.report.runs import Run, planner_predictions

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.differs td { background: #fff6d6; }
figure { margin: 1em 0 2em; } figcaption { font-size: .85em; color: #555; }
svg { max-width: 100%; height: auto; }
.finding { border-left: 4px solid #d62728; padding: .3em .8em; margin: .6em 0; }
.finding.top { background: #fdeeee; }
.none { border-left: 4px solid #2ca02c; padding: .3em .8em; }
.note { color: #555; font-size: .9em; }
"""

Getter = Callable[[dict[str, Any]], Any]


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return escape(str(value))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]],
           mark_differences: bool = False) -> str:
    """Rows of pre-escaped cells; with ``mark_differences``, rows whose values differ stand
    out (the first cell is the label)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        differs = mark_differences and len(set(row[1:])) > 1
        cells = "".join(f"<td>{row[0]}</td>" if i == 0 else f'<td class="num">{cell}</td>'
                        for i, cell in enumerate(row))
        body.append(f'<tr class="differs">{cells}</tr>' if differs else f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _median(key: str, scale: float = 1.0) -> Getter:
    """A summary row's value: the median of ``key``, in the row's unit."""
    return lambda facts: None if facts["median"].get(key) is None \
        else scale * facts["median"][key]


def _mib(facts: dict[str, Any]) -> float | None:
    peak = facts.get("peak_mem_bytes")
    return None if peak is None else peak / 2**20


SUMMARY_ROWS: tuple[tuple[str, Getter], ...] = (
    ("steps", lambda f: f.get("steps")),
    ("wall time (s)", lambda f: f.get("wall_time_s")),
    ("global batch (samples)", lambda f: f.get("global_batch")),
    ("step time, median (ms)", _median("step_time_s", 1e3)),
    ("  data wait (ms)", _median("data_wait_s", 1e3)),
    ("  compute, fwd+bwd (ms)", _median("compute_s", 1e3)),
    ("  exposed communication (ms)", _median("comm_s", 1e3)),
    ("  optimizer (ms)", _median("optimizer_s", 1e3)),
    ("  host/other (ms)", _median("host_s", 1e3)),
    ("samples/s, median", _median("samples_per_s")),
    ("tokens/s, median", _median("tokens_per_s")),
    ("achieved TFLOP/s, median", _median("achieved_flops", 1e-12)),
    ("MFU, median (%)", _median("mfu", 100.0)),
    ("peak memory (MiB)", _mib),
)


def _summary_table(runs: Sequence[Run]) -> str:
    facts = [run.facts for run in runs]
    metric_names = sorted({key for f in facts for key in f.get("final_metrics", {})})
    rows_spec = list(SUMMARY_ROWS) + [
        (f"final {name}", lambda f, name=name: f.get("final_metrics", {}).get(name))
        for name in metric_names
    ]
    header = ["", *(run.name for run in runs)]
    if len(runs) == 2:
        header.append(f"{runs[1].name} / {runs[0].name}")
    rows = []
    for label, get in rows_spec:
        values = [get(f) for f in facts]
        indent = len(label) - len(label.lstrip())
        row = ["&emsp;" * indent + escape(label.lstrip()), *(_num(v) for v in values)]
        if len(runs) == 2:
            a, b = values
            row.append(f"{b / a:.3f}" if isinstance(a, int | float) and isinstance(
                b, int | float) and a else "-")
        rows.append(row)
    return _table(header, rows)


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _key_table(runs: Sequence[Run], pick: Callable[[Run], dict[str, Any]]) -> str:
    """A key/value table per run, side by side; differing rows are marked."""
    flat = [_flatten(pick(run)) for run in runs]
    keys = list(dict.fromkeys(key for values in flat for key in values))
    rows = [[escape(key), *(_num(values.get(key)) for values in flat)] for key in keys]
    return _table(["", *(run.name for run in runs)], rows, mark_differences=len(runs) > 1)


def _hardware(run: Run) -> dict[str, Any]:
    facts = run.facts
    peak = facts.get("peak_flops")
    return {
        "device": facts.get("device"),
        "device name": facts.get("device_name"),
        "strategy": facts.get("strategy"),
        "processes": facts.get("world_size"),
        "precision": facts.get("precision_description", facts.get("precision")),
        "compiled": facts.get("compiled"),
        "compile scope": facts.get("compile_scope"),
        "peak FLOP/s per device (TFLOP/s)": None if peak is None else peak / 1e12,
        "peak FLOP/s source": facts.get("peak_flops_source", "unknown (run not finished)"),
        "peak memory (MiB)": _mib(facts),
        "peak memory measures": facts.get("peak_mem_kind"),
    }


def _plan(run: Run) -> dict[str, Any]:
    """What --strategy auto and --batch-size auto chose, and the planner's predictions
    beside what the run measured."""
    plan = run.facts.get("plan") or {}
    chosen, probe = plan.get("strategy_auto"), plan.get("batch_size_auto")
    values: dict[str, Any] = {}
    if chosen:
        values["strategy auto chose"] = (
            f"{chosen['strategy']} dp {chosen['dp']} x tp {chosen['tp']} x pp {chosen['pp']}, "
            f"micro-batch {chosen['micro_batch']} x {chosen['grad_accum']}, checkpointing "
            f"{'on' if chosen['activation_checkpointing'] else 'off'}")
    for figure in planner_predictions(run.facts):
        label = f"{figure.name} ({figure.unit})"
        values[f"{label}, predicted"] = figure.predicted
        values[f"{label}, measured"] = figure.measured
        values[f"{label}, prediction error (%)"] = 100 * figure.error
    if probe:
        values["batch-size auto: largest fitting micro-batch"] = probe["largest_fitting"]
        values["batch-size auto: ran"] = f"{probe['micro_batch']} x {probe['grad_accum']}"
    return values


def _diagnosis_html(run: Run, diagnosis: Diagnosis) -> str:
    parts = [f"<h3>{escape(run.name)}</h3>"]
    if diagnosis.top is None:
        parts.append('<div class="none">No bottleneck above the thresholds.</div>')
    for index, finding in enumerate(diagnosis.findings):
        tried = "".join(f"<li>{escape(s)}</li>" for s in finding.suggestions)
        parts.append(
            f'<div class="finding{" top" if index == 0 else ""}">'
            f"<strong>{escape(finding.bottleneck)}</strong>: {escape(finding.evidence)}"
            f"<br>Try:<ul>{tried}</ul></div>")
    parts += [f'<p class="note">{escape(note)}</p>' for note in diagnosis.notes]
    return "".join(parts)


def _figure_html(title: str, svg: str | None, caption: str) -> str:
    body = svg if svg is not None else "<p>Not measured in these runs.</p>"
    return (f"<figure><h3>{escape(title)}</h3>{body}"
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def render_report(runs: Sequence[Run]) -> str:
    """The whole page for one run, or a comparison of two on the same plots."""
    title = " vs ".join(run.name for run in runs)
    unfinished = [run.name for run in runs if run.summary is None]
    status = "" if not unfinished else (
        f'<p class="note">Not finished (no summary.json): {escape(", ".join(unfinished))}; '
        "figures come from the metrics logged so far.</p>")
    sections = [
        f"<h1>gpuflow report: {escape(title)}</h1>",
        f'<p class="note">Generated {dt.datetime.now().isoformat(timespec="seconds")} '
        f"from {escape(', '.join(str(run.path) for run in runs))}.</p>",
        status,
        '<h2 id="diagnosis">Bottleneck diagnosis</h2>',
        *(_diagnosis_html(run, diagnose(run.facts)) for run in runs),
        '<h2 id="summary">Summary</h2>',
        _summary_table(runs),
        '<h2 id="plots">Over the run</h2>',
        *(_figure_html(*figure) for figure in figures(runs)),
        *(['<h2 id="plan">Planner: predicted and measured</h2>', _key_table(runs, _plan)]
          if any(_plan(run) for run in runs) else []),
        '<h2 id="config">Configuration</h2>',
        _key_table(runs, lambda run: run.config),
        '<h2 id="hardware">Hardware and peak FLOP/s</h2>',
        _key_table(runs, _hardware),
        '<h2 id="versions">Versions</h2>',
        _key_table(runs, lambda run: run.facts.get("versions", {})),
    ]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<link rel="icon" href="data:,"><title>gpuflow report: {escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")
