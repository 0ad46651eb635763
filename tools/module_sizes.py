"""Fail when a source module grows past 400 lines or a function past 80.

Small modules with one job and functions that fit on a screen are the house rule
(docs/architecture.md); this check keeps them so as the code grows, in ``make lint``.

Usage: ``python tools/module_sizes.py [SRC_ROOT]`` (default ``src``); exit 1 on a breach.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def breaches(root: Path) -> list[str]:
    """Every module over ``MAX_MODULE_LINES`` and function over ``MAX_FUNCTION_LINES``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            found.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: {node.name} is {length} lines "
                                 f"(at most {MAX_FUNCTION_LINES})")
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "src")
    found = breaches(root)
    for line in found:
        print(line)
    if found:
        print("split the module or function by job (docs/architecture.md)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
