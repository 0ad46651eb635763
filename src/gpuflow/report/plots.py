"""The report's figures, drawn with matplotlib and returned as inline SVG text.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot), so drawing never
touches a GUI backend or global state. A value that was not measured (null) is left out of
its line, never drawn as zero.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import matplotlib
from matplotlib.figure import Figure

from gpuflow.report.runs import Run

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
BREAKDOWN = (("data_wait_s", "data wait", "#ff7f0e"), ("compute_s", "compute", "#1f77b4"),
             ("comm_s", "communication", "#d62728"), ("optimizer_s", "optimizer", "#2ca02c"),
             ("host_s", "host/other", "#7f7f7f"))


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _series(run: Run, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key] * scale) for r in run.steps
              if r.get(key) is not None and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def line_plot(runs: Sequence[Run], key: str, ylabel: str, scale: float = 1.0,
              evals: str | None = None) -> str | None:
    """One line per run over steps; None when no run measured ``key``."""
    figure = Figure(figsize=(7.5, 3.2))
    axes = figure.subplots()
    drawn = False
    for run, color in zip(runs, COLORS, strict=False):
        steps, values = _series(run, key, scale)
        if steps:
            axes.plot(steps, values, color=color, label=run.name, linewidth=1.5)
            drawn = True
        if evals:
            points = [(r["step"], r[evals]) for r in run.evals if r.get(evals) is not None]
            if points:
                axes.plot(*zip(*points, strict=True), "o--", color=color, markersize=4,
                          linewidth=1, label=f"{run.name} ({evals})")
    if not drawn:
        return None
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _svg(figure)


def breakdown_plot(runs: Sequence[Run]) -> str:
    """Stacked per-step time by region, one panel per run on a shared time axis."""
    figure = Figure(figsize=(7.5 if len(runs) == 1 else 11, 3.4))
    panels = figure.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for axes, run in zip(panels, runs, strict=True):
        steps = [r["step"] for r in run.steps]
        layers: list[list[float]] = []
        labels: list[str] = []
        colors: list[str] = []
        for key, label, color in BREAKDOWN:
            values = [r.get(key) for r in run.steps]
            if all(v is None for v in values):
                label += " (not measured)"
            layers.append([1e3 * (v or 0.0) for v in values])
            labels.append(label)
            colors.append(color)
        axes.stackplot(steps, layers, labels=labels, colors=colors, alpha=0.85)
        axes.set_title(run.name, fontsize=9)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    panels[0].set_ylabel("time per step (ms)")
    panels[-1].legend(fontsize=7, loc="upper right")
    return _svg(figure)


def throughput_key(runs: Sequence[Run]) -> tuple[str, str]:
    """Tokens/s when every run counts tokens, else samples/s."""
    if all(any(r.get("tokens_per_s") is not None for r in run.steps) for run in runs):
        return "tokens_per_s", "tokens/s"
    return "samples_per_s", "samples/s"


def figures(runs: Sequence[Run]) -> list[tuple[str, str | None, str]]:
    """(title, svg or None, caption) for every plot of the report."""
    key, unit = throughput_key(runs)
    loss_evals = "val_loss" if any(r.evals for r in runs) else None
    kinds = {str(run.facts.get("peak_mem_kind", "unknown kind")) for run in runs}
    unknown_mfu = [run.name for run in runs if not run.measured("mfu")]
    mfu_caption = "model FLOPs / step time / peak FLOP/s of the device(s)"
    if unknown_mfu:
        mfu_caption += (f"; unknown (no peak FLOP/s for the device) in: "
                        f"{', '.join(unknown_mfu)}")
    return [
        ("Loss", line_plot(runs, "loss", "loss", evals=loss_evals),
         "training loss, mean over each logging window; dots: validation loss"),
        ("Throughput", line_plot(runs, key, unit), f"{unit}, whole job"),
        ("MFU", line_plot(runs, "mfu", "MFU (%)", scale=100.0), mfu_caption),
        ("Memory", line_plot(runs, "peak_mem_bytes", "peak memory (MiB)", scale=2**-20),
         f"peak so far ({', '.join(sorted(kinds))})"),
        ("Step-time breakdown", breakdown_plot(runs),
         "per-step mean of each region over the logging window, stacked"),
    ]

