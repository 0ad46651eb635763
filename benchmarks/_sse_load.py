"""A lean streaming load for /v1/completions: closed-loop clients over raw asyncio HTTP/1.1
keep-alive connections, reading server-sent events, so that the client costs far less CPU
per token than the server it measures (an httpx client costs about as much as the server).

Run as its own process, so its CPU time is its own:

    python benchmarks/_sse_load.py PORT CONCURRENCY SECONDS MAX_TOKENS

prints one JSON line: requests finished, streamed chunks holding text, the seconds
measured, and the time to first chunk and between chunks, p50.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

PROMPT = "The Python interpreter reads a program text and splits it into tokens"


async def _client(port: int, request: bytes, until: float, found: dict[str, list[float]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.perf_counter() < until:
        sent = time.perf_counter()
        writer.write(request)
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        arrivals = []
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            chunk = await reader.readexactly(size + 2)
            texts = chunk.count(b'"text": "') - chunk.count(b'"text": ""')
            arrivals += [time.perf_counter()] * texts
        await reader.readline()  # the empty chunk's closing line
        if arrivals:
            found["first"].append(arrivals[0] - sent)
            found["gaps"] += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
            found["chunks"].append(len(arrivals))
    writer.close()


async def load(port: int, concurrency: int, seconds: float, max_tokens: int) -> dict[str, float]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    found: dict[str, list[float]] = {"first": [], "gaps": [], "chunks": []}
    start = time.perf_counter()
    await asyncio.gather(*(_client(port, request, start + seconds, found)
                           for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"requests": len(found["chunks"]), "chunks": sum(found["chunks"]),
            "elapsed_s": elapsed, "chunks_per_s": sum(found["chunks"]) / elapsed,
            "ttft_p50_ms": 1000 * statistics.median(found["first"]),
            "itl_p50_ms": 1000 * statistics.median(found["gaps"]) if found["gaps"] else None}


if __name__ == "__main__":
    port, concurrency, seconds, max_tokens = sys.argv[1:5]
    print(json.dumps(asyncio.run(load(int(port), int(concurrency), float(seconds),
                                      int(max_tokens)))))
