"""The generation server's host ceiling: streamed tokens per second when the model costs
next to nothing, so that what is measured is the host's work per token (HTTP, tokenizing,
scheduling, sampling, detokenizing, SSE framing), side by side with an earlier commit.

The model is a Hub-style Llama directory with one layer of width 32 over the Hub test
models' 4,096-token byte-level BPE vocabulary (untrained: the cost of a token does not
depend on the weights; every request asks ``ignore_eos``, so each streams all its tokens).
Each contender is `gpuflow serve DIR --threads 1` from its own source tree: this checkout
(the engine core in a process of its own, the default; and ``--no-engine-process``, the
core in a thread) and ``--baseline REF`` checked out in a git worktree with the same
virtual environment. Clients are closed-loop raw HTTP/1.1 streams (``_sse_load.py``, its
own process, far cheaper per token than the server). Nothing is pinned: every contender
gets the machine's cores, as a server would. Contenders take turns round by round, each
window waiting for the CPUs to go quiet first; per contender and concurrency: streamed
tokens per second, the server's CPU microseconds per streamed token (its processes' user
and system time over the window), TTFT and ITL p50, and the engine's mean step and rows
per step from /metrics; the median of the rounds.

    .venv/bin/python benchmarks/host_ceiling.py                      # ~10 minutes
    .venv/bin/python benchmarks/host_ceiling.py --quick              # a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tests"))  # hub_models: the tokenizer
from _common import (  # noqa: E402
    checked_out,
    default_result_path,
    machine_info,
    provenance,
    stop,
    wait_for_idle,
    write_json,
)
from _load import metric_values, start  # noqa: E402
from serving import free_port  # noqa: E402

# Targets of issue 50, over the baseline's tokens/s at the same concurrency.
TARGETS = {"64": 2.0, "256": 2.5}
STEP_METRICS = ("gpuflow_engine_step_seconds_count", "gpuflow_engine_step_seconds_sum",
                "gpuflow_engine_forward_seconds_sum", "gpuflow_engine_step_rows_total")


def stub_directory(folder: Path) -> Path:
    """One Llama layer of width 32 with the Hub test models' Llama 3 style tokenizer."""
    from hub_models import save_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out = folder / "llama-1x32"
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer("llama3", out)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def server_cpu_s(pid: int) -> float:
    """User and system seconds of ``pid`` and its children (the engine core's process)."""
    total = 0.0
    pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    for each in pids:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def window(url: str, pid: int, port: int, concurrency: int, args: argparse.Namespace
           ) -> dict[str, Any]:
    """One measured window of ``concurrency`` clients."""
    wait_for_idle(60, threshold=0.05)
    before_cpu, before = server_cpu_s(pid), metric_values(url, STEP_METRICS)
    done = subprocess.run([sys.executable, str(HERE / "_sse_load.py"), str(port),
                           str(concurrency), str(args.seconds), str(args.max_tokens)],
                          capture_output=True, text=True, check=True)
    cpu, after = server_cpu_s(pid) - before_cpu, metric_values(url, STEP_METRICS)
    found = json.loads(done.stdout)
    steps = after[STEP_METRICS[0]] - before[STEP_METRICS[0]]
    delta = {key: after[key] - before[key] for key in STEP_METRICS}
    return {**found, "tokens_per_s": found["chunks_per_s"],
            "server_cpu_us_per_token": 1e6 * cpu / found["chunks"] if found["chunks"] else None,
            "step_ms": 1000 * delta[STEP_METRICS[1]] / steps if steps else None,
            "forward_ms": 1000 * delta[STEP_METRICS[2]] / steps if steps else None,
            "rows_per_step": delta[STEP_METRICS[3]] / steps if steps else None}


def median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tokens_per_s", "server_cpu_us_per_token", "ttft_p50_ms", "itl_p50_ms", "step_ms",
            "forward_ms", "rows_per_step")
    return {**{key: statistics.median(v) if (v := [r[key] for r in rounds if r[key] is not None])
               else None for key in keys}, "rounds": rounds}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="445ac81",
                        help="the commit to compare with (default: the engine before issue 50)")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="one round of 3 s windows")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 3.0
    return args


def main() -> int:
    args = parse()
    levels = [int(c) for c in args.concurrency.split(",")]
    with (tempfile.TemporaryDirectory(prefix="host-ceiling-") as scratch,
          checked_out(args.baseline, Path(scratch)) as baseline):
        model = stub_directory(Path(scratch))
        trees = {"gpuflow": ROOT, "gpuflow-thread-core": ROOT, "baseline": baseline}
        extra = {"gpuflow": [], "gpuflow-thread-core": ["--no-engine-process"], "baseline": []}
        servers, runs = {}, {name: {str(c): [] for c in levels} for name in trees}
        try:
            for name, tree in trees.items():
                port = free_port()
                env = {**os.environ, "PYTHONPATH": str(tree / "src")}
                command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port",
                           str(port), "--threads", "1", "--max-batch-size",
                           str(max(levels)), "--log-level", "warning", *extra[name]]
                url = f"http://127.0.0.1:{port}"
                servers[name] = (start(command, url, "/readyz", env, timeout=300), url, port)
            for _ in range(args.rounds):
                for concurrency in levels:
                    for name, (process, url, port) in servers.items():
                        runs[name][str(concurrency)].append(
                            window(url, process.pid, port, concurrency, args))
                        print(name, concurrency, round(runs[name][str(concurrency)][-1]
                                                       ["tokens_per_s"]), flush=True)
        finally:
            stop([process for process, _, _ in servers.values()])
    results = {name: {c: median(r) for c, r in by_level.items()} for name, by_level in runs.items()}
    ratios = {c: results["gpuflow"][c]["tokens_per_s"] / results["baseline"][c]["tokens_per_s"]
              for c in map(str, levels)}
    payload = {**provenance(), "machine": machine_info(), "baseline": args.baseline,
               "model": "Llama, 1 layer, width 32, 4,096-token BPE vocabulary, untrained",
               "max_tokens": args.max_tokens, "window_s": args.seconds, "rounds": args.rounds,
               "results": results, "speedup_over_baseline": ratios,
               "targets": {c: {"target": t, "met": ratios[c] >= t}
                           for c, t in TARGETS.items() if c in ratios}}
    out = args.out or default_result_path("host_ceiling")
    write_json(out, payload)
    for concurrency in map(str, levels):
        print(f"{concurrency:>4} clients: " + "  ".join(
            f"{name} {results[name][concurrency]['tokens_per_s']:8.0f} tok/s "
            f"({results[name][concurrency]['server_cpu_us_per_token'] or 0:.0f} us/token)"
            for name in results) + f"  -> {ratios[concurrency]:.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
