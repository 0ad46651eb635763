"""Helpers shared by the benchmark scripts: where a result came from, and writing it.

A timing means little without the machine and versions behind it, so every result file
records both, and is named after the machine so results from several machines can sit
side by side in ``benchmarks/results/``. Each file is written by its script alone, whole,
with ``provenance()``: nothing in it is edited by hand afterwards.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask), which can be fewer than exist."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """The machine a timing was taken on; call after setting torch's thread count."""
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "platform": platform.platform(),
    }


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(**extra: str | None) -> dict[str, str | None]:
    """Versions of what the timing depends on; ``extra`` adds optional packages."""
    import gpuflow

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": package_version("numpy"),
        "gpuflow": getattr(gpuflow, "__version__", None) or package_version("gpuflow"),
        **extra,
    }


def machine_tag() -> str:
    """A readable file-name tag, e.g. ``amd-epyc-2c``: container host names say nothing."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower())
    slug = re.sub(r"-(processor|cpu)\b.*$", "", slug).strip("-")[:40].strip("-")
    return f"{slug or socket.gethostname()}-{usable_cores()}c"


def gpu_slug() -> str | None:
    """The first CUDA GPU's name as a file-name tag, e.g. ``nvidia-h200``; None without one."""
    if not torch.cuda.is_available():
        return None
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")


def default_result_path(benchmark: str) -> Path:
    return RESULTS_DIR / f"{benchmark}-{machine_tag()}.json"


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux), steal included."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(include_children: bool = False) -> float:
    """This process's CPU seconds; with ``include_children``, also those of the child
    processes it has waited for (and, through them, their own waited-for children)."""
    times = os.times()
    own = times.user + times.system
    if include_children:
        own += times.children_user + times.children_system
    return own


class ForeignLoad:
    """Share of the machine's CPUs that other processes (or the hypervisor) used meanwhile.

    Timings taken while another job runs are not comparable, least of all with several
    torch threads, so a result carries this figure to say how far it can be trusted.
    """

    def __init__(self, include_children: bool = False) -> None:
        # Benchmarks that run their work in subprocesses count those as their own: read
        # share() only after the children have been waited for.
        self._children = include_children
        self._busy, self._own = busy_cpu_seconds(), own_cpu_seconds(include_children)
        self._start = time.perf_counter()

    def share(self) -> float | None:
        busy = busy_cpu_seconds()
        if busy is None or self._busy is None:
            return None
        wall = time.perf_counter() - self._start
        foreign = (busy - self._busy) - (own_cpu_seconds(self._children) - self._own)
        return max(0.0, foreign / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


def wait_for_idle(max_wait_s: float, threshold: float = 0.1, sample_s: float = 2.0,
                  log: Any = None) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold`` of the CPUs.

    Timings taken beside another job say little, so a benchmark that can wait a little
    for a quiet machine should. Returns the last sampled foreign share (None if unknown).
    """
    deadline = time.perf_counter() + max_wait_s
    while True:
        probe = ForeignLoad()
        time.sleep(sample_s)
        share = probe.share()
        if share is None or share < threshold or time.perf_counter() >= deadline:
            return share
        if log is not None:
            log(f"  other processes use {100 * share:.0f}% of the CPUs; waiting for a quiet "
                "machine ...")


def timestamp() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def command_line() -> str:
    """The command as run, every argument included (quoted where the shell would need it)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def git_commit() -> dict[str, Any]:
    """The commit the benchmark ran at, and whether the working tree differed from it.

    A copy of the tree without its git directory (as a lent GPU machine gets) cannot say:
    there the launcher passes both in ``GPUFLOW_GIT_COMMIT`` and ``GPUFLOW_GIT_DIRTY``
    (0 or 1), and the result says that is where they came from.
    """
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    if commit:
        return {"commit": commit, "source": "git",
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    given, dirty = os.environ.get("GPUFLOW_GIT_COMMIT"), os.environ.get("GPUFLOW_GIT_DIRTY")
    if given:
        return {"commit": given, "dirty": None if dirty is None else dirty == "1",
                "source": "GPUFLOW_GIT_COMMIT and GPUFLOW_GIT_DIRTY (no git checkout here)"}
    return {"commit": None, "dirty": None, "source": "unknown (no git checkout here)"}


def provenance(**extra_versions: str | None) -> dict[str, Any]:
    """Where a result came from: date, full command line, the commit and whether the working
    tree differed from it, and the versions (``extra_versions`` adds optional packages)."""
    return {"created": timestamp(), "command": command_line(), "git": git_commit(),
            "versions": versions(**extra_versions)}


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically, so an interrupted run never leaves half a result behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def checked_out(ref: str, folder: Path) -> Iterator[Path]:
    """``ref`` in a git worktree under ``folder`` (a baseline to run beside this checkout,
    with the same virtual environment), removed afterwards."""
    path = folder / "baseline"
    root = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=root,
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root,
                       capture_output=True)


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate each process and wait for it; killed after 30 s."""
    for process in processes:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
