"""Shared fixtures: an isolated peak-probe cache and helpers to run the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["GPUFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("gpuflow-cache"))


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `gpuflow ARGS` as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "gpuflow.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env or cli_env(), cwd=cwd or ROOT,
    )
