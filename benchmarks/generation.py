"""Text generation load test: /v1/predict (every byte re-runs the whole prefix, one batch at
a time) against /v1/completions (KV cache, continuous batching), side by side.

One `gpuflow serve` process serves textlm's tiny GPT (untrained: the cost of generating
does not depend on the weights) on a free loopback port. Closed-loop clients ask both
endpoints for the same completion, greedy, of the same prompt, in alternating rounds so
that a change in machine load hits both. Reported per endpoint: completions per second,
generated tokens per second, p50/p99 end-to-end latency and errors (504s included).

    .venv/bin/python benchmarks/generation.py              # ~1 minute
    .venv/bin/python benchmarks/generation.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    command_line,
    default_result_path,
    git_commit,
    machine_info,
    package_version,
    versions,
    write_json,
)
from serving import drive, start_server, untrained_export, wait_ready  # noqa: E402


def bodies(prompt: list[int], tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same greedy completion asked of each endpoint."""
    return {
        "predict": ("/v1/predict", {"inputs": [prompt], "max_new_tokens": tokens,
                                    "temperature": 0.0}),
        "completions": ("/v1/completions", {"prompt": prompt, "max_tokens": tokens,
                                            "temperature": 0.0}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="bytes generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s, 4 clients")
    parser.add_argument("--out", type=Path,
                        help="default benchmarks/results/generation-<machine>.json")
    args = parser.parse_args()
    args.out = args.out or default_result_path("generation")
    if args.quick:
        args.rounds, args.warmup_s, args.window_s, args.concurrency = 1, 0.5, 1.0, 4
    with tempfile.TemporaryDirectory() as folder:
        model, example = untrained_export(Path(folder), "textlm")
        prompt = example["inputs"][0][: args.prompt_tokens]
        process, url = start_server(model, args.device, args.max_batch_size, 5.0,
                                    4 * args.concurrency, args.threads, False)
        rounds: dict[str, list[dict[str, Any]]] = {"predict": [], "completions": []}
        try:
            wait_ready(process, url)
            for number in range(args.rounds):
                for name, (path, body) in bodies(prompt, args.tokens).items():
                    figures = asyncio.run(drive(url, body, args.concurrency, args.warmup_s,
                                                args.window_s, path))
                    figures["tokens_per_s"] = figures["requests_per_s"] * args.tokens
                    rounds[name].append(figures)
                    print(f"round {number + 1} {name:>12}: {figures['requests_per_s']:8.1f} "
                          f"req/s {figures['tokens_per_s']:8.1f} tok/s  p50 "
                          f"{figures['p50_ms']:8.1f} ms  p99 {figures['p99_ms']:8.1f} ms  "
                          f"errors {figures['errors']}")
        finally:
            process.terminate()
            process.wait(timeout=30)
    runs = {name: {"errors": sum(r["errors"] for r in rs),
                   **{key: statistics.median(r[key] for r in rs)
                      for key in ("requests_per_s", "tokens_per_s", "p50_ms", "p99_ms")},
                   "rounds": rs}
            for name, rs in rounds.items()}
    write_json(args.out, {
        "benchmark": "generation",
        "command": command_line(),
        "git": git_commit(),
        "model": "textlm tiny, untrained weights",
        "settings": {k: getattr(args, k) for k in (
            "device", "concurrency", "tokens", "prompt_tokens", "max_batch_size", "threads",
            "rounds", "warmup_s", "window_s", "quick")},
        "runs": runs,
        "machine": machine_info(),
        "versions": versions(fastapi=package_version("fastapi"),
                             uvicorn=package_version("uvicorn")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    predict, cached = runs["predict"], runs["completions"]
    print(f"/v1/predict: {predict['tokens_per_s']:.0f} tok/s, p50 {predict['p50_ms']:.0f} ms | "
          f"/v1/completions: {cached['tokens_per_s']:.0f} tok/s, p50 {cached['p50_ms']:.0f} ms "
          f"({cached['tokens_per_s'] / predict['tokens_per_s']:.1f}x) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
