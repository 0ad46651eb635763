"""Serving load test: dynamic batching against --max-batch-size 1, side by side.

Each configuration runs as a real `gpuflow serve` process on a free loopback port. Closed-loop
clients (each sends its next request when the previous answer arrives) drive it for a
warm-up period, then for a measurement window; the two configurations alternate in rounds
so that a change in machine load hits both. Reported per configuration: requests per
second, p50/p99 end-to-end latency seen by the clients, the mean rows per batch (from the
server's /metrics) and the errors.

    .venv/bin/python benchmarks/serving.py                 # ~1 minute
    .venv/bin/python benchmarks/serving.py --quick         # a few seconds, for tests
    .venv/bin/python benchmarks/serving.py --workload textlm   # compute-heavy requests

The clients run in this process and share the machine with the server: on few cores they
cost the server CPU time, so absolute figures understate a server alone; the comparison
between the two configurations is what the benchmark is for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    default_result_path,
    machine_info,
    package_version,
    provenance,
    write_json,
)

CONFIGS = {"dynamic": None, "max_batch_size_1": 1}


def untrained_export(folder: Path, workload: str) -> tuple[Path, dict[str, Any]]:
    """A built-in model with its initial weights (serving cost does not depend on training)
    and a request body of the shape it takes: one 8x8 digit scan, or one 128-byte window of
    text for textlm's tiny GPT, whose compute per request is ~100x digits'."""
    from safetensors.torch import save_file

    from gpuflow import TrainConfig
    from gpuflow.workload import resolve_workload

    config = TrainConfig(workload=workload, data="synthetic")
    model = resolve_workload(workload, config.workload_options()).model
    path = folder / f"{workload}.safetensors"
    tensors = {name: tensor.contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"config": json.dumps(config.to_dict()),
                                            "workload": workload, "step": "0"})
    inputs = (torch.randn(1, 1, 8, 8) if workload == "digits"
              else torch.randint(0, 256, (1, model.config.seq_len)))
    return path, {"inputs": inputs.tolist()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model: Path, device: str, max_batch_size: int, max_wait_ms: float,
                 max_queue: int, threads: int, cuda_graphs: bool
                 ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
               "--device", device, "--max-batch-size", str(max_batch_size),
               "--max-wait-ms", str(max_wait_ms), "--max-queue", str(max_queue),
               "--threads", str(threads), "--log-level", "warning",
               *(["--cuda-graphs"] if cuda_graphs else [])]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen[bytes], url: str, timeout: float = 120) -> None:
    """Poll /readyz: the server is another process, so there is no event to wait on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


def batch_rows(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    total = float(re.search(r"^gpuflow_batch_size_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^gpuflow_batch_size_count (\S+)$", text, re.M).group(1))
    return total, count


async def drive(url: str, body: dict[str, Any], concurrency: int, warmup_s: float,
                window_s: float, path: str = "/v1/predict") -> dict[str, Any]:
    """Closed loop: ``concurrency`` clients; only answers that start inside the window count."""
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        start = time.perf_counter()
        window_start, window_end = start + warmup_s, start + warmup_s + window_s

        async def client_loop() -> None:
            nonlocal errors
            while (sent := time.perf_counter()) < window_end:
                reply = await client.post(path, json=body)
                if sent >= window_start:
                    latencies.append(time.perf_counter() - sent)
                    errors += reply.status_code != 200

        before: tuple[float, float] | None = None

        async def mark_window() -> None:
            nonlocal before
            await asyncio.sleep(warmup_s)
            before = await asyncio.to_thread(batch_rows, url)

        await asyncio.gather(mark_window(), *(client_loop() for _ in range(concurrency)))
    after = batch_rows(url)
    assert before is not None
    rows, batches = after[0] - before[0], after[1] - before[1]
    ordered = sorted(latencies)
    return {
        "requests": len(latencies), "errors": errors,
        "requests_per_s": len(latencies) / window_s,
        "p50_ms": 1000 * statistics.median(ordered) if ordered else None,
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        if ordered else None,
        "mean_batch_rows": rows / batches if batches else None,
    }


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures over all rounds of one configuration (medians of the per-round figures)."""
    return {
        "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        **{key: statistics.median(r[key] for r in rounds)
           for key in ("requests_per_s", "p50_ms", "p99_ms", "mean_batch_rows")},
        "rounds": rounds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["digits", "textlm"], default="digits",
                        help="built-in model to serve untrained (default digits)")
    parser.add_argument("--device", default="cpu",
                        help="where both servers run (default cpu; cuda on a GPU machine)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="serve both configurations with `gpuflow serve --cuda-graphs`")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each server (default 1: the clients share "
                             "the cores, and spinning thread pools collapse when oversubscribed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 1 s (plus 0.5 s warm-up), 8 clients")
    parser.add_argument("--out", type=Path,
                        help="default benchmarks/results/serving[-textlm]-<machine>.json")
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.workload == "digits" else f"-{args.workload}"
        args.out = default_result_path(f"serving{suffix}")
    if args.quick:
        args.rounds, args.warmup_s, args.window_s, args.concurrency = 1, 0.5, 1.0, 8
    with tempfile.TemporaryDirectory() as folder:
        model, body = untrained_export(Path(folder), args.workload)
        servers = {name: start_server(model, args.device, size or args.max_batch_size,
                                      args.max_wait_ms, 4 * args.concurrency, args.threads,
                                      args.cuda_graphs)
                   for name, size in CONFIGS.items()}
        try:
            for process, url in servers.values():
                wait_ready(process, url)
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
            for number in range(args.rounds):
                for name, (_, url) in servers.items():
                    figures = asyncio.run(drive(url, body, args.concurrency, args.warmup_s,
                                                args.window_s))
                    rounds[name].append(figures)
                    print(f"round {number + 1} {name:>16}: {figures['requests_per_s']:8.1f} "
                          f"req/s  p50 {figures['p50_ms']:7.2f} ms  p99 "
                          f"{figures['p99_ms']:7.2f} ms  batch {figures['mean_batch_rows']:.1f}")
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)
    result = {
        "benchmark": "serving",
        **provenance(fastapi=package_version("fastapi"), uvicorn=package_version("uvicorn"),
                     httpx=package_version("httpx")),
        "model": f"{args.workload}, untrained weights",
        "settings": {k: getattr(args, k) for k in ("device", "cuda_graphs", "concurrency",
                                                    "max_batch_size",
                                                    "max_wait_ms", "threads", "rounds",
                                                    "warmup_s", "window_s", "quick")},
        "runs": {name: merge(r) for name, r in rounds.items()},
        "machine": machine_info(),
        # Other jobs on the machine slow both configurations: the 1-minute load average
        # at the end says how busy it was (compare with usable_cores).
        "load_average_1min": os.getloadavg()[0],
    }
    write_json(args.out, result)
    dynamic, single = result["runs"]["dynamic"], result["runs"]["max_batch_size_1"]
    print(f"dynamic batching: {dynamic['requests_per_s']:.1f} req/s, p50 "
          f"{dynamic['p50_ms']:.2f} ms, p99 {dynamic['p99_ms']:.2f} ms | max-batch-size 1: "
          f"{single['requests_per_s']:.1f} req/s, p50 {single['p50_ms']:.2f} ms, p99 "
          f"{single['p99_ms']:.2f} ms -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
