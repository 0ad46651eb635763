"""tools/import_cycles.py: `make lint` fails on a circle between modules of one package."""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_scripts import TOOLS, load_tool


@pytest.fixture(scope="module")
def cycles():
    return load_tool("import_cycles")


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_between_two_modules_is_found(cycles, tmp_path: Path) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n",
                            "pkg/b.py": "from . import a\n"})
    assert cycles.find_circles(root) == [("pkg.a", "pkg.b")]
    assert cycles.main([str(root)]) == 1


def test_a_circle_through_a_subpackage_counts_at_the_level_they_share(cycles, tmp_path: Path
                                                                      ) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "",
                            "pkg/sub/deep.py": "import pkg.top\n",
                            "pkg/top.py": "from pkg.sub.deep import x\n"})
    assert cycles.find_circles(root) == [("pkg.sub", "pkg.top")]


def test_deferred_and_type_only_imports_are_no_circle(cycles, tmp_path: Path) -> None:
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg import a\n\ndef f():\n    from pkg import a\n"),
    })
    assert cycles.find_circles(root) == []
    assert cycles.main([str(root)]) == 0


def test_an_allowed_circle_that_is_gone_fails_the_check(cycles, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "", "pkg/b.py": ""})
    monkeypatch.setattr(cycles, "ALLOWED", {("pkg.a", "pkg.b"): "issue 1"})
    assert cycles.main([str(root)]) == 1


def test_the_package_has_no_circle(cycles) -> None:
    assert cycles.main([str(TOOLS.parent / "src")]) == 0
