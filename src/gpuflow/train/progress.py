"""What a person watching the terminal sees: a live bar on a TTY, plain lines elsewhere.

rich is imported on first output, so a Trainer driven from Python with progress off (a
benchmark, a notebook loop) never loads it.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

PLAIN_LINES = 20


def _fmt_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


class ProgressDisplay:
    """Shows step, loss, samples/s, MFU and ETA while training runs."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True,
                 console: Console | None = None) -> None:
        self._console = console
        self.total = total_steps
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self._last_plain = start_step
        self._started = time.perf_counter()
        self._start_step = start_step
        self._progress: Progress | None = None
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TextColumn("MFU {task.fields[mfu]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, loss="-", rate="-",
                                                 mfu="-")
            self._progress.start()

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return self._console

    def update(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        loss, rate, mfu = record["loss"], record["samples_per_s"], record.get("mfu")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}",
                                  rate=f"{rate:,.0f}", mfu=_fmt_mfu(mfu))
            return
        if step - self._last_plain >= max(1, self.total // PLAIN_LINES) or step == self.total:
            self._last_plain = step
            done = step - self._start_step
            elapsed = time.perf_counter() - self._started
            eta = elapsed / done * (self.total - step) if done else 0.0
            self.console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  {rate:,.0f} samples/s  "
                f"MFU {_fmt_mfu(mfu)}  ETA {eta:.0f}s", highlight=False,
            )

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def announce(self, text: str) -> None:
        """Printed even without live progress: what the run is about to do."""
        self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table: quality, speed, utilisation and where the time went."""
    from rich.table import Table

    table = Table(title=f"gpuflow run: {summary['workload']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", overflow="fold")
    med = summary["median"]
    rows: list[tuple[str, str]] = [
        ("steps", f"{summary['steps']} ({summary['samples_seen']:,} samples)"),
        ("device", f"{summary['device_name']} ({summary['device']})"),
        ("parallelism", f"{summary['strategy']}, {summary['world_size']} process(es), "
                        f"global batch {summary['global_batch']}"),
        ("precision", summary["precision_description"]),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
    ]
    for key, value in summary["final_metrics"].items():
        rows.append((key, f"{value:.4f}" if isinstance(value, float) else str(value)))
    rows += [
        ("samples/s (median)", f"{med['samples_per_s']:,.1f}"),
        ("step time (median)", f"{1e3 * med['step_time_s']:.2f} ms"),
        ("  data wait", f"{1e3 * med['data_wait_s']:.2f} ms ({100 * med['data_wait_frac']:.1f}%)"),
        ("  compute (fwd+bwd)", f"{1e3 * med['compute_s']:.2f} ms"),
        ("  exposed comm", "not measured" if med["comm_s"] is None
         else f"{1e3 * med['comm_s']:.2f} ms ({100 * med['comm_frac']:.1f}%)"),
        ("  optimizer", f"{1e3 * med['optimizer_s']:.2f} ms"),
        ("  host/other", f"{1e3 * med['host_s']:.2f} ms"),
        ("FLOPs per step", f"{summary['flops_per_step']:.3e}"),
        ("achieved (median)", f"{med['achieved_flops'] / 1e12:.4f} TFLOP/s"),
        ("MFU (median)", _fmt_mfu(med["mfu"])),
        ("peak FLOP/s", "unknown" if summary["peak_flops"] is None
         else f"{summary['peak_flops'] / 1e12:.3f} TFLOP/s per device"),
        ("peak source", summary["peak_flops_source"]),
        ("peak memory", f"{summary['peak_mem_bytes'] / 2**20:,.1f} MiB "
                        f"({summary['peak_mem_kind']})"),
        ("skipped steps", str(summary["skipped_steps"])),
        *_planner_rows(summary),
        ("run dir", summary["run_dir"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _planner_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The planner's predictions beside the measurements, for --strategy auto runs."""
    from gpuflow.report.runs import planner_predictions

    return [(f"planner: {figure.name}",
             f"{figure.predicted:,.1f} {figure.unit} predicted, {figure.measured:,.1f} "
             f"measured ({100 * figure.error:+.0f}%)")
            for figure in planner_predictions(summary)]


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """The summary table, then the top bottleneck and what to try (`gpuflow report` has all)."""
    from rich.console import Console

    from gpuflow.report.diagnose import diagnose, headline

    console = console or Console(file=sys.stdout)
    console.print(summary_table(summary))
    for line in headline(diagnose(summary), summary["median"]):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"full report: gpuflow report {summary['run_dir']}", markup=False,
                  highlight=False)
