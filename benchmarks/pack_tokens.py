"""Tokens/s and peak memory of `gpuflow data pack --tokenizer` against `encode_batch` over
the whole corpus held in memory.

The corpus is JSONL (one document a line, under ``text``) made from the Python help topics
bundled with CPython, with seeded variations (paragraphs shuffled and words re-cased per
document) so that no two documents repeat; ``--mb`` sets its size. The tokenizer is the
Llama-3-style byte-level BPE of the test suite's Hub directories (4,096 ids), trained here
in seconds.

Contenders, each in its own process (so its peak RSS is its own), taking turns in rounds:
- ``gpuflow``: ``gpuflow.workloads.packing.pack`` with one tokenizer process per core:
  reading, tokenizing, writing uint16 shards, checksums and manifest, all counted.
- ``encode_batch``: the corpus read whole into memory, then the tokenizer's own
  multi-threaded ``encode_batch`` (Rust, all cores) over every document at once; only the
  ``encode_batch`` call is timed, nothing is written.
Peak RSS is each contender process's own (``ru_maxrss``) and, for gpuflow, also the peak of
the sum over the packing process and its workers, sampled from /proc every 50 ms.

Run: ``python benchmarks/pack_tokens.py --mb 300`` (the issue's size), or ``--mb 40``.
Writes ``benchmarks/results/pack_tokens-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the tokenizer
# Nothing heavier is imported at the top: spawned tokenizer workers import this module
# again (as every spawned process imports its parent's main module).

CONTENDERS = ("gpuflow", "encode_batch")
SHARD_MB = 64


def make_corpus(root: Path, megabytes: float, seed: int = 0) -> Path:
    """JSONL files of varied help topics, ``megabytes`` MiB in all, in ``root/corpus``."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    folder = root / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    topics_text = [topics[name] for name in sorted(topics)]
    written, number = 0, 0
    target = int(megabytes * 2**20)
    handle = open(folder / "part-000.jsonl", "w")  # noqa: SIM115 (rotated below)
    while written < target:
        paragraphs = rng.choice(topics_text).split("\n\n")
        rng.shuffle(paragraphs)
        words = "\n\n".join(paragraphs).split(" ")
        for i in rng.sample(range(len(words)), k=len(words) // 10):
            words[i] = words[i].upper() if rng.random() < 0.5 else words[i].capitalize()
        line = json.dumps({"text": " ".join(words)}) + "\n"
        handle.write(line)
        written += len(line)
        if written // (64 * 2**20) != (written - len(line)) // (64 * 2**20):
            number += 1
            handle.close()
            handle = open(folder / f"part-{number:03d}.jsonl", "w")  # noqa: SIM115
    handle.close()
    return folder


def make_tokenizer(root: Path) -> Path:
    from hub_models import save_tokenizer

    out = root / "tokenizer"
    out.mkdir(exist_ok=True)
    save_tokenizer("llama3", out)
    return out


def tree_rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` and its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text().splitlines()
            total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
            todo += map(int, Path(f"/proc/{current}/task/{current}/children").read_text().split())
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


def run_gpuflow(corpus: Path, tokenizer: Path, out: Path) -> dict[str, Any]:
    import os
    import threading

    from gpuflow.workloads.packing import pack

    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_rss_mb(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    manifest = pack("textlm", corpus, out, shard_mb=SHARD_MB, progress=False,
                    tokenizer=tokenizer)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    tokens = manifest.count("train") + manifest.count("val")
    return {"seconds": seconds, "tokens": tokens, "peak_total_rss_mb": peak[0]}


def run_encode_batch(corpus: Path, tokenizer: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    texts = [json.loads(line)["text"] for path in sorted(corpus.glob("*.jsonl"))
             for line in path.open()]
    start = time.perf_counter()
    encodings = backend.encode_batch(texts, add_special_tokens=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(e.ids) + 1 for e in encodings)}


def measure(contender: str, corpus: Path, tokenizer: Path, scratch: Path) -> dict[str, Any]:
    """One contender in a fresh process: its figures and its own peak RSS."""
    done = subprocess.run([sys.executable, __file__, "--child", contender, "--corpus",
                           str(corpus), "--tokenizer", str(tokenizer), "--scratch",
                           str(scratch)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> None:
    scratch = Path(args.scratch)
    if args.child == "gpuflow":
        result = run_gpuflow(Path(args.corpus), Path(args.tokenizer), scratch / "packed")
    else:
        result = run_encode_batch(Path(args.corpus), Path(args.tokenizer))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=300, help="corpus size in MiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default: results/pack_tokens-<machine>.json")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import _common

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus, tokenizer = make_corpus(root, args.mb), make_tokenizer(root)
        size = sum(p.stat().st_size for p in corpus.iterdir())
        rounds: list[dict[str, Any]] = []
        load = _common.ForeignLoad(include_children=True)
        for number in range(args.rounds):
            order = CONTENDERS if number % 2 == 0 else CONTENDERS[::-1]
            found = {}
            for contender in order:
                scratch = root / f"scratch-{number}-{contender}"
                scratch.mkdir()
                found[contender] = measure(contender, corpus, tokenizer, scratch)
                found[contender]["tokens_per_s"] = (found[contender]["tokens"]
                                                    / found[contender]["seconds"])
                print(contender, json.dumps(found[contender]), flush=True)
            rounds.append(found)
        ratios = [r["gpuflow"]["tokens_per_s"] / r["encode_batch"]["tokens_per_s"]
                  for r in rounds]
        payload = {
            "benchmark": "pack_tokens", **_common.provenance(tokenizers=_common.package_version(
                "tokenizers")),
            "machine": _common.machine_info(), "foreign_cpu_share": load.share(),
            "corpus_mb": size / 2**20, "shard_mb": SHARD_MB, "rounds": rounds,
            "ratio_tokens_per_s_median": statistics.median(ratios),
            "target": ">= 0.9x encode_batch, peak RSS bounded by the shard size",
        }
    out = args.out or _common.default_result_path("pack_tokens")
    _common.write_json(out, payload)
    print(f"gpuflow / encode_batch tokens/s: {payload['ratio_tokens_per_s_median']:.2f}x; "
          f"wrote {out}")


if __name__ == "__main__":
    main()
