"""The `gpuflow train` flag reference in docs/cli.md, generated from the TrainConfig fields.

    python -m gpuflow.flagdoc                     # print the tables
    python -m gpuflow.flagdoc --update docs/cli.md  # rewrite them between the markers

The tables sit between ``<!-- flags:begin -->`` and ``<!-- flags:end -->``; the prose
around them is written by hand. tests/test_cli_flags.py fails when they differ from
what the fields give. (Its own module, not ``python -m gpuflow.config``, because
``gpuflow.config`` is imported before ``-m`` would run it as a script.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

BEGIN = "<!-- flags:begin -->"
END = "<!-- flags:end -->"
COMMAND = "python -m gpuflow.flagdoc --update docs/cli.md"


def reference() -> str:
    """The Markdown tables of every `gpuflow train` flag."""
    from gpuflow.cli import add_train_flags
    from gpuflow.config import TrainConfig
    from gpuflow.options import markdown_table

    parser = argparse.ArgumentParser(prog="gpuflow train", argument_default=argparse.SUPPRESS)
    add_train_flags(parser)
    return markdown_table(parser, TrainConfig)


def between_markers(text: str) -> str:
    """What ``text`` holds between the markers (without the newlines next to them)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def updated(text: str) -> str:
    """``text`` with the block between the markers replaced by :func:`reference`."""
    between_markers(text)
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{reference()}{END}{rest.split(END, 1)[1]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuflow.flagdoc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", metavar="FILE", type=Path,
                        help="rewrite the tables between the markers of FILE")
    args = parser.parse_args(argv)
    if args.update is None:
        sys.stdout.write(reference())
        return 0
    text = args.update.read_text()
    new = updated(text)
    if new != text:
        args.update.write_text(new)
        print(f"updated {args.update}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
