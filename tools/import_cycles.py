"""Fail when modules inside one package import each other in a circle.

import-linter's contracts keep packages apart (layers, forbidden imports), but a circle
between two modules of the same package passes them all. This check reads every module's
imports at module level, including those under a module-level ``if`` (``if TYPE_CHECKING:``
too: a module that names, even for typing, one that imports it is in a circle) or ``try``,
but not those inside a function (a deferred import is how a module keeps a heavy or
optional dependency off its import path). ``from pkg import mod`` names ``pkg.mod``, not
``pkg``'s ``__init__``. Within each package, a child module or subpackage stands for
everything under it; a circle is a strongly connected group of two or more children.

Usage: ``python tools/import_cycles.py [SRC_ROOT]`` (default ``src``); exit 1 on a circle.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# Circles known and owned elsewhere, each named by the issue that removes it. An entry is a
# sorted tuple of the children in the circle; an entry that no longer matches a circle is an
# error too, so the list only shrinks.
ALLOWED: dict[tuple[str, ...], str] = {}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements at module level, into ``if``/``try`` blocks (``if TYPE_CHECKING:`` too)
    and class bodies, but not into functions or methods."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            found += _module_level_statements(node.body)
            found += _module_level_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(handler.body for handler in node.handlers)):
                found += _module_level_statements(block)
        elif isinstance(node, ast.ClassDef):
            found += _module_level_statements(node.body)
    return found


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The project's modules that ``name`` (read from ``path``) names at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _module_level_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = {f"{base}.{alias.name}" for alias in node.names}
            targets.update(names)
            if not names <= known:  # a name defined in base itself, not only its modules
                targets.add(base)
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            resolved.add(target)
    return resolved - {name}


def child_of(package: str, module: str) -> str | None:
    """The child of ``package`` that holds ``module`` (the package itself stands for its
    ``__init__``); None outside it."""
    if module == package:
        return package
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1:].split(".")[0]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's groups of nodes that all reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def find_circles(root: Path) -> list[tuple[str, ...]]:
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    known = set(paths)
    imports = {name: imported_modules(path, name, known) for name, path in paths.items()}
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    circles = []
    for package in sorted(packages):
        edges: dict[str, set[str]] = defaultdict(set)
        for importer, targets in imports.items():
            source = child_of(package, importer)
            if source is None:
                continue
            for target in targets:
                child = child_of(package, target)
                if child is not None and child != source:
                    edges[source].add(child)
        circles += [tuple(group) for group in strongly_connected(edges) if len(group) > 1]
    return circles


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path("src")
    circles = find_circles(root)
    failed = False
    for circle in circles:
        if circle in ALLOWED:
            print(f"allowed for now ({ALLOWED[circle]}): {' <-> '.join(circle)}")
            continue
        failed = True
        print(f"import circle: {' <-> '.join(circle)}")
    for stale in sorted(set(ALLOWED) - set(circles)):
        failed = True
        print(f"no longer a circle, remove it from ALLOWED: {' <-> '.join(stale)}")
    if not failed:
        print(f"no import circle inside a package under {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
