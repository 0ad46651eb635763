"""tools/module_sizes.py: `make lint` fails on a module over 400 lines or a function over 80,
and the project's own source passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tool_scripts import TOOLS, load_tool


@pytest.fixture(scope="module")
def sizes():
    return load_tool("module_sizes")


def test_a_long_module_and_a_long_function_are_named(sizes, tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text("x = 1\n" * 401)
    body = "".join(f"    y{i} = {i}\n" for i in range(80))  # 81 lines with the def
    (tmp_path / "fn.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    (tmp_path / "ok.py").write_text("x = 1\n" * 400)
    found = sizes.breaches(tmp_path)
    assert found == [f"{tmp_path / 'fn.py'}:1: long is 81 lines (at most 80)",
                     f"{tmp_path / 'long.py'}: 401 lines (at most 400)"]


def test_the_source_tree_passes() -> None:
    done = subprocess.run([sys.executable, str(TOOLS / "module_sizes.py"),
                           str(TOOLS.parent / "src")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
