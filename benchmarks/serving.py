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
    .venv/bin/python benchmarks/serving.py --contenders    # vs FastAPI, LitServe: ~4 minutes

The clients run in this process and share the machine with the server: on few cores they
cost the server CPU time, so absolute figures understate a server alone; the comparison
between the two configurations is what the benchmark is for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
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
    wait_for_idle,
    write_json,
)

CONFIGS = {"dynamic": None, "max_batch_size_1": 1}


def untrained_export(folder: Path, workload: str,
                     model_size: str | None = None) -> tuple[Path, dict[str, Any]]:
    """A built-in model with its initial weights (serving cost does not depend on training)
    and a request body of the shape it takes: one 8x8 digit scan, or one 128-byte window of
    text for textlm's tiny GPT, whose compute per request is ~100x digits'."""
    from safetensors.torch import save_file

    from gpuflow import TrainConfig
    from gpuflow.workload import resolve_workload

    config = TrainConfig(workload=workload, data="synthetic", model_size=model_size)
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


# --- --contenders: gpuflow serve against other servers, each pinned to one core ---------

CONTENDERS_DIR = Path(__file__).resolve().parent / "contenders"
CONTENDER_LABELS = {
    "fastapi_plain": "plain FastAPI endpoint, no batching",
    "litserve": "LitServe, max batch {batch}, {wait:g} ms",
    "litserve_zmq": "LitServe with fast_queue (ZeroMQ), max batch {batch}, {wait:g} ms",
    "gpuflow": "gpuflow serve, max batch {batch}, {wait:g} ms",
}
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.I)
_CLOSE = re.compile(rb"\r\nconnection:\s*close", re.I)
_BATCH_ROWS = re.compile(rb'"batch_rows":\s*(\d+)')


def pixels_body() -> dict[str, Any]:
    """One 8x8 scan as pixel rows (digits' natural input): decoded, scaled, normalised
    with the workload's statistics, run and answered with the top 5 labels."""
    generator = torch.Generator().manual_seed(0)
    return {"pixels": torch.randint(0, 256, (8, 8), generator=generator).tolist()}


def contender_command(name: str, model: Path, port: int, args: argparse.Namespace
                      ) -> tuple[list[str], str] | str:
    """The server's command line and readiness path, or why it cannot run here."""
    batch, wait, threads = str(args.max_batch_size), str(args.max_wait_ms), str(args.threads)
    if name == "gpuflow":
        return [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
                "--device", "cpu", "--max-batch-size", batch, "--max-wait-ms", wait,
                "--threads", threads, "--log-level", "warning"], "/readyz"
    if name == "fastapi_plain":
        return [sys.executable, str(CONTENDERS_DIR / "fastapi_plain.py"), str(model),
                "--port", str(port), "--threads", threads], "/readyz"
    if name in ("litserve", "litserve_zmq"):
        if package_version("litserve") is None:
            return "litserve is not installed (pip install litserve); it is never a gpuflow " \
                   "dependency"
        return [sys.executable, str(CONTENDERS_DIR / "litserve_batched.py"), str(model),
                "--port", str(port), "--threads", threads, "--max-batch-size", batch,
                "--max-wait-ms", wait, *(["--fast-queue"] if name == "litserve_zmq" else [])
                ], "/health"
    raise ValueError(name)


class PinnedServer:
    """A server process in a session of its own, pinned to ``core``; the whole session
    (LitServe runs several processes) is paused while another server is measured."""

    def __init__(self, name: str, command: list[str], ready_path: str, port: int,
                 core: int) -> None:
        self.name, self.ready_path = name, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.command = ["taskset", "-c", str(core), *command]
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, env=env,
                                        start_new_session=True, cwd=CONTENDERS_DIR.parent)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: "
                                   f"{self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} at {self.url} not ready after {timeout} s")

    def signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, number)

    def cpu_seconds(self) -> float:
        """CPU seconds of every live process of the server's session."""
        return session_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=20)
        self.signal(signal.SIGKILL)  # LitServe's workers, should any outlive their parent


def session_cpu_seconds(session: int) -> float:
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def core_busy_seconds() -> dict[int, float]:
    """Busy CPU seconds of each core since boot (``/proc/stat``'s cpuN lines)."""
    busy = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, values[:8])
            busy[int(name[3:])] = (user + nice + system + irq + softirq + steal) \
                / os.sysconf("SC_CLK_TCK")
    return busy


class RawClient:
    """One keep-alive HTTP/1.1 connection sending one prepared POST: far cheaper per
    request than a full client library, so one core of clients outpaces one core of server."""

    def __init__(self, port: int, request: bytes) -> None:
        self.port, self.request = port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.writer = None

    async def post(self) -> tuple[int, bytes]:
        """(status, body); a broken connection answers status 0 and is opened again."""
        try:
            if self.writer is None:
                await self.connect()
            assert self.reader is not None and self.writer is not None
            self.writer.write(self.request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            length = _LENGTH.search(head)
            body = await self.reader.readexactly(int(length.group(1))) if length else b""
            if length is None or _CLOSE.search(head):
                await self.close()
            return int(head[9:12]), body
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            await self.close()
            return 0, b""


async def closed_loop(port: int, path: str, body: bytes, concurrency: int, warmup_s: float,
                      requests: int, sessions: list[int]) -> dict[str, Any]:
    """``concurrency`` closed-loop clients; after ``warmup_s`` the next ``requests`` sent
    are measured: req/s is their count over the time from the window's start to the last
    answer. Also the busy share of each core and the CPU the client and server took."""
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    clients = [RawClient(port, request) for _ in range(concurrency)]
    await asyncio.gather(*(client.connect() for client in clients))
    latencies: list[float] = []
    batch_rows: list[int] = []
    errors = issued = 0
    marks: dict[str, Any] = {}
    end = 0.0
    start = time.perf_counter()
    window_start = start + warmup_s

    def mark(name: str) -> None:
        marks[name] = (time.perf_counter(), core_busy_seconds(), time.process_time(),
                       sum(map(session_cpu_seconds, sessions)))

    async def client_loop(client: RawClient) -> None:
        nonlocal errors, issued, end
        while True:
            sent = time.perf_counter()
            counted = sent >= window_start
            if counted:
                if issued >= requests:
                    return
                issued += 1
            status, answer = await client.post()
            if counted:
                end = time.perf_counter()
                latencies.append(end - sent)
                errors += status != 200
                found = _BATCH_ROWS.search(answer)
                if found:
                    batch_rows.append(int(found.group(1)))

    asyncio.get_running_loop().call_at(asyncio.get_running_loop().time() + warmup_s,
                                       mark, "start")
    await asyncio.gather(*(client_loop(client) for client in clients))
    mark("end")
    await asyncio.gather(*(client.close() for client in clients))
    (t0, busy0, own0, server0), (t1, busy1, own1, server1) = marks["start"], marks["end"]
    wall = t1 - t0
    elapsed = end - window_start
    ordered = sorted(latencies)
    cores_busy = sum(busy1.values()) - sum(busy0.values())
    return {
        "requests": len(latencies), "errors": errors, "window_s": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_batch_rows_seen": statistics.fmean(batch_rows) if batch_rows else None,
        "core_busy": {str(core): (busy1[core] - busy0[core]) / wall for core in busy1},
        "client_cpu_share": (own1 - own0) / wall,
        "server_cpu_share": (server1 - server0) / wall,
        "foreign_cpu_share": max(0.0, (cores_busy - (own1 - own0) - (server1 - server0))
                                 / (wall * len(busy1))),
    }


def merge_level(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One server at one concurrency over all rounds: medians of the per-round figures."""
    def median(key: str) -> float | None:
        known = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(known) if known else None

    return {"requests": sum(r["requests"] for r in rounds),
            "errors": sum(r["errors"] for r in rounds),
            **{key: median(key) for key in ("requests_per_s", "p50_ms", "p99_ms",
                                             "mean_batch_rows_seen", "client_cpu_share",
                                             "server_cpu_share")},
            "rounds": rounds}


def contenders_table(runs: dict[str, dict[str, dict[str, Any]]], labels: dict[str, str],
                     levels: list[int]) -> list[str]:
    lines = ["| req/s (p50 ms) | " + " | ".join(f"concurrency {c}" if i == 0 else str(c)
                                                for i, c in enumerate(levels)) + " |",
             "|---|" + "---|" * len(levels)]
    for name, label in labels.items():
        cells = []
        for level in levels:
            figures = runs[str(level)][name]
            cells.append(f"{figures['requests_per_s']:,.0f} ({figures['p50_ms']:.2f})"
                         + (f", {figures['errors']} errors" if figures["errors"] else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def contenders_targets(runs: dict[str, dict[str, dict[str, Any]]], levels: list[int]
                       ) -> dict[str, Any]:
    """gpuflow's req/s at least the best contender's at every level; at concurrency 1 its
    p50 within 1 ms of the plain endpoint's."""
    throughput = {}
    for level in levels:
        figures = runs[str(level)]
        others = {n: f["requests_per_s"] for n, f in figures.items() if n != "gpuflow"}
        best = max(others, key=others.__getitem__) if others else None
        ours = figures["gpuflow"]["requests_per_s"]
        throughput[str(level)] = {"gpuflow": ours, "best": best,
                                  "best_requests_per_s": others.get(best),
                                  "ratio": ours / others[best] if best else None,
                                  "met": best is None or ours >= others[best]}
    targets: dict[str, Any] = {"throughput": throughput}
    if 1 in levels and "fastapi_plain" in runs["1"]:
        ours, plain = runs["1"]["gpuflow"]["p50_ms"], runs["1"]["fastapi_plain"]["p50_ms"]
        targets["p50_at_1"] = {"gpuflow_ms": ours, "plain_ms": plain,
                               "difference_ms": ours - plain, "limit_ms": 1.0,
                               "met": ours - plain <= 1.0}
    return targets


def measure_window(server: PinnedServer, body: bytes, concurrency: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One measurement window of ``server`` (resumed for it, paused after). A window in
    which other processes took over ``args.foreign_limit`` of the CPUs is measured again,
    after waiting for a quiet machine, up to ``args.retries`` times; the last one counts
    and says how many were dropped."""
    for attempt in range(args.retries + 1):
        server.signal(signal.SIGCONT)
        try:
            time.sleep(0.3)
            figures = asyncio.run(closed_loop(server.port, "/v1/predict", body, concurrency,
                                              args.warmup_s, args.requests,
                                              [server.process.pid]))
        finally:
            server.signal(signal.SIGSTOP)
        figures["dropped_for_foreign_load"] = attempt
        if figures["foreign_cpu_share"] <= args.foreign_limit or attempt == args.retries:
            return figures
        print(f"  other processes took {100 * figures['foreign_cpu_share']:.0f}% of the "
              f"CPUs during {server.name} at {concurrency}; measuring it again", flush=True)
        wait_for_idle(120, threshold=args.foreign_limit, log=print)
    raise AssertionError("unreachable")


def run_contenders(args: argparse.Namespace) -> int:
    if not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0):
        print("--contenders needs cores 0 and 1 (the servers on one, the clients on the "
              "other)", file=sys.stderr)
        return 2
    machine = machine_info()  # before pinning: the machine's cores, not the client's one
    os.sched_setaffinity(0, {1})  # the load generator: this process, on core 1
    levels = [int(level) for level in args.levels.split(",")]
    names = [name.strip() for name in args.servers.split(",")]
    share = wait_for_idle(60, log=print)
    with tempfile.TemporaryDirectory() as folder:
        model, _ = untrained_export(Path(folder), "digits")
        body = json.dumps(pixels_body()).encode()
        servers: dict[str, PinnedServer] = {}
        skipped: dict[str, str] = {}
        for name in names:
            port = free_port()
            found = contender_command(name, model, port, args)
            if isinstance(found, str):
                skipped[name] = found
                print(f"skipping {name}: {found}")
                continue
            servers[name] = PinnedServer(name, found[0], found[1], port, core=0)
        rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
            str(level): {name: [] for name in servers} for level in levels}
        try:
            for server in servers.values():
                server.wait_ready()
            answers = {name: json.loads(httpx.post(server.url + "/v1/predict",
                                                   content=body, timeout=30).content)
                       for name, server in servers.items()}
            predictions = {name: a["predictions"] for name, a in answers.items()}
            same = len({json.dumps(p, sort_keys=True) for p in predictions.values()}) == 1
            print(f"same answer from every server: {same}")
            for server in servers.values():
                server.signal(signal.SIGSTOP)
            order = list(servers)
            for number in range(args.rounds):
                turn = order[number % len(order):] + order[:number % len(order)]
                for level in levels:
                    for name in turn:
                        figures = measure_window(servers[name], body, level, args)
                        rounds[str(level)][name].append(figures)
                        print(f"round {number + 1} c={level:<3} {name:>14}: "
                              f"{figures['requests_per_s']:8.1f} req/s  p50 "
                              f"{figures['p50_ms']:7.2f} ms  p99 {figures['p99_ms']:7.2f} ms"
                              f"  errors {figures['errors']}  server core "
                              f"{figures['core_busy']['0']:.2f} client core "
                              f"{figures['core_busy']['1']:.2f}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    batch = {"batch": args.max_batch_size, "wait": args.max_wait_ms}
    labels = {name: CONTENDER_LABELS[name].format(**batch) for name in servers}
    runs = {level: {name: merge_level(r) for name, r in by_name.items()}
            for level, by_name in rounds.items()}
    table = contenders_table(runs, labels, levels)
    verdicts = []
    targets: dict[str, Any] = {}
    if "gpuflow" in servers:
        targets = contenders_targets(runs, levels)
        for level, t in targets["throughput"].items():
            if t["best"] is not None:
                verdicts.append(f"concurrency {level}: gpuflow {t['gpuflow']:,.0f} req/s vs "
                                f"best contender {t['best']} {t['best_requests_per_s']:,.0f} "
                                f"({t['ratio']:.2f}x): {'met' if t['met'] else 'not met'}")
        if "p50_at_1" in targets:
            t = targets["p50_at_1"]
            verdicts.append(f"concurrency 1 p50: gpuflow {t['gpuflow_ms']:.2f} ms vs plain "
                            f"{t['plain_ms']:.2f} ms ({t['difference_ms']:+.2f} ms, limit "
                            f"+1 ms): {'met' if t['met'] else 'not met'}")
    all_rounds = [r for by_name in rounds.values() for rs in by_name.values() for r in rs]
    result = {
        "benchmark": "serving_contenders",
        **provenance(fastapi=package_version("fastapi"), uvicorn=package_version("uvicorn"),
                     starlette=package_version("starlette"),
                     pydantic=package_version("pydantic"),
                     litserve=package_version("litserve"), uvloop=package_version("uvloop"),
                     httptools=package_version("httptools")),
        "model": "digits, untrained weights (one safetensors export, loaded by every server "
                 "through gpuflow.serve.engine)",
        "request": "POST /v1/predict {\"pixels\": 8x8 values in [0, 255]}: parse, decode, "
                   "normalise, forward, softmax, top-5 answer (gpuflow's digits codec)",
        "settings": {"levels": levels, "rounds": args.rounds, "requests": args.requests,
                     "warmup_s": args.warmup_s, "max_batch_size": args.max_batch_size,
                     "max_wait_ms": args.max_wait_ms, "threads": args.threads,
                     "server_core": 0, "client_core": 1, "quick": args.quick,
                     "foreign_limit": args.foreign_limit, "retries": args.retries,
                     "idle_servers": "paused (SIGSTOP) while another server is measured",
                     "client": "closed-loop raw HTTP/1.1 keep-alive connections, asyncio"},
        "servers": {name: {"label": labels[name], "command": s.command}
                    for name, s in servers.items()},
        "skipped": skipped,
        "same_answer": same,
        "runs": runs,
        "table": table,
        "targets": targets,
        "verdicts": verdicts,
        "all_targets_met": bool(targets) and all(
            t["met"] for t in targets["throughput"].values()) and targets.get(
            "p50_at_1", {"met": True})["met"],
        "machine": machine,
        "foreign_cpu_share_before": share,
        "max_foreign_cpu_share": max(r["foreign_cpu_share"] for r in all_rounds),
        "windows_measured_again": sum(r["dropped_for_foreign_load"] for r in all_rounds),
        "max_client_core_busy": max(r["core_busy"]["1"] for r in all_rounds),
        "load_average_1min": os.getloadavg()[0],
    }
    write_json(args.out, result)
    print("\n".join(["", *table, "", *verdicts, f"-> {args.out}"]))
    return 0


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
    parser.add_argument("--warmup-s", type=float,
                        help="default 2 (0.5 with --quick); with --contenders 1 (0.3)")
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 1 s (plus 0.5 s warm-up), 8 clients")
    parser.add_argument("--out", type=Path,
                        help="default benchmarks/results/serving[-textlm]-<machine>.json; "
                             "with --contenders serving-contenders-<machine>.json")
    contenders = parser.add_argument_group(
        "--contenders", "gpuflow serve against a plain FastAPI endpoint and LitServe (the "
        "digits CNN, servers pinned to core 0, these clients to core 1)")
    contenders.add_argument("--contenders", action="store_true",
                            help="run this comparison instead of the batching one")
    contenders.add_argument("--servers", default="fastapi_plain,litserve,gpuflow",
                            help="which servers, comma-separated, of fastapi_plain, "
                                 "litserve, litserve_zmq (LitServe's fast_queue) and gpuflow; "
                                 "one whose package is not installed is skipped, saying so")
    contenders.add_argument("--levels", default="1,8,32,64",
                            help="client concurrencies, comma-separated")
    contenders.add_argument("--requests", type=int, default=2000,
                            help="requests measured per server, level and round")
    contenders.add_argument("--foreign-limit", type=float, default=0.05,
                            help="share of the CPUs other processes may take during a "
                                 "window before it is measured again (default 0.05)")
    contenders.add_argument("--retries", type=int, default=3,
                            help="times a window is measured again for that (default 3)")
    args = parser.parse_args()
    if args.contenders:
        args.out = args.out or default_result_path("serving-contenders")
        if args.quick:
            args.rounds, args.levels, args.requests = 1, "1,8", 100
        if args.warmup_s is None:
            args.warmup_s = 0.3 if args.quick else 1.0
        torch.set_num_threads(args.threads)  # as the servers; machine_info records it
        return run_contenders(args)
    if args.out is None:
        suffix = "" if args.workload == "digits" else f"-{args.workload}"
        args.out = default_result_path(f"serving{suffix}")
    if args.warmup_s is None:
        args.warmup_s = 2.0
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
