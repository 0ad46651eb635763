"""The figures the docs quote from results files, against those files: a rerun that moves a
figure, or an edit that misquotes one, fails here (docs/benchmarks.md and the GPU table of
docs/performance.md are rendered from the files instead). The rows: ``doc_figures`` (what a
row holds; performance.md, planner.md, data.md, the images, finetune, asr and speech
workload pages) and ``doc_figures_serving`` (serving.md's GPU runs, the hub Llama against
transformers serve, its eager and compiled textlm runs against llama.cpp, decode warm-up,
operators a step, steps in flight, attention traffic, speculative decoding, its KV paging,
quantization and batching tables; the rest of serving.md is not listed yet).
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from typing import Any

import doc_figures
import doc_figures_serving
import pytest
from conftest import ROOT
from doc_figures import JsonPath

RESULTS = ROOT / "benchmarks" / "results"
FIGURES = [*doc_figures.FIGURES, *doc_figures_serving.FIGURES]


@cache
def results(name: str) -> Any:
    """A results file, or (``name@commit``) the version of it at that commit."""
    if "@" not in name:
        return json.loads((RESULTS / name).read_text())
    name, commit = name.split("@")
    shown = subprocess.run(["git", "show", f"{commit}:benchmarks/results/{name}"], cwd=ROOT,
                           capture_output=True, text=True)
    if shown.returncode != 0:  # a shallow clone, or a copy without .git
        pytest.skip(f"{name} as of {commit} is not in this checkout's history")
    return json.loads(shown.stdout)


def lookup(result: Any, path: JsonPath) -> float | str:
    if callable(path):
        return path(result)
    path, _, scale = path.partition("*")
    path, _, per = path.partition("/")
    path, *reducers = path.split("|")
    value = result
    for part in path.split("."):
        key, _, select = part.partition("[")
        if key:
            value = value[int(key)] if isinstance(value, list) else value[key]
        if ":" in select:
            start, end = (int(bound) if bound else None
                          for bound in select.rstrip("]").split(":"))
            value = value[start:end]
        elif select:
            field, want = select.rstrip("]").split("=")
            value = next(item for item in value if str(item.get(field)) == want)
    for reducer in reducers:
        value = {"min": min, "max": max, "abs": abs}[reducer](
            value.values() if isinstance(value, dict) else value)
    if isinstance(value, str):
        return value
    value *= float(scale or 1)
    return value / {"": 1, "MiB": 2**20, "GiB": 2**30}[per]


def _format(value: float | str, spec: str) -> str:
    """``format`` with one spec of the docs' own: ``~``, two decimals under 10, one under 100
    (how the latency tables write milliseconds)."""
    if spec != "~":
        return format(value, spec)
    number = float(value)
    return f"{number:.{2 if abs(number) < 10 else 1 if abs(number) < 100 else 0}f}"


@cache
def page(doc: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / doc).read_text())


@pytest.mark.parametrize(("doc", "text", "file", "values"), FIGURES,
                         ids=[f"{doc}: {text[:40]}" for doc, text, _, _ in FIGURES])
def test_the_docs_quote_their_results_files(doc: str, text: str, file: str,
                                            values: list[tuple[JsonPath, str]]) -> None:
    figures = [_format(lookup(results(file), path), spec) for path, spec in values]
    quoted = text.format(*figures)
    assert quoted in page(doc), f"{doc} should say: {quoted}"
