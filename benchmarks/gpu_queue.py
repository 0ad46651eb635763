"""``bash benchmarks/gpu_suite.sh --pending``: a GPU window goes whole to what needs measuring.

The queue is every stage of ``gpu_stages.STAGES`` (in that fixed order: the never-measured
first) whose results are missing, or stale: a commit after the one its newest results file
records (else the commit that last wrote that file) changed one of the paths it measures.
The queue runs until ``--budget-s`` is spent: a stage starts only where its estimate fits the
time left, runs under that time, and writes its own results file as it finishes (the
gpu_suite stages after every run), so a cut-off window keeps what it measured.

Staleness needs git; a lent GPU machine gets the tree without it. There the queue comes from
a file written where git is (``--pending --dry-run --save FILE``), carried and named with
``--queue FILE``; its commit is passed on to the stages' results (``GPUFLOW_GIT_COMMIT``).

    bash benchmarks/gpu_suite.sh --pending --dry-run            # list the queue, with reasons
    bash benchmarks/gpu_suite.sh --pending --budget-s 450       # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_stages import STAGES, Stage, latest  # noqa: E402

BY_NAME = {stage.name: stage for stage in STAGES}


def git(root: Path, *args: str) -> str | None:
    """git's output in ``root``, or None where git or the revision is not there."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def measured_at(root: Path, path: Path, result: dict[str, Any]) -> str | None:
    """The commit a results file stands for: the one it records (the hand-edited file of
    2026-11-30 has ``git_commit``), else the last commit that wrote the file."""
    recorded = (result.get("git") or {}).get("commit") or result.get("git_commit")
    if recorded:
        full = git(root, "rev-parse", "--verify", "--quiet", f"{recorded}^{{commit}}")
        if full:
            return full
    return git(root, "log", "-1", "--format=%H", "--", str(path)) or None


def reason(stage: Stage, root: Path, results_dir: Path) -> str | None:
    """Why ``stage`` needs a GPU run ("missing" or "stale since commit X: paths"), or None."""
    found = latest(stage, results_dir)
    if found is None:
        return "missing"
    commit = measured_at(root, *found)
    if commit is None or not stage.sources:  # written in this tree, or measures no code
        return None
    since = git(root, "log", "--format=%h", f"{commit}..HEAD", "--", *stage.sources)
    if not since:
        return None
    changed = [source for source in stage.sources
               if git(root, "log", "-1", "--format=%h", f"{commit}..HEAD", "--", source)]
    commits = since.split()
    count = f"{len(commits)} commit{'s' if len(commits) > 1 else ''}"
    return (f"stale since commit {commits[-1]} ({count} after {found[0].name}'s "
            f"{commit[:7]}): {', '.join(changed)}")


@dataclass(frozen=True)
class Queue:
    commit: str | None
    dirty: bool | None
    pending: list[tuple[Stage, str]]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"commit": self.commit, "dirty": self.dirty, "pending": [
            {"stage": stage.name, "reason": why} for stage, why in self.pending]}, indent=2))

    @classmethod
    def load(cls, path: Path) -> Queue:
        saved = json.loads(path.read_text())
        return cls(saved["commit"], saved["dirty"],
                   [(BY_NAME[item["stage"]], item["reason"]) for item in saved["pending"]])


def pending(root: Path, results_dir: Path) -> Queue | None:
    """The queue at ``root``'s HEAD, or None where there is no git checkout."""
    head = git(root, "rev-parse", "HEAD")
    if head is None:
        return None
    dirty = bool(git(root, "status", "--porcelain", "--untracked-files=no"))
    return Queue(head, dirty, [(stage, why) for stage in STAGES
                               if (why := reason(stage, root, results_dir)) is not None])


def describe(queue: Queue) -> list[str]:
    total = sum(stage.estimate_s for stage, _ in queue.pending)
    lines = [f"GPU queue at {(queue.commit or '?')[:12]}: {len(queue.pending)} of "
             f"{len(STAGES)} stages pending, ~{total:.0f} s estimated"]
    lines += [f"{n:2}. {stage.name:15} ~{stage.estimate_s:3.0f} s  {why}"
              for n, (stage, why) in enumerate(queue.pending, 1)]
    return lines


def run(queue: Queue, budget_s: float, gpu: str) -> list[dict[str, Any]]:
    """Each pending stage in order, while its estimate fits the budget left."""
    started, done = time.monotonic(), []
    for stage, why in queue.pending:
        left = budget_s - (time.monotonic() - started)
        entry: dict[str, Any] = {"stage": stage.name, "reason": why}
        done.append(entry)
        if stage.estimate_s > left:
            entry["skipped"] = f"needs ~{stage.estimate_s:.0f} s, {left:.0f} s left"
            continue
        print(f"[gpu_queue] {stage.name} ({why}), {left:.0f} s left", flush=True)
        begin = time.monotonic()
        try:
            entry["exit_code"] = subprocess.run([sys.executable, *stage.command(gpu, left)],
                                                cwd=ROOT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            entry["exit_code"] = None
            entry["stopped"] = f"at the budget's end, after {left:.0f} s"
        entry["wall_s"] = round(time.monotonic() - begin, 1)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pending", action="store_true", help="(gpu_suite.sh's switch here)")
    parser.add_argument("--dry-run", action="store_true", help="list the queue; run nothing")
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--save", type=Path, help="with --dry-run: write the queue here")
    parser.add_argument("--queue", type=Path, help="the saved queue (where git is not)")
    parser.add_argument("--results", type=Path, default=HERE / "results", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    queue = Queue.load(args.queue) if args.queue else pending(ROOT, args.results)
    if queue is None:
        parser.error("no git checkout here to tell stale results from fresh: write the queue "
                     "where there is one (--pending --dry-run --save FILE) and pass --queue FILE")
    print("\n".join(describe(queue)), flush=True)
    if args.save:
        queue.save(args.save)
    if args.dry_run:
        return 0
    import _common

    gpu = _common.gpu_slug()
    if gpu is None:
        parser.error("no CUDA GPU here: --pending --dry-run lists the queue")
    if queue.commit and "GPUFLOW_GIT_COMMIT" not in os.environ:
        os.environ["GPUFLOW_GIT_COMMIT"] = queue.commit
        os.environ["GPUFLOW_GIT_DIRTY"] = "1" if queue.dirty else "0"
    for entry in run(queue, args.budget_s, gpu):
        print(f"[gpu_queue] {json.dumps(entry)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
