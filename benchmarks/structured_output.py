"""Structured outputs (issue 53): what a grammar costs the server, and what it buys on a
real model.

**Cost.** One server, `gpuflow serve DIR --threads 1 --no-engine-process`, over the stub
model of ``host_ceiling.py`` (one Llama layer of width 32, the Hub test models' 4,096-token
BPE, untrained): the forward costs next to nothing, so a grammar's host work (compiling,
the mask each step, the constrained rows' host-sampled path) weighs as much as it ever
can: a worst case, not a typical one. 32 closed-loop streaming clients on
``/v1/completions``, 64 tokens each (``ignore_eos``; a constrained answer may end sooner,
when its JSON closes: tokens are counted from each stream's ``usage``); windows of all 32
unconstrained and of 16 unconstrained beside 16 constrained by a 10-field JSON schema take
turns round by round, each after the CPUs go quiet; the median of the rounds. Then at one
client, repetitions interleaved: the time to first token unconstrained, with the 10-field
schema (compiled and cached by then) and with a 20-field schema new to the server each
time (one property renamed per repetition); medians. ``gpuflow_engine_grammar_mask_seconds``
(sum and count) is read from ``/metrics`` around each window.

**Quality.** SmolLM2-135M-Instruct (``real_model.py``'s directory, float32) served the same
way: 50 chat prompts asking for a JSON object (5 templates x 10 subjects), greedy,
``max_tokens`` 96, 8 at a time, once unconstrained and once with ``response_format``
``json_schema``: the share whose whole answer parses (``json.loads``) and validates against
the schema (``jsonschema``), and, leniently, the share holding a valid object somewhere
(inside a Markdown fence, say).

    .venv/bin/python benchmarks/structured_output.py            # ~6 minutes
    .venv/bin/python benchmarks/structured_output.py --quick    # seconds, the stub only

**On a GPU** (``gpu_stages.py``'s ``structured-output``): ``--device cuda --engine-process``,
the engine's core in a process of its own as served by default, where a constrained row's
mask must be ready before the forward ends; ``--dry-run`` runs that command at ``--quick``'s
sizes on the CPU, its file marked as a dry run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tests"))  # hub_models: the stub's tokenizer
from _common import (  # noqa: E402
    cpu_model,
    default_result_path,
    machine_info,
    package_version,
    provenance,
    stop,
    wait_for_idle,
    write_json,
)
from _load import Contender, drive, metric_values, start, timed_request, together  # noqa: E402
from host_ceiling import stub_directory  # noqa: E402
from serving import free_port  # noqa: E402

TARGETS = {"tokens_per_s_ratio": 0.9, "cached_ttft_added_ms": 1.0, "new_ttft_added_ms": 50.0}
MASK = "gpuflow_engine_grammar_mask_seconds"
PROMPT = "The Python interpreter reads a program text and splits it into tokens"
TEN = {"name": {"type": "string", "maxLength": 12},
       "age": {"type": "integer", "minimum": 0, "maximum": 120},
       "email": {"type": "string", "format": "email"},
       "active": {"type": "boolean"},
       "score": {"type": "number", "minimum": 0, "maximum": 100},
       "role": {"enum": ["admin", "user", "guest"]},
       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
       "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
       "city": {"type": "string", "maxLength": 12},
       "address": {"type": "object", "additionalProperties": False, "required": ["street"],
                   "properties": {"street": {"type": "string", "maxLength": 16}}}}


def strict_object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": list(properties),
            "properties": properties}


def twenty_fields(nonce: int) -> dict[str, Any]:
    """A 20-field schema; ``nonce`` renames one property, so each is new to the server."""
    extra = {f"{key}_{2}": value for key, value in TEN.items()}
    extra[f"field_{nonce}"] = extra.pop("city_2")
    return strict_object({**TEN, **extra})


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def completion(url: str, name: str, tokens: int, schema: dict[str, Any] | None) -> Contender:
    body: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": tokens,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = json_schema(schema)
    return Contender(name, url, "/v1/completions", body, True, tokens)


def quiet(args: argparse.Namespace) -> None:
    """Wait for the CPUs to go quiet (not in --quick: a smoke test takes what it gets)."""
    if args.idle_wait > 0:
        wait_for_idle(args.idle_wait, threshold=0.1)


def mask_totals(url: str) -> dict[str, float]:
    """The grammar mask histogram's sum and count (0 before any constrained step)."""
    found = metric_values(url, (f"{MASK}_sum", f"{MASK}_count"))
    return {part: found.get(f"{MASK}_{part}", 0.0) for part in ("sum", "count")}


def mask_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    count, total = after["count"] - before["count"], after["sum"] - before["sum"]
    return {"steps": count, "sum_s": total,
            "mean_ms_per_step": 1000 * total / count if count else None}


async def mixed(url: str, clients: int, args: argparse.Namespace,
                constrained: bool) -> dict[str, Any]:
    """One window: ``clients`` unconstrained, or half of them constrained by TEN."""
    plain = completion(url, "unconstrained", args.max_tokens, None)
    if not constrained:
        return {"all": await drive(plain, clients, args.warmup, args.seconds)}
    schema = completion(url, "constrained", args.max_tokens, strict_object(TEN))
    half = clients // 2
    free, bound = await asyncio.gather(drive(plain, clients - half, args.warmup, args.seconds),
                                       drive(schema, half, args.warmup, args.seconds))
    return {"all": together([free, bound]), "unconstrained": free, "constrained": bound}


def cost(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of the two windows, interleaved; the median tokens/s of each."""
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        one = {}
        for name, constrained in (("unconstrained", False), ("half_constrained", True)):
            quiet(args)
            before = mask_totals(url)
            one[name] = asyncio.run(mixed(url, args.clients, args, constrained))
            one[name]["grammar_mask"] = mask_delta(before, mask_totals(url))
            print(f"round {index}: {name} {one[name]['all']['tokens_per_s']:.0f} tok/s",
                  flush=True)
        one["ratio"] = (one["half_constrained"]["all"]["tokens_per_s"]
                        / one["unconstrained"]["all"]["tokens_per_s"])
        rounds.append(one)
    medians = {name: statistics.median(r[name]["all"]["tokens_per_s"] for r in rounds)
               for name in ("unconstrained", "half_constrained")}
    return {"clients": args.clients, "constrained_clients": args.clients // 2,
            "max_tokens": args.max_tokens, "window_s": args.seconds, "rounds": rounds,
            "tokens_per_s": medians,
            "ratio_median": statistics.median(r["ratio"] for r in rounds),
            "grammar_mask": {key: sum(r["half_constrained"]["grammar_mask"][key] for r in rounds)
                             for key in ("steps", "sum_s")}}


async def ttft_repetitions(url: str, repetitions: int) -> dict[str, list[float]]:
    kinds: dict[str, list[float]] = {"unconstrained": [], "cached_schema": [], "new_schema": []}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await timed_request(client, completion(url, "warm", 8, strict_object(TEN)))
        for index in range(repetitions):
            for kind, schema in (("unconstrained", None), ("cached_schema", strict_object(TEN)),
                                 ("new_schema", twenty_fields(index))):
                timed = await timed_request(client, completion(url, kind, 8, schema))
                if not timed.ok:
                    raise RuntimeError(f"a {kind} request failed")
                kinds[kind].append(1000 * timed.first_s)
    return kinds


def ttft(url: str, args: argparse.Namespace) -> dict[str, Any]:
    quiet(args)
    before = mask_totals(url)
    found = asyncio.run(ttft_repetitions(url, args.repetitions))
    medians = {kind: statistics.median(values) for kind, values in found.items()}
    return {"repetitions": args.repetitions, "max_tokens": 8, "median_ms": medians,
            "cached_added_ms": medians["cached_schema"] - medians["unconstrained"],
            "new_added_ms": medians["new_schema"] - medians["unconstrained"],
            "samples_ms": found, "grammar_mask": mask_delta(before, mask_totals(url))}


SUBJECTS = ("Alice", "Bob", "Chen", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas")
TEMPLATES = (
    ("Give a JSON object with keys name (string), age (integer) and city (string) for a person "
     "called {}.", {"name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "city": {"type": "string", "maxLength": 30}}),
    ("Return JSON with keys title (string), author (string) and year (integer) for a book "
     "written by {}.", {"title": {"type": "string", "maxLength": 40},
                        "author": {"type": "string", "maxLength": 30},
                        "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}),
    ("Answer only with a JSON object: keys pet_name (string), species (one of \"cat\", \"dog\", "
     "\"bird\") and legs (integer) for {}'s pet.",
     {"pet_name": {"type": "string", "maxLength": 30}, "species": {"enum": ["cat", "dog", "bird"]},
      "legs": {"type": "integer", "minimum": 0, "maximum": 8}}),
    ("Write a JSON object describing {}'s job with keys company (string), position (string), "
     "remote (boolean) and salary (number).",
     {"company": {"type": "string", "maxLength": 30}, "position": {"type": "string",
                                                                   "maxLength": 30},
      "remote": {"type": "boolean"}, "salary": {"type": "number", "minimum": 0}}),
    ("Output JSON with keys city (string), temperature (integer, degrees Celsius) and sunny "
     "(boolean) for the weather where {} lives.",
     {"city": {"type": "string", "maxLength": 30},
      "temperature": {"type": "integer", "minimum": -60, "maximum": 60},
      "sunny": {"type": "boolean"}}),
)


def prompts(count: int) -> list[tuple[str, dict[str, Any]]]:
    every = [(text.format(subject), strict_object(properties))
             for text, properties in TEMPLATES for subject in SUBJECTS]
    return every[:count]


def validates(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def judged(text: str, schema: dict[str, Any]) -> dict[str, bool]:
    """Whether the whole answer is valid JSON, validates, and (leniently) whether some
    ``{...}`` inside it does."""
    try:
        value, parses = json.loads(text), True
    except ValueError:
        value, parses = None, False
    lenient = parses and validates(value, schema)
    start = text.find("{")
    while not lenient and start >= 0:
        try:
            inner, _ = json.JSONDecoder().raw_decode(text[start:])
            lenient = validates(inner, schema)
        except ValueError:
            pass
        start = text.find("{", start + 1)
    return {"parses": parses, "valid": parses and validates(value, schema), "lenient": lenient}


async def answers(url: str, args: argparse.Namespace, constrained: bool) -> list[dict[str, Any]]:
    limit = asyncio.Semaphore(args.batch)

    async def one(client: httpx.AsyncClient, prompt: str, schema: dict[str, Any]
                  ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": args.quality_tokens, "temperature": 0}
        if constrained:
            body["response_format"] = json_schema(schema)
        async with limit:
            reply = await client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        text = choice["message"]["content"] or ""
        return {"prompt": prompt, "text": text, "finish_reason": choice["finish_reason"],
                **judged(text, schema)}

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, prompt, schema)
                                           for prompt, schema in prompts(args.prompts))))


def quality(url: str, args: argparse.Namespace) -> dict[str, Any]:
    found = {}
    for name, constrained in (("unconstrained", False), ("constrained", True)):
        rows = asyncio.run(answers(url, args, constrained))
        found[name] = {key: sum(row[key] for row in rows) / len(rows)
                       for key in ("parses", "valid", "lenient")}
        found[name]["finish_reasons"] = {reason: sum(row["finish_reason"] == reason
                                                     for row in rows)
                                         for reason in {row["finish_reason"] for row in rows}}
        found[name]["answers"] = rows
        print(f"quality: {name} {100 * found[name]['valid']:.0f}% valid", flush=True)
    return {"prompts": args.prompts, "max_tokens": args.quality_tokens, "concurrency": args.batch,
            "greedy": True, **found}


def served(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "gpuflow.cli", "serve", str(model), "--port", str(port),
               "--threads", "1", "--device", args.device,
               "--engine-process" if args.engine_process else "--no-engine-process",
               "--max-batch-size", str(args.clients),
               "--log-level", "warning", "--served-model-name", "m"]
    url = f"http://127.0.0.1:{port}"
    return start(command, url, "/readyz", dict(os.environ), timeout=300), url


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quality-tokens", type=int, default=96)
    parser.add_argument("--idle-wait", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true",
                        help="one short round, 3 repetitions, 4 prompts on the stub (a smoke test)")
    parser.add_argument("--device", default="cpu", help="gpuflow serve --device (default cpu)")
    parser.add_argument("--engine-process", action="store_true",
                        help="the engine's core in a process of its own (default: a thread)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same command at --quick's sizes on the CPU, marked a dry run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.dry_run:
        args.quick, args.device = True, "cpu"
    if args.quick:
        args.clients, args.rounds, args.seconds, args.warmup = 4, 1, 1.0, 0.3
        args.repetitions, args.prompts, args.quality_tokens, args.idle_wait = 3, 4, 24, 0.0
    return args


def targets(found: dict[str, Any], ttfts: dict[str, Any]) -> dict[str, Any]:
    figures = {"tokens_per_s_ratio": found["ratio_median"],
               "cached_ttft_added_ms": ttfts["cached_added_ms"],
               "new_ttft_added_ms": ttfts["new_added_ms"]}
    return {key: {"value": value, "target": TARGETS[key],
                  "met": value >= TARGETS[key] if key == "tokens_per_s_ratio"
                  else value <= TARGETS[key]} for key, value in figures.items()}


def real_quality(args: argparse.Namespace) -> dict[str, Any]:
    """The valid-JSON rates on SmolLM2; why not, where its weights cannot be had (a GPU
    machine without the bench extra still measures the cost)."""
    from real_model import MissingPackage, smollm2_directory

    try:
        model = smollm2_directory()
    except MissingPackage as exc:
        return {"skipped": str(exc)}
    process, url = served(model, args)
    try:
        return quality(url, args)
    finally:
        stop([process])


def device_name(device: str) -> str:
    """What served: the GPU's name on CUDA, else the CPU's."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def main() -> int:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="structured-") as scratch:
        stub = stub_directory(Path(scratch))
        process, url = served(stub, args)
        try:
            found, ttfts = cost(url, args), ttft(url, args)
            stub_quality = quality(url, args) if args.quick else None
        finally:
            stop([process])
    real = None if args.quick else real_quality(args)
    payload = {**provenance(llguidance=package_version("llguidance"),
                            jsonschema=package_version("jsonschema")),
               "machine": machine_info(), "quick": args.quick, "dry_run": args.dry_run,
               "device": args.device, "device_name": device_name(args.device),
               "engine_process": args.engine_process,
               "cost_model": "Llama, 1 layer, width 32, 4,096-token BPE vocabulary, untrained",
               "cost": found, "ttft": ttfts, "targets": targets(found, ttfts),
               "quality_model": "the stub (quick)" if args.quick
               else "SmolLM2-135M-Instruct, float32", "quality": stub_quality or real}
    out = args.out or (Path(tempfile.gettempdir()) / "structured_output-dry-run.json"
                       if args.dry_run else default_result_path("structured_output"))
    write_json(out, payload)
    print(f"tokens/s: {found['tokens_per_s']} -> {found['ratio_median']:.3f}x; TTFT added: "
          f"cached {ttfts['cached_added_ms']:.2f} ms, new {ttfts['new_added_ms']:.2f} ms")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
