"""The generation engine's memory and scheduling, each feature on against off, side by side.

Three scenarios, each run against two `gpuflow serve` processes on the same weights that
differ in one setting, taking turns round by round (median of the rounds), the server on
core 0 (one torch thread) and the clients on the others:

- ``prefix``: 32 closed-loop clients whose prompts share a ~1,000-token system prompt and
  end in a few tokens of their own; time to first token with prefix caching (the default)
  against ``--no-prefix-cache``. Target: TTFT p50 >= 5x lower with it.
- ``chunked``: 16 streams generating long answers while a client sends a ~2,000-token
  prompt every second; the streams' gaps between tokens, every gap counted (not a
  request's mean), with ``--max-num-batched-tokens`` at ``--chunk-tokens`` (a long prompt
  is prefilled that many tokens a step, between the streams' decode tokens) against a
  budget that takes the whole prompt in one step. Target: ITL p99 <= 3x p50 with
  chunking; stated without. The longest gap is stated too: p99 hides a stall that hits
  fewer than 1% of the gaps, as a whole prompt prefilled in one step does.
- ``capacity``: the same ``--kv-cache-gib``, 64 clients with short chats (64 + 64 tokens):
  the most sequences running at once (``gpuflow_active_sequences`` sampled from /metrics
  every 50 ms) against the sequences a cache of whole-context slots of that size holds
  (the engine's design before paging: the budget over one sequence's full context).
  Target: >= 3x.

Models (``--model``, ``kv_models.py``): textlm ``layers=4,dim=256,heads=8,seq=4096`` (the
default; a byte a token) or ``hub-llama``, a Llama-architecture directory with a 4,096-token
context, grouped-query attention and a 4,096-id BPE tokenizer; both untrained (the cost of
generating does not depend on the weights; every request sets ``ignore_eos`` so it
generates all it asks for), their heads limited to tokens that stream as text at once;
prompts of ASCII prose, sized in the model's tokens.

    .venv/bin/python benchmarks/kv_paging.py                 # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/kv_paging.py --quick         # a minute
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    default_result_path,
    machine_info,
    provenance,
    stop,
    usable_cores,
    wait_for_idle,
    write_json,
)
from _load import percentile, start  # noqa: E402
from kv_models import MODELS, ServedModel  # noqa: E402
from serving import free_port  # noqa: E402

ARGS: argparse.Namespace  # the command line, parsed once in __main__
SERVED: ServedModel  # the model the servers serve, made once in main
QUIET_SHARE = 0.05
SLOTS = 8  # the default KV budget, in sequences of the whole context


def serve_command(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
            "--threads", "1", "--max-queue", "4096", "--log-level", "warning", *extra]


class Stream:
    """One streamed completion's arrival times: when it was sent, and each text chunk."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.arrivals: list[float] = []
        self.ok = False
        self.error: str | None = None  # why it failed: a status and body, or an exception

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> Stream:
    """POST a streamed completion and time its chunks."""
    timed = Stream()
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}
                                 ) as reply:
            async for line in reply.aiter_lines():
                event = json.loads(line[6:]) if line.startswith("data: {") else {}
                if "error" in event or reply.status_code != 200:
                    timed.error = f"{reply.status_code}: {line[:300]}"
                elif event and event["choices"][0]["text"]:
                    timed.arrivals.append(time.perf_counter())
            timed.ok = reply.status_code == 200 and timed.error is None
    except httpx.TransportError as exc:
        timed.error = repr(exc)
    return timed


async def closed_loop(url: str, clients: int, body_of: Callable[[int], dict[str, Any]],
                      seconds: float, warmup_s: float) -> list[Stream]:
    """``clients`` loops sending ``body_of(n)`` (``n`` counts requests); the requests sent
    after the warm-up and before the end count, and each client sends at least one after
    the warm-up, so that a server slower than the window is measured too."""
    counter = itertools.count()
    kept: list[Stream] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        begin = time.perf_counter()

        async def loop() -> None:
            counted = 0
            while (now := time.perf_counter()) < begin + warmup_s + seconds or not counted:
                timed = await stream(client, body_of(next(counter)))
                if now >= begin + warmup_s:
                    kept.append(timed)
                    counted += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    return kept


def summary(streams: list[Stream]) -> dict[str, Any]:
    ok = [s for s in streams if s.ok]
    firsts = [s.ttft_s for s in ok if s.ttft_s is not None]
    gaps = [gap for s in ok for gap in s.gaps_s()]
    failures = [s.error for s in streams if not s.ok]
    return {"requests": len(ok), "errors": len(failures), "first_errors": failures[:3],
            "ttft_p50_ms": 1000 * statistics.median(firsts) if firsts else None,
            "ttft_p99_ms": 1000 * percentile(firsts, 0.99) if firsts else None,
            "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
            "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
            "itl_max_ms": 1000 * max(gaps) if gaps else None}


# --- the scenarios: each a pair of server settings and a load ------------------------------

def prefix_load(url: str) -> dict[str, Any]:
    system = SERVED.prompt(ARGS.system_tokens)

    def body(n: int) -> dict[str, Any]:
        return {"prompt": f"{system}\nQuestion {n}: why?", "max_tokens": 16,
                "temperature": 0.0, "ignore_eos": True}

    return summary(asyncio.run(closed_loop(url, 32, body, ARGS.window_s, ARGS.warmup_s)))


async def _chunked(url: str) -> dict[str, Any]:
    """16 long streams, and one long prompt a second beside them."""
    streams_body = {"prompt": SERVED.prompt(32), "max_tokens": ARGS.stream_tokens,
                    "temperature": 0.0, "ignore_eos": True}
    long_prompts: list[Stream] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        streams = [asyncio.create_task(stream(client, streams_body)) for _ in range(16)]
        await asyncio.sleep(ARGS.warmup_s)
        for n in range(ARGS.long_prompts):
            body = {"prompt": SERVED.prompt(ARGS.long_prompt_tokens, offset=n), "max_tokens": 1,
                    "temperature": 0.0, "ignore_eos": True}
            long_prompts.append(await stream(client, body))
            await asyncio.sleep(1.0)
        done = await asyncio.gather(*streams)
    return {"streams": summary(done), "long_prompts": summary(long_prompts)}


def chunked_load(url: str) -> dict[str, Any]:
    return asyncio.run(_chunked(url))


async def _capacity(url: str) -> dict[str, Any]:
    """64 closed-loop clients; /metrics sampled every 50 ms until the last answer."""
    body = {"prompt": SERVED.prompt(64), "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    peak = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=600) as monitor:
        async def watch() -> None:
            nonlocal peak
            while True:
                text = (await monitor.get("/metrics")).text
                for line in text.splitlines():
                    if line.startswith("gpuflow_active_sequences "):
                        peak = max(peak, float(line.split()[1]))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        streams = await closed_loop(url, 64, lambda n: body, ARGS.window_s, ARGS.warmup_s)
        watcher.cancel()
    return {"peak_active_sequences": peak, **summary(streams)}


def capacity_load(url: str) -> dict[str, Any]:
    return asyncio.run(_capacity(url))


def slot_capacity() -> int:
    """Sequences a cache of whole-context slots holds in ``--kv-cache-gib``: what the engine
    admitted before paging (the budget over one sequence's keys and values at full length)."""
    return int(ARGS.kv_cache_gib * 2**30) // (SERVED.kv_bytes_per_token * SERVED.context)


SCENARIOS: dict[str, tuple[dict[str, list[str]], Callable[[str], dict[str, Any]]]] = {
    "prefix": ({"prefix cache": [], "no prefix cache": ["--no-prefix-cache"]}, prefix_load),
    "chunked": ({"chunked": ["--max-num-batched-tokens", "CHUNK"],
                 "whole prompts": ["--max-num-batched-tokens", "4096"]}, chunked_load),
    "capacity": ({"paged": ["--max-batch-size", "64"]}, capacity_load),
}


def run_scenario(name: str, model: Path, env: dict[str, str],
                 cores: set[int] | None) -> dict[str, Any]:
    settings, load = SCENARIOS[name]
    extra = ["--kv-cache-gib", str(ARGS.kv_cache_gib)]
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in settings}
    for number in range(ARGS.rounds):
        for label, flags in settings.items():
            url = f"http://127.0.0.1:{free_port()}"
            port = url.rsplit(":", 1)[1]
            flags = [str(ARGS.chunk_tokens) if flag == "CHUNK" else flag for flag in flags]
            process = start(serve_command(model, int(port), *extra, *flags), url, "/readyz",
                            env=env, timeout=300, cores=cores)
            try:
                quiet = wait_for_idle(ARGS.quiet_wait_s, threshold=QUIET_SHARE, log=print) \
                    if ARGS.quiet_wait_s else None
                figures = load(url) | {"foreign_cpu_share_before": quiet}
            finally:
                stop([process])
            rounds[label].append(figures)
            print(f"round {number + 1} {name} {label}: {json.dumps(figures)}", flush=True)
    return {label: {"median": _median(runs), "rounds": runs} for label, runs in rounds.items()}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the rounds (nested dicts too), lists joined."""
    merged: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            merged[key] = _median([run[key] for run in runs])
        elif isinstance(value, list):  # the rounds' errors, all of them
            merged[key] = [item for run in runs for item in run[key]]
        else:
            values = [run[key] for run in runs if run[key] is not None]
            merged[key] = statistics.median(values) if values else None
    return merged


def verdicts(results: dict[str, Any], slots: int) -> dict[str, Any]:
    """The issue's targets, judged from the medians."""
    out: dict[str, Any] = {}
    if "prefix" in results:
        on, off = (results["prefix"][k]["median"]["ttft_p50_ms"]
                   for k in ("prefix cache", "no prefix cache"))
        out["prefix: TTFT p50 without / with"] = {
            "ratio": off / on if on and off else None, "target_min": 5.0}
    if "chunked" in results:
        for label in ("chunked", "whole prompts"):
            streams = results["chunked"][label]["median"]["streams"]
            p50, p99 = streams["itl_p50_ms"], streams["itl_p99_ms"]
            out[f"chunked: streams' ITL p99 / p50, {label}"] = {
                "ratio": p99 / p50 if p50 and p99 else None, "itl_p50_ms": p50,
                "itl_p99_ms": p99, "itl_max_ms": streams["itl_max_ms"],
                "target_max": 3.0 if label == "chunked" else None}
    if "capacity" in results:
        peak = results["capacity"]["paged"]["median"]["peak_active_sequences"]
        out["capacity: running sequences / whole-context slots"] = {
            "peak_active_sequences": peak, "slots": slots,
            "ratio": peak / slots if slots else None, "target_min": 3.0}
    return out


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", choices=sorted(MODELS), default="textlm")
    add("--scenarios", default="prefix,chunked,capacity")
    add("--rounds", type=int, default=3)
    add("--warmup-s", type=float, default=3.0)
    add("--window-s", type=float, default=15.0)
    add("--kv-cache-gib", type=float,
        help=f"every server's KV budget (default: {SLOTS} whole-context slots of the model, "
             "0.25 for textlm)")
    add("--system-tokens", type=int, default=1000)
    add("--long-prompt-tokens", type=int, default=2000)
    add("--long-prompts", type=int, default=8, help="chunked: long prompts sent, one a second")
    add("--stream-tokens", type=int, default=512, help="chunked: tokens each stream generates")
    add("--chunk-tokens", type=int, default=256,
        help="chunked: --max-num-batched-tokens of the chunking server (default 256)")
    add("--quiet-wait-s", type=float, default=30.0)
    add("--quick", action="store_true", help="1 round, short windows")
    add("--out", type=Path, help="default benchmarks/results/kv_paging-<machine>.json")
    args = parser.parse_args()
    args.out = args.out or default_result_path(
        "kv_paging" if args.model == "textlm" else f"kv_paging-{args.model}")
    if args.quick:
        args.rounds, args.warmup_s, args.window_s, args.quiet_wait_s = 1, 1.0, 4.0, 0.0
        args.long_prompts, args.stream_tokens = 3, 128
    args.scenarios = args.scenarios.split(",")
    return args


def main() -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    machine = machine_info()
    cores = usable_cores()
    server_cores = {0} if cores >= 2 else None
    if server_cores:
        os.sched_setaffinity(0, set(range(1, cores)))
    global SERVED
    with tempfile.TemporaryDirectory() as scratch:
        SERVED = MODELS[ARGS.model](Path(scratch))
        if ARGS.kv_cache_gib is None:
            ARGS.kv_cache_gib = SLOTS * SERVED.kv_bytes_per_token * SERVED.context / 2**30
        results = {name: run_scenario(name, SERVED.path, env, server_cores)
                   for name in ARGS.scenarios}
    slots = slot_capacity()
    judged = verdicts(results, slots)
    write_json(ARGS.out, {
        "benchmark": "kv_paging", **provenance(),
        "model": SERVED.about,
        "settings": {k: getattr(ARGS, k) for k in (
            "model", "scenarios", "rounds", "warmup_s", "window_s", "kv_cache_gib", "system_tokens",
            "long_prompt_tokens", "long_prompts", "stream_tokens", "chunk_tokens", "quiet_wait_s",
            "quick")}
        | {"server_cores": sorted(server_cores or [])},
        "results": results, "targets": judged, "machine": machine})
    print(json.dumps(judged, indent=2))
    print(f"-> {ARGS.out}")
    return 0


if __name__ == "__main__":
    ARGS = parse()
    sys.exit(main())
