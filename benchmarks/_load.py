"""Closed-loop load on OpenAI-compatible text servers: a contender (a server, a route, a
request body), timed streamed requests, and the figures of a measuring window.

A request's output tokens are the ``usage`` a server reports in its stream
(``stream_options.include_usage``) where it reports one, else what was asked for; its time
to first token is the first chunk with text, its inter-token latency the rest of its time
over the tokens after the first.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 120  # an answer later than this is an error (a server that stalls)


@dataclass(frozen=True)
class Contender:
    name: str
    url: str
    path: str
    body: dict[str, Any]
    streams: bool
    tokens: int  # asked for; what a request counts when the server reports no usage


@dataclass(frozen=True)
class Timed:
    first_s: float
    end_s: float
    tokens: int
    ok: bool


def metric_values(url: str, names: Iterable[str]) -> dict[str, float]:
    """The samples called ``names`` (unlabelled, e.g. ``gpuflow_engine_step_seconds_sum``)
    on a server's ``/metrics``; those it has not exported yet are left out."""
    wanted = set(names)
    return {line.split()[0]: float(line.split()[-1])
            for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
            if line.split(" ")[0] in wanted}


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else None


def _text(chunk: dict[str, Any]) -> str:
    """The text a completions or chat chunk carries."""
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


async def timed_request(client: httpx.AsyncClient, contender: Contender) -> Timed:
    """One request; a request the server drops or leaves unanswered past the client's
    timeout is an error."""
    start = time.perf_counter()
    first: float | None = None
    tokens = contender.tokens
    try:
        if not contender.streams:
            reply = await client.post(contender.path, json=contender.body)
            end = time.perf_counter() - start
            return Timed(end, end, tokens, reply.status_code == 200)
        async with client.stream("POST", contender.path, json=contender.body) as reply:
            ok = reply.status_code == 200
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and _text(chunk):
                    first = time.perf_counter() - start
                if isinstance(chunk.get("usage"), dict):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.TransportError:
        ok = False
    end = time.perf_counter() - start
    return Timed(first if first is not None else end, end, tokens, ok)


async def drive(contender: Contender, concurrency: int, warmup_s: float,
                window_s: float) -> dict[str, Any]:
    """Closed loop. The requests sent inside the window count, and every client sends at
    least one there, so that a server slower than the window is measured too: output tokens
    per second over the time from the first counted request's start to the last's end."""
    timed: list[Timed] = []
    spans: list[tuple[float, float]] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=contender.url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        start = time.perf_counter()
        window_start, window_end = start + warmup_s, start + warmup_s + window_s

        async def client_loop() -> None:
            nonlocal errors
            counted = 0
            while (sent := time.perf_counter()) < window_end or not counted:
                result = await timed_request(client, contender)
                if sent < window_start:
                    continue
                counted += 1
                errors += not result.ok
                if result.ok:
                    timed.append(result)
                    spans.append((sent, sent + result.end_s))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    elapsed = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else None
    firsts = [t.first_s for t in timed]
    gaps = [(t.end_s - t.first_s) / (t.tokens - 1) for t in timed if t.tokens > 1]
    return {
        "requests": len(timed), "errors": errors, "elapsed_s": elapsed,
        "output_tokens": sum(t.tokens for t in timed),
        "tokens_per_s": sum(t.tokens for t in timed) / elapsed if elapsed else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(firsts) if firsts else None,
        "ttft_p99_ms": 1000 * percentile(firsts, 0.99) if firsts else None,
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
    }


def together(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows of ``drive`` run side by side, as one: their tokens over the longest one's
    time, their errors summed."""
    elapsed = max(part["elapsed_s"] or 0 for part in parts)
    total = sum(part["output_tokens"] for part in parts)
    return {"output_tokens": total, "elapsed_s": elapsed,
            "tokens_per_s": total / elapsed if elapsed else 0.0,
            "errors": sum(part["errors"] for part in parts)}


FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, the errors summed, the rounds kept."""
    return {"errors": sum(r["errors"] for r in rounds),
            **{key: statistics.median(values) if (values := [r[key] for r in rounds
                                                               if r[key] is not None])
               else None for key in FIGURES},
            "rounds": rounds}


def start(command: list[str], url: str, ready_path: str, env: dict[str, str],
          timeout: float = 180, cores: set[int] | None = None) -> subprocess.Popen[bytes]:
    """A server process, once ``ready_path`` answers 200; on ``cores`` only, when given."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=env, preexec_fn=pin)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"{' '.join(command)} not ready after {timeout} s")


