"""Many LoRA adapters served from one base (issue 52): tokens/s of 8 adapters mixed against
the base model alone, at the same concurrency, on the same server.

SmolLM2-135M-Instruct (``real_model.py``'s directory, float32) served by `gpuflow serve DIR
--lora a0=... a7=... --max-loras 8` on one torch thread (on core 0 where the machine has
two cores or more, the clients on the others, as ``generation.py`` runs). The 8 adapters are
PEFT's own files, rank 16 on every linear layer of the decoder (``all-linear``), with random
weights (the cost of serving an adapter does not depend on what it learned). Closed-loop
streaming clients on ``/v1/completions`` ask for ``--tokens`` tokens each (``ignore_eos``)
after a real text's prompt: one window where every client names the base, one where client
``i`` names adapter ``i % 8``, taking turns round by round, each after the CPUs go quiet; the
median of the rounds. A window counts the requests sent in it, whole (each client sends
many: a request of 32 tokens at 32 clients takes a few seconds on 2 cores). Each window also
records the engine's steps from ``/metrics`` (their count and mean time: the step's cost
beside the clients'). Target: the mixed window at >= 0.8x the base's tokens/s.

    .venv/bin/python benchmarks/lora_serving.py             # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/lora_serving.py --quick     # seconds, the stub model
    python benchmarks/lora_serving.py --device cuda --precision bf16   # the GPU stage
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the stub's tokenizer
from _common import (  # noqa: E402
    default_result_path,
    machine_info,
    package_version,
    provenance,
    stop,
    usable_cores,
    wait_for_idle,
    write_json,
)
from _load import Contender, drive, metric_values, start, together  # noqa: E402
from host_ceiling import stub_directory  # noqa: E402
from serving import free_port  # noqa: E402

TARGET = 0.8  # the mixed window's tokens/s over the base's
STEPS = ("gpuflow_engine_step_seconds_sum", "gpuflow_engine_step_seconds_count")
PROMPT = ("The Python interpreter reads a program text and splits it into tokens, which the "
          "parser turns into a tree; the compiler then walks the tree and emits bytecode for "
          "the virtual machine, one code object for each function, class body and module.")


def write_adapters(base: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``base``, rank ``rank`` on all its decoder's linear layers,
    random weights (seeded), each in a directory of its own."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                             init_lora_weights=False)
    paths = []
    for index in range(count):
        torch.manual_seed(index)
        wrapped = peft.get_peft_model(model, config)
        wrapped.save_pretrained(out / f"a{index}")
        model = wrapped.unload()  # the base as it was, for the next adapter
        paths.append(out / f"a{index}")
    return paths


def served(model: Path, adapters: list[Path], args: argparse.Namespace,
           cores: set[int] | None) -> tuple[Any, str]:
    port = free_port()
    command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
               "--served-model-name", "base", "--max-batch-size", str(args.clients),
               "--max-queue", str(4 * args.clients), "--threads", "1", "--timeout-ms", "60000",
               "--device", args.device, "--precision", args.precision,
               "--lora", *(f"a{i}={path}" for i, path in enumerate(adapters)),
               "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
               "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return start(command, url, "/readyz", env, timeout=600, cores=cores), url


def contender(url: str, model: str, tokens: int) -> Contender:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return Contender(model, url, "/v1/completions", body, True, tokens)


async def window(url: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One window: ``args.clients`` clients, client ``i`` naming ``names[i % len(names)]``."""
    groups = [sum(1 for i in range(args.clients) if i % len(names) == k)
              for k in range(len(names))]
    parts = await asyncio.gather(*(drive(contender(url, name, args.tokens), clients,
                                         args.warmup, args.seconds)
                                   for name, clients in zip(names, groups, strict=True)
                                   if clients))
    return {**together(list(parts)),
            "ttft_p50_ms": statistics.median(p["ttft_p50_ms"] for p in parts
                                             if p["ttft_p50_ms"] is not None),
            "itl_p50_ms": statistics.median(p["itl_p50_ms"] for p in parts
                                            if p["itl_p50_ms"] is not None)}


def steps(url: str) -> tuple[float, float]:
    found = metric_values(url, STEPS)
    return found.get(STEPS[0], 0.0), found.get(STEPS[1], 0.0)


def measure(url: str, adapters: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of the base window and the mixed one, in turn; medians and their ratio."""
    windows = {"base": ["base"], "mixed": [f"a{i}" for i in range(adapters)]}
    rounds = []
    for index in range(args.rounds):
        one: dict[str, Any] = {}
        for name, names in windows.items():
            if args.idle_wait > 0:
                wait_for_idle(args.idle_wait, threshold=0.1)
            (before_s, before_n) = steps(url)
            one[name] = asyncio.run(window(url, names, args))
            after_s, after_n = steps(url)
            count = after_n - before_n
            one[name]["engine"] = {"steps": count, "mean_step_ms":
                                   1000 * (after_s - before_s) / count if count else None}
            print(f"round {index}: {name} {one[name]['tokens_per_s']:.1f} tok/s", flush=True)
        one["ratio"] = one["mixed"]["tokens_per_s"] / one["base"]["tokens_per_s"]
        rounds.append(one)
    ratio = statistics.median(r["ratio"] for r in rounds)
    step_ms = {name: statistics.median(r[name]["engine"]["mean_step_ms"] or 0 for r in rounds)
               for name in windows}
    return {"rounds": rounds, "ratio_median": ratio,
            "tokens_per_s": {name: statistics.median(r[name]["tokens_per_s"] for r in rounds)
                             for name in windows},
            "mean_step_ms": step_ms,
            "step_ms_ratio": step_ms["mixed"] / step_ms["base"] if step_ms["base"] else None,
            "target": {"value": ratio, "target": TARGET, "met": ratio >= TARGET}}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--idle-wait", type=float, default=30.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--quick", action="store_true",
                        help="the stub model, 2 adapters, 4 clients, one round of 1 s")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.adapters, args.clients, args.tokens, args.rounds = 2, 4, 8, 1
        args.seconds, args.warmup, args.idle_wait = 1.0, 0.3, 0.0
    return args


def main() -> int:
    args = parse()
    machine = machine_info()  # before the clients are moved off the server's core
    out = args.out or default_result_path("lora_serving")  # named after every core
    cores = usable_cores()
    server_cores = {0} if cores >= 2 and not args.device.startswith("cuda") else None
    if server_cores:
        os.sched_setaffinity(0, set(range(1, cores)))
    with tempfile.TemporaryDirectory(prefix="lora-serving-") as scratch:
        if args.quick:
            model, name = stub_directory(Path(scratch)), "Llama, 1 layer, width 32 (stub)"
        else:
            from real_model import smollm2_directory

            model, name = smollm2_directory(), "SmolLM2-135M-Instruct, float32"
        adapters = write_adapters(model, Path(scratch) / "adapters", args.adapters, args.rank)
        process, url = served(model, adapters, args, server_cores)
        try:
            found = measure(url, len(adapters), args)
        finally:
            stop([process])
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else machine["cpu_model"])
    write_json(out, {**provenance(peft=package_version("peft")), "machine": machine,
                     "device_name": device_name, "model": name, "quick": args.quick,
                     "settings": {key: getattr(args, key) for key in (
                         "adapters", "rank", "clients", "tokens", "rounds", "seconds", "warmup",
                         "device", "precision")} | {"server_cores": sorted(server_cores or [])},
                     **found})
    print(f"base {found['tokens_per_s']['base']:.1f} tok/s, {args.adapters} adapters mixed "
          f"{found['tokens_per_s']['mixed']:.1f}: {found['ratio_median']:.3f}x "
          f"(target {TARGET})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
