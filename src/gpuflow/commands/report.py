"""`gpuflow report RUN_DIR [RUN_B]`: the HTML report of a run, or of two compared."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuflow.errors import UserError


def register(commands: Any) -> None:
    """Add the `report` subcommand to the CLI's subparsers."""
    parser = commands.add_parser(
        "report", help="HTML report of a run (plots, breakdown, bottleneck diagnosis)",
        description="Write one self-contained HTML file: plots over steps, the step-time "
                    "breakdown, the bottleneck diagnosis, configuration, hardware and "
                    "versions. With a second run dir, both runs share the plots and a table.")
    parser.add_argument("run_dir", help="a gpuflow run dir")
    parser.add_argument("run_b", nargs="?", help="a second run dir to compare with the first")
    parser.add_argument("--out", help="output file (default: RUN_DIR/report.html, or "
                                      "RUN_DIR/report-vs-<RUN_B>.html when comparing)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gpuflow.report.diagnose import diagnose, headline
    from gpuflow.report.html import render_report
    from gpuflow.report.runs import load_run

    runs = [load_run(path) for path in (args.run_dir, args.run_b) if path is not None]
    if args.out is not None:
        out = Path(args.out)
    elif len(runs) == 2:
        out = runs[0].path / f"report-vs-{runs[1].name}.html"
    else:
        out = runs[0].path / "report.html"
    if not out.parent.is_dir():
        raise UserError(f"--out: folder {out.parent} does not exist.")
    out.write_text(render_report(runs), encoding="utf-8")
    for loaded in runs:
        facts = loaded.facts
        print(f"{loaded.name}:")
        for line in headline(diagnose(facts), facts["median"]):
            print(f"  {line}")
    print(f"report written to {out}")
    return 0
