"""Text generation load test, side by side on the same weights: gpuflow's engine
(/v1/completions: KV cache, continuous batching), gpuflow's no-cache path (/v1/predict:
every byte re-runs the whole prefix, one batch at a time), gpuflow serving the model's
Hugging Face export (the engine's path for transformers models: the export's
GPT2LMHeadModel with gpuflow's slot cache), when it starts here,
`transformers serve --continuous-batching` on that same export (it needs `pip install
accelerate` beside gpuflow[hf]) and, where vLLM is installed, vLLM's OpenAI server on that
export too. A contender that cannot run here is named in the run's notes, and the run goes on
without it.

textlm's GPT (tiny unless `--model-size` says otherwise; untrained: the cost of generating
does not depend on the weights) is served by each contender on a free loopback port, every
server with one torch thread.
Closed-loop clients ask for the same greedy completion of the same prompt at each
concurrency, the contenders taking turns round by round so that a change in machine load
hits all of them, and each window waiting (up to a minute) for the CPUs to go idle first,
so that no server's leftover work lands on the next one's figures. Per contender and
concurrency: output tokens per second, time to first token (the first streamed text; the
whole answer for /v1/predict, which does not stream) and each request's mean inter-token
latency, p50 and p99, and errors.

    .venv/bin/python benchmarks/generation.py              # a few minutes
    .venv/bin/python benchmarks/generation.py --quick      # seconds
    python benchmarks/generation.py --device cuda --precision bf16 --cuda-graphs
        # on a GPU: decode steps replayed as CUDA graphs per batch bucket
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    default_result_path,
    machine_info,
    package_version,
    provenance,
    wait_for_idle,
    write_json,
)
from serving import free_port, untrained_export  # noqa: E402

REQUEST_TIMEOUT_S = 120  # an answer later than this is an error (a server that stalls)
QUIET_SHARE = 0.05  # a machine is quiet when other processes use under 5% of the CPUs
# Every contender takes a string prompt (transformers serve takes nothing else).
PROMPT_TEXT = ("The Python interpreter reads a program text, splits it into tokens and "
               "builds a tree of the statements it finds; ") * 4


@dataclass(frozen=True)
class Contender:
    name: str
    url: str
    path: str
    body: dict[str, Any]
    streams: bool


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else None


async def timed_request(client: httpx.AsyncClient, contender: Contender
                        ) -> tuple[float, float, bool]:
    """(seconds to the first text, seconds to the end, ok) of one request; a request the
    server drops or leaves unanswered past the client's timeout is an error."""
    start = time.perf_counter()
    first: float | None = None
    try:
        if not contender.streams:
            reply = await client.post(contender.path, json=contender.body)
            end = time.perf_counter() - start
            return end, end, reply.status_code == 200
        async with client.stream("POST", contender.path, json=contender.body) as reply:
            ok = reply.status_code == 200
            async for line in reply.aiter_lines():
                if first is None and line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("text"):
                        first = time.perf_counter() - start
    except httpx.TransportError:
        ok = False
    end = time.perf_counter() - start
    return (first if first is not None else end), end, ok


async def drive(contender: Contender, concurrency: int, tokens: int, warmup_s: float,
                window_s: float) -> dict[str, Any]:
    """Closed loop. The requests sent inside the window count, and every client sends at
    least one there, so that a server slower than the window is measured too: output tokens
    per second over the time from the first counted request's start to the last's end."""
    firsts: list[float] = []
    gaps: list[float] = []
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
                first, end, ok = await timed_request(client, contender)
                if sent < window_start:
                    continue
                counted += 1
                errors += not ok
                if ok:
                    firsts.append(first)
                    gaps.append((end - first) / (tokens - 1))
                    spans.append((sent, sent + end))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    elapsed = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else None
    return {
        "requests": len(firsts), "errors": errors, "elapsed_s": elapsed,
        "tokens_per_s": len(firsts) * tokens / elapsed if elapsed else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(firsts) if firsts else None,
        "ttft_p99_ms": 1000 * percentile(firsts, 0.99) if firsts else None,
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
    }


def start(command: list[str], url: str, ready_path: str, env: dict[str, str],
          timeout: float = 180) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=env)
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


def hf_export(model_file: Path, folder: Path) -> Path:
    """The same weights as `gpuflow export --format hf` writes them: a GPT2LMHeadModel
    directory, which `transformers serve`, vLLM and `gpuflow serve` read. The model is the
    one ``model_file``'s metadata describes, as `gpuflow serve` rebuilds it."""
    from gpuflow.export import write_hf_export
    from gpuflow.serve.model import read_source, restore_workload

    config, weights, step, serving = read_source(model_file)
    out = folder / "hf"
    write_hf_export(restore_workload(config, weights, model_file), config, step, out, serving)
    return out


def serve_command(source: Path, port: int, levels: list[int],
                  args: argparse.Namespace) -> list[str]:
    """`gpuflow serve` of ``source`` on one torch thread, its queue deep enough for every
    client and its deadline past any completion."""
    return [sys.executable, "-m", "gpuflow.cli", "serve", str(source), "--port", str(port),
            "--max-batch-size", str(args.max_batch_size), "--max-queue", str(4 * max(levels)),
            "--threads", "1", "--timeout-ms", "60000", "--device", args.device,
            "--precision", args.precision, *(["--compile"] if args.compile else []),
            *(["--cuda-graphs"] if args.cuda_graphs else []), "--log-level", "warning"]


def vllm_command(hf_dir: Path, port: int, levels: list[int],
                 args: argparse.Namespace) -> list[str]:
    """vLLM's OpenAI server on the export, in gpuflow's precision, with room for every client;
    it shares the GPU with gpuflow's server, whose KV cache takes half the free memory."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.precision]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-num-seqs", str(max(levels)), "--gpu-memory-utilization", "0.3"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default=None,
                        help="textlm --model-size of the served model (default tiny)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="comma-separated client counts (default 1,8,32)")
    parser.add_argument("--tokens", type=int, default=64, help="bytes generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--device", default="auto",
                        help="gpuflow serve --device (default auto)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="gpuflow serve --precision (default fp32)")
    parser.add_argument("--compile", action="store_true",
                        help="gpuflow serve --compile: decode steps compiled per batch bucket")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="gpuflow serve --cuda-graphs: decode steps replayed as CUDA "
                             "graphs (CUDA only)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave `transformers serve` out")
    parser.add_argument("--no-hf", action="store_true",
                        help="leave out `gpuflow serve` of the Hugging Face export (the "
                             "engine's transformers path)")
    parser.add_argument("--quiet-wait-s", type=float, default=60.0,
                        help="before each window, wait up to this long for the CPUs to go "
                             "idle (0: do not wait)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 1 s at 4 clients, 16 tokens, no transformers serve")
    parser.add_argument("--out", type=Path,
                        help="default benchmarks/results/generation-<machine>.json")
    args = parser.parse_args()
    args.out = args.out or default_result_path("generation")
    if args.quick:
        args.rounds, args.warmup_s, args.window_s, args.concurrency = 1, 0.5, 1.0, "4"
        args.quiet_wait_s = 0.0
        args.tokens, args.no_transformers = 16, True
    levels = [int(level) for level in args.concurrency.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes: list[subprocess.Popen[bytes]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model_file, _ = untrained_export(folder, "textlm", args.model_size)
        prompt = PROMPT_TEXT[: args.prompt_tokens]  # ASCII: one byte, one token
        greedy = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0.0}
        try:
            port = free_port()
            gpuflow_url = f"http://127.0.0.1:{port}"
            compiling = args.compile or args.cuda_graphs
            processes.append(start(serve_command(model_file, port, levels, args), gpuflow_url,
                                   "/readyz", env, timeout=600 if compiling else 180))
            ready = httpx.get(gpuflow_url + "/readyz", timeout=10).json()
            gpuflow_ready = {"runs_on": ready["runs_on"],
                             "decode": ready["generation"]["decode"],
                             "warmup_s": ready["warmup_s"],
                             "decode_warmup_s": ready["generation"]["warmup_s"]}
            contenders = [
                Contender("gpuflow", gpuflow_url, "/v1/completions",
                          {**greedy, "stream": True}, True),
                Contender("gpuflow no cache", gpuflow_url, "/v1/predict",
                          {"text": prompt, "max_new_tokens": args.tokens,
                           "temperature": 0.0}, False)]
            hf_dir = hf_export(model_file, folder)
            if not args.no_hf:
                port = free_port()
                hf_gpuflow_url = f"http://127.0.0.1:{port}"
                processes.append(start(serve_command(hf_dir, port, levels, args),
                                       hf_gpuflow_url, "/readyz", env,
                                       timeout=600 if compiling else 180))
                contenders.append(Contender("gpuflow, HF export", hf_gpuflow_url,
                                            "/v1/completions", {**greedy, "stream": True},
                                            True))
            executable = shutil.which("transformers", path=str(Path(sys.executable).parent))
            if not args.no_transformers and executable:
                port = free_port()
                hf_url = f"http://127.0.0.1:{port}"
                try:
                    processes.append(start(
                        [executable, "serve", str(hf_dir), "--continuous-batching",
                         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
                        hf_url, "/health", env))
                    contenders.append(Contender(
                        "transformers serve", hf_url, "/v1/completions",
                        {**greedy, "model": str(hf_dir), "stream": True}, True))
                except RuntimeError as exc:
                    notes.append(f"transformers serve did not start: {exc}")
            if not args.no_vllm and importlib.util.find_spec("vllm") is None:
                notes.append("vLLM is not installed here: no vLLM contender")
            elif not args.no_vllm:
                port = free_port()
                vllm_url = f"http://127.0.0.1:{port}"
                try:
                    processes.append(start(vllm_command(hf_dir, port, levels, args), vllm_url,
                                           "/health", env, timeout=600))
                    # An untrained model may sample its end token early; every contender
                    # must generate all the tokens the figures count.
                    contenders.append(Contender(
                        "vllm", vllm_url, "/v1/completions",
                        {**greedy, "model": str(hf_dir), "stream": True, "ignore_eos": True},
                        True))
                except RuntimeError as exc:
                    notes.append(f"vLLM did not start: {exc}")
            results: dict[str, dict[str, list[dict[str, Any]]]] = {
                c.name: {str(level): [] for level in levels} for c in contenders}
            for number in range(args.rounds):
                for level in levels:
                    for contender in contenders:
                        # A server still generating for requests its clients dropped (as a
                        # stalled contender does) would slow the next one measured.
                        quiet = (wait_for_idle(args.quiet_wait_s, threshold=QUIET_SHARE,
                                               log=print) if args.quiet_wait_s else None)
                        figures = asyncio.run(drive(contender, level, args.tokens,
                                                    args.warmup_s, args.window_s))
                        figures["foreign_cpu_share_before"] = quiet
                        results[contender.name][str(level)].append(figures)
                        print(f"round {number + 1} c{level:<3} {contender.name:>18}: "
                              f"{figures['tokens_per_s']:8.1f} tok/s  ttft p50 "
                              f"{figures['ttft_p50_ms'] or 0:8.1f} ms  itl p50 "
                              f"{figures['itl_p50_ms'] or 0:6.2f} ms  errors "
                              f"{figures['errors']}", flush=True)
        finally:
            for process in processes:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    runs = {name: {level: {"errors": sum(r["errors"] for r in rounds),
                           **{key: statistics.median(r[key] for r in rounds
                                                     if r[key] is not None) for key in keys},
                           "rounds": rounds}
                   for level, rounds in by_level.items()}
            for name, by_level in results.items()}
    write_json(args.out, {
        "benchmark": "generation",
        **provenance(transformers=package_version("transformers"),
                     fastapi=package_version("fastapi"), uvicorn=package_version("uvicorn"),
                     uvloop=package_version("uvloop"), httptools=package_version("httptools")),
        "model": f"textlm {args.model_size or 'tiny (4 x 128, 128 context)'}, untrained weights",
        "settings": {k: getattr(args, k) for k in (
            "concurrency", "tokens", "prompt_tokens", "max_batch_size", "rounds", "warmup_s",
            "window_s", "quiet_wait_s", "quick", "device", "precision", "compile", "cuda_graphs")},
        "gpuflow_runs_on": gpuflow_ready,
        "runs": runs,
        "notes": notes,
        "machine": machine_info(),
    })
    for level in map(str, levels):
        line = ", ".join(f"{name} {by_level[level]['tokens_per_s']:.0f}"
                         for name, by_level in runs.items())
        print(f"c{level}: output tokens/s: {line}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
