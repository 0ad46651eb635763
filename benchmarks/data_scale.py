"""Data at scale: packing memory and speed at 1x and 4x a corpus, training from it, and the
share of a run spent evaluating.

Two text corpora of one file each (a user's "one file of words"), ``--size-gb`` and 4x that,
are generated: random words from a fixed vocabulary, written 16 MiB at a time (each block a
rotation of one block of words, so generating costs little). Each is packed with ``gpuflow
data pack DIR --out OUT --workload textlm`` (64 MiB shards, the default) as a user runs it,
in a subprocess whose own peak RSS ``wait4`` reports, beside its wall time (MB/s of corpus
packed). Then ``gpuflow train --workload textlm --data-dir OUT`` runs ``--steps`` steps
from each packed set with the defaults for evaluation (every 100 steps and at the end,
``--eval-batches`` 20): its peak RSS, the median ``data_wait_frac`` and the share of its
wall time spent evaluating (``eval_time_s`` / ``wall_time_s`` of ``summary.json``).

Targets (issue 22): packing peak RSS within 10% between the sizes and under 1 GB;
training peak RSS flat; ``data_wait_frac`` <= 0.02; evaluation <= 10% of the run.

Run: ``python benchmarks/data_scale.py`` (about 10 minutes on 2 cores and ~17 GB of disk
at the default 1.5 GB); ``--size-gb`` and ``--steps`` scale it. Writes
``benchmarks/results/data_scale-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402

BLOCK = 16 * 2**20
VOCABULARY = 5_000
PACK_RSS_LIMIT = 2**30
EVAL_SHARE_TARGET = 0.10
DATA_WAIT_TARGET = 0.02


def word_block(seed: int = 0) -> np.ndarray:
    """16 MiB of space-separated random lowercase words (2-9 letters) as bytes."""
    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 123, int(rng.integers(2, 10)), dtype=np.uint8))
             for _ in range(VOCABULARY)]
    text = bytearray()
    while len(text) < BLOCK:
        text += b" ".join(words[i] for i in rng.integers(0, VOCABULARY, 100_000)) + b"\n"
    return np.frombuffer(bytes(text[:BLOCK]), dtype=np.uint8)


def write_corpus(path: Path, size: int, block: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as handle:
        for start in range(0, size, BLOCK):
            rolled = np.roll(block, int(rng.integers(0, BLOCK)))
            handle.write(rolled[:min(BLOCK, size - start)].tobytes())


def measured(args: list[str], log: Path) -> dict[str, float]:
    """Run ``gpuflow ARGS``; its wall time and its own peak RSS (from ``wait4``)."""
    started = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "gpuflow.cli", *args],
                                   stdout=handle, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"`gpuflow {' '.join(args)}` failed ({process.returncode}):\n"
                 f"{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - started, "peak_rss_bytes": usage.ru_maxrss * 1024}


def pack_and_train(root: Path, name: str, size: int, block: np.ndarray,
                   steps: int) -> dict[str, Any]:
    corpus = root / name / "corpus.txt"
    write_corpus(corpus, size, block)
    packed = root / f"{name}-packed"
    print(f"{name}: packing {size / 1e9:.2f} GB ...", flush=True)
    pack = measured(["data", "pack", str(corpus.parent), "--out", str(packed), "--workload",
                     "textlm", "--no-progress"], root / f"{name}-pack.log")
    manifest = json.loads((packed / "manifest.json").read_text())
    corpus.unlink()  # disk: the packed copy is all training needs
    print(f"{name}: packed at {size / 1e6 / pack['wall_s']:.0f} MB/s, peak RSS "
          f"{pack['peak_rss_bytes'] / 2**20:.0f} MiB; training {steps} steps ...", flush=True)
    run_dir = root / f"{name}-run"
    train = measured(["train", "--workload", "textlm", "--data-dir", str(packed),
                      "--max-steps", str(steps), "--no-checkpoints", "--no-progress",
                      "--run-dir", str(run_dir)], root / f"{name}-train.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(packed)
    return {
        "corpus_bytes": size,
        "pack": {**pack, "mb_per_s": size / 1e6 / pack["wall_s"],
                 "shards": {split: len(shards) for split, shards in manifest["splits"].items()},
                 "tokens": manifest["counts"]},
        "train": {**train, "steps": summary["steps"],
                  "data_wait_frac": summary["median"].get("data_wait_frac"),
                  "step_time_s": summary["median"].get("step_time_s"),
                  "eval_time_s": summary["eval_time_s"], "run_wall_s": summary["wall_time_s"],
                  "eval_share": summary["eval_time_s"] / summary["wall_time_s"],
                  "evaluated": summary["evaluated"]},
    }


def verdicts(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    pack_rss = (small["pack"]["peak_rss_bytes"], large["pack"]["peak_rss_bytes"])
    train_rss = (small["train"]["peak_rss_bytes"], large["train"]["peak_rss_bytes"])
    waits = [run["train"]["data_wait_frac"] for run in (small, large)]
    return {
        "pack_rss_ratio_4x_to_1x": pack_rss[1] / pack_rss[0],
        "pack_rss_within_10pct": abs(pack_rss[1] / pack_rss[0] - 1) <= 0.10,
        "pack_rss_under_1gb": max(pack_rss) < PACK_RSS_LIMIT,
        "train_rss_ratio_4x_to_1x": train_rss[1] / train_rss[0],
        "data_wait_frac_at_most_0.02": all(w is not None and w <= DATA_WAIT_TARGET
                                           for w in waits),
        "eval_share_at_most_10pct_on_4x": large["train"]["eval_share"] <= EVAL_SHARE_TARGET,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.5, help="the 1x corpus (GB)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=_common.default_result_path("data_scale"))
    args = parser.parse_args()
    load = _common.ForeignLoad(include_children=True)
    block = word_block()
    root = Path(tempfile.mkdtemp(prefix="gpuflow-data-scale-", dir=args.work_dir))
    try:
        size = int(args.size_gb * 1e9)
        runs = {"1x": pack_and_train(root, "1x", size, block, args.steps),
                "4x": pack_and_train(root, "4x", 4 * size, block, args.steps)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "data_scale",
        **_common.provenance(),
        "machine": _common.machine_info(),
        "foreign_cpu_share": load.share(),
        "settings": {"size_gb": args.size_gb, "steps": args.steps, "shard_mb": 64,
                     "workload": "textlm (tiny)", "eval_every": 100, "eval_batches": 20},
        "runs": runs,
        "verdicts": verdicts(runs["1x"], runs["4x"]),
    }
    _common.write_json(args.out, result)
    print(json.dumps(result["verdicts"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
