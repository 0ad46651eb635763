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


def test_a_type_only_import_closes_a_circle_and_a_deferred_one_does_not(cycles, tmp_path: Path
                                                                         ) -> None:
    typed = write(tmp_path / "typed", {
        "pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"})
    assert cycles.find_circles(typed) == [("pkg.a", "pkg.b")]
    deferred = write(tmp_path / "deferred", {
        "pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg import a\n"})
    assert cycles.find_circles(deferred) == []
    assert cycles.main([str(deferred)]) == 0


def test_from_a_package_import_a_module_names_that_module_alone(cycles, tmp_path: Path) -> None:
    """A package's __init__ naming its public modules for typing is no circle with a module
    that imports a sibling through the package's name."""
    root = write(tmp_path, {
        "pkg/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from pkg.a import A\n",
        "pkg/a.py": "from pkg import b\nA = 1\n", "pkg/b.py": ""})
    assert cycles.find_circles(root) == []
    (root / "pkg" / "b.py").write_text("from pkg import A\n")  # a name of __init__'s own
    assert cycles.find_circles(root) == [("pkg", "pkg.a", "pkg.b")]


def test_an_allowed_circle_that_is_gone_fails_the_check(cycles, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "", "pkg/b.py": ""})
    monkeypatch.setattr(cycles, "ALLOWED", {("pkg.a", "pkg.b"): "issue 1"})
    assert cycles.main([str(root)]) == 1


def test_the_package_has_no_circle(cycles) -> None:
    assert cycles.main([str(TOOLS.parent / "src")]) == 0
