"""Text generation load test, side by side on the same weights, through OpenAI's API.

Default (``--model hub-llama``): a Hugging Face directory as the Hub lays it out, a Llama
architecture with a 4,096-token byte-level BPE tokenizer and a chat template (the test
suite's ``hub_models`` fixture, built here in seconds), served by `gpuflow serve DIR` and by
`transformers serve --continuous-batching` (it needs `pip install accelerate`), and by vLLM
where installed; each through ``/v1/completions`` and ``/v1/chat/completions``. Its
generation config's end-of-sequence ids are set to reserved tokens neither server is
trained to produce, so every request generates all its tokens; each request's output
tokens are counted from the ``usage`` the servers stream. On a machine with two cores or
more, every server runs on core 0 (one torch thread) and the clients on the others.

``--model textlm``: textlm's GPT (tiny unless ``--model-size`` says otherwise; untrained:
the cost of generating does not depend on the weights) through gpuflow's engine
(/v1/completions), gpuflow's no-cache path (/v1/predict), gpuflow serving its Hugging Face
export, `transformers serve` and vLLM on that export (the GPU suite's stage), and
llama.cpp's `llama-server` on a GGUF conversion of it (one thread; found or built:
``contenders/llama_cpp.py``), against which gpuflow's engine is judged.

``--model smollm2``: the real SmolLM2-135M-Instruct (``real_model.py``; 30 layers, a
49,152-token vocabulary), fp32, through gpuflow's engine and `llama-server` on its float32
GGUF conversion, one thread each, the same prompt ids (a real text, ``--prompt-tokens``
long); judged against llama.cpp by the targets of issue 50.

Closed-loop clients ask for the same greedy completion at each concurrency, the contenders
taking turns round by round so that a change in machine load hits all of them, each window
waiting (up to a minute) for the CPUs to go idle first. Per contender and concurrency:
output tokens per second, time to first token and inter-token latency, p50 and p99, the
median of the rounds; and the issue's targets judged from them. Each round of a gpuflow
engine also records its steps from the server's /metrics (``engine``: how many, their mean
time and their forward's, their mean rows), which tells a slow step from a slow client path.

    .venv/bin/python benchmarks/generation.py                 # ~30 minutes on 2 cores
    .venv/bin/python benchmarks/generation.py --quick         # seconds
    .venv/bin/python benchmarks/generation.py --model smollm2 --concurrency 1,8
    python benchmarks/generation.py --model textlm --device cuda --precision bf16 --cuda-graphs
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # hub_models: the Hub-style directories
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
from _load import Contender, drive, median_of_rounds, metric_values, start  # noqa: E402
from contenders import llama_cpp  # noqa: E402
from serving import free_port, untrained_export  # noqa: E402

ARGS: argparse.Namespace  # the command line, parsed once in __main__
QUIET_SHARE = 0.05  # a machine is quiet when other processes use under 5% of the CPUs
# Targets of the issue: gpuflow's output tokens/s over transformers serve's, by concurrency.
TARGETS = {"1": 1.0, "8": 1.5, "32": 1.5}
TEXTLM_CONTEXT = 128  # textlm's positions: a slot's context, prompt and completion together
PROMPT_TEXT = ("The Python interpreter reads a program text, splits it into tokens and "
               "builds a tree of the statements it finds; ") * 4  # textlm: a byte a token


def hub_directory(folder: Path) -> tuple[Path, str, list[dict[str, str]], dict[str, int]]:
    """The Llama directory, its end-of-sequence ids moved to reserved tokens; a prompt and
    a conversation of about ``--prompt-tokens`` tokens each, from the model's lessons."""
    from hub_models import build_hub_model

    path = build_hub_model("llama", folder / "llama")
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text())
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    reserved = sorted(t["id"] for t in tokenizer["added_tokens"] if "reserved" in t["content"])
    config["eos_token_id"] = reserved[:2]
    config_path.write_text(json.dumps(config, indent=2))
    return (path, *_prompts(path))  # type: ignore[return-value]


def _prompts(path: Path) -> tuple[str, list[dict[str, str]], dict[str, int]]:
    from hub_models import lessons
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(" ".join(lessons()), add_special_tokens=False)["input_ids"]
    wanted = ARGS.prompt_tokens

    def chat(count: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": tokenizer.decode(ids[:count])}]

    def chat_length(count: int) -> int:
        return len(tokenizer.apply_chat_template(chat(count), add_generation_prompt=True,
                                                 tokenize=True)["input_ids"])

    prompt = tokenizer.decode(ids[:wanted - 1])  # and the BOS the tokenizer adds
    count = next(c for c in range(wanted, 0, -1) if chat_length(c) <= wanted)
    lengths = {"completions": len(tokenizer(prompt)["input_ids"]), "chat": chat_length(count)}
    return prompt, chat(count), lengths


def gpuflow_command(source: Path, port: int) -> list[str]:
    """`gpuflow serve` of ``source`` on one torch thread, its queue deep enough for every
    client and its deadline past any completion."""
    return [sys.executable, "-m", "gpuflow.cli", "serve", str(source), "--port", str(port),
            "--max-batch-size", str(ARGS.max_batch_size), "--max-queue",
            str(4 * max(ARGS.levels)), "--threads", "1", "--timeout-ms", "60000",
            "--device", ARGS.device, "--precision", ARGS.precision,
            *(["--compile"] if ARGS.compile else []),
            *(["--max-autotune"] if ARGS.max_autotune else []),
            # Graphs only when asked: on CUDA the server's default would capture them.
            "--cuda-graphs" if ARGS.cuda_graphs else "--no-cuda-graphs", "--log-level", "warning"]


def transformers_command(source: Path, port: int) -> list[str] | None:
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if ARGS.no_transformers or executable is None:
        return None
    device = "cuda" if ARGS.device.startswith("cuda") else "cpu"
    return [executable, "serve", str(source), "--continuous-batching", "--device", device,
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_command(source: Path, port: int) -> list[str]:
    """vLLM's OpenAI server on ``source``, in gpuflow's precision, with room for every
    client; it shares the GPU with gpuflow's server, whose KV cache takes half the memory."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[ARGS.precision]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(source),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-num-seqs", str(max(ARGS.levels)), "--gpu-memory-utilization", "0.3"]


class Servers:
    """The servers started, each on its own port (on the server cores), and what did not
    start, as notes. ``restart`` starts them all afresh, on the same ports: a server that
    stalled in one round (as `transformers serve` does at 32 clients) is measured again in
    the next, rather than timing out there too."""

    def __init__(self, env: dict[str, str], cores: set[int] | None) -> None:
        self.env, self.cores = env, cores
        self.processes: list[Any] = []
        self.started: list[tuple[list[str], str, str, float]] = []
        self.notes: list[str] = []

    def start(self, name: str, command: list[str], ready: str, timeout: float) -> str | None:
        url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        try:
            self.processes.append(start(command, url, ready, self.env, timeout, self.cores))
        except RuntimeError as exc:
            self.notes.append(f"{name} did not start: {exc}")
            return None
        self.started.append((command, url, ready, timeout))
        return url

    def restart(self) -> None:
        stop(self.processes)
        self.processes = [start(command, url, ready, self.env, timeout, self.cores)
                          for command, url, ready, timeout in self.started]


def hub_contenders(servers: Servers, folder: Path) -> tuple[list[Contender], dict[str, Any]]:
    """gpuflow and transformers serve (and vLLM) on the directory, each route."""
    path, prompt, messages, lengths = hub_directory(folder)
    common = {"model": str(path), "max_tokens": ARGS.tokens, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}}
    bodies = {"completions": {**common, "prompt": prompt},
              "chat": {**common, "messages": messages}}
    paths = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
    commands = {"gpuflow": gpuflow_command(path, free_port()),
                "transformers serve": transformers_command(path, free_port())}
    if not ARGS.no_vllm and importlib.util.find_spec("vllm") is None:
        servers.notes.append("vLLM is not installed here: no vLLM contender")
    elif not ARGS.no_vllm:
        commands["vllm"] = vllm_command(path, free_port())
    contenders, info = [], {"model": f"{path.name}: Llama, 4,096-token byte-level BPE",
                            "prompt_tokens": lengths}
    for server, command in commands.items():
        if command is None:
            servers.notes.append(f"{server}: not run (--no-transformers or not installed)")
            continue
        url = servers.start(server, command, "/readyz" if server == "gpuflow" else "/health",
                            600 if ARGS.compile or server == "vllm" else 180)
        if url is None:
            continue
        if server == "gpuflow":
            info["gpuflow_runs_on"] = runs_on(url)
        contenders += [Contender(f"{server} {route}", url, paths[route], bodies[route], True,
                                 ARGS.tokens) for route in ARGS.routes]
    return contenders, info


def textlm_contenders(servers: Servers, folder: Path) -> tuple[list[Contender], dict[str, Any]]:
    """textlm through gpuflow's engine and no-cache path, its Hugging Face export through
    gpuflow, transformers serve and vLLM."""
    from gpuflow.export import write_hf_export
    from gpuflow.serve.model import read_source, restore_workload

    model_file, _ = untrained_export(folder, "textlm", ARGS.model_size)
    config, weights, step, serving = read_source(model_file)
    hf_dir = folder / "hf"
    write_hf_export(restore_workload(config, weights, model_file), config, step, hf_dir,
                    serving)
    prompt = PROMPT_TEXT[: ARGS.prompt_tokens]  # ASCII: one byte, one token
    greedy = {"prompt": prompt, "max_tokens": ARGS.tokens, "temperature": 0.0, "stream": True}
    timeout = 600 if ARGS.compile or ARGS.max_autotune or ARGS.cuda_graphs else 180
    url = servers.start("gpuflow", gpuflow_command(model_file, free_port()), "/readyz", timeout)
    if url is None:
        raise RuntimeError("; ".join(servers.notes))
    contenders = [
        Contender("gpuflow", url, "/v1/completions", greedy, True, ARGS.tokens),
        Contender("gpuflow no cache", url, "/v1/predict",
                  {"text": prompt, "max_new_tokens": ARGS.tokens, "temperature": 0.0}, False,
                  ARGS.tokens)]
    others = {"gpuflow, HF export": None if ARGS.no_hf else gpuflow_command(hf_dir, free_port()),
              "transformers serve": transformers_command(hf_dir, free_port())}
    if not ARGS.no_vllm and importlib.util.find_spec("vllm") is None:
        servers.notes.append("vLLM is not installed here: no vLLM contender")
    elif not ARGS.no_vllm:
        others["vllm"] = vllm_command(hf_dir, free_port())
    for name, command in others.items():
        started = command and servers.start(name, command, "/readyz" if "gpuflow" in name
                                            else "/health", 600 if name == "vllm" else timeout)
        if started:  # an untrained model may end early: every contender generates it all
            body = greedy if "gpuflow" in name else {**greedy, "model": str(hf_dir),
                                                     "ignore_eos": True}
            contenders.append(Contender(name, started, "/v1/completions", body, True,
                                        ARGS.tokens))
    if not ARGS.no_llama_cpp and ARGS.device.startswith("cuda"):
        servers.notes.append("llama.cpp: its build here is for the CPU; not run on CUDA")
    llama = None if ARGS.no_llama_cpp or ARGS.device.startswith("cuda") else (
        llama_cpp.contender(servers, hf_dir, folder, greedy, ARGS.llama_server,
                            max(ARGS.levels), ARGS.tokens, not ARGS.quick,
                            (prompt, list(prompt.encode())), TEXTLM_CONTEXT, textlm=True))
    return contenders + ([llama[0]] if llama else []), {
        "model": f"textlm {ARGS.model_size or 'tiny (4 x 128, 128 context)'}, untrained",
        "gpuflow_runs_on": runs_on(url), "llama_cpp": llama[1] if llama else None}


def smollm2_contenders(servers: Servers, folder: Path
                       ) -> tuple[list[Contender], dict[str, Any]]:
    """SmolLM2-135M-Instruct (``real_model.py``) through gpuflow's engine and llama.cpp's
    `llama-server` on its float32 GGUF conversion: the same weights, the same prompt ids
    (``--prompt-tokens`` of a real text), every request generating all its tokens."""
    from hub_models import lessons
    from real_model import smollm2_directory
    from transformers import AutoTokenizer

    path = smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = tokenizer.decode(tokenizer(" ".join(lessons()))["input_ids"][:ARGS.prompt_tokens])
    ids = tokenizer(text)["input_ids"]
    greedy = {"prompt": ids, "max_tokens": ARGS.tokens, "temperature": 0.0, "stream": True,
              "ignore_eos": True, "stream_options": {"include_usage": True}}
    url = servers.start("gpuflow", gpuflow_command(path, free_port()), "/readyz",
                        600 if ARGS.compile or ARGS.max_autotune else 180)
    if url is None:
        raise RuntimeError("; ".join(servers.notes))
    contenders = [Contender("gpuflow", url, "/v1/completions", greedy, True, ARGS.tokens)]
    llama = None if ARGS.no_llama_cpp else llama_cpp.contender(
        servers, path, folder, greedy, ARGS.llama_server, max(ARGS.levels), ARGS.tokens,
        not ARGS.quick, (text, ids), len(ids) + ARGS.tokens + 8, textlm=False)
    if llama:
        contenders.append(llama[0])
    return contenders, {"model": f"{path.name}: SmolLM2-135M-Instruct, fp32 directory",
                        "prompt_tokens": len(ids), "gpuflow_runs_on": runs_on(url),
                        "llama_cpp": llama[1] if llama else None}


def runs_on(url: str) -> dict[str, Any]:
    """What gpuflow's /readyz says runs: the device and precision, how decode steps run,
    and the warm-up times."""
    ready = httpx.get(url + "/readyz", timeout=10).json()
    return {"runs_on": ready["runs_on"], "decode": ready["generation"]["decode"],
            "warmup_s": ready["warmup_s"], "decode_warmup_s": ready["generation"]["warmup_s"]}


def judge(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """gpuflow against transformers serve, per route and concurrency: the tokens/s ratio
    against its target, and whether gpuflow's TTFT p50 is no worse."""
    verdicts: dict[str, Any] = {}
    for route in ARGS.routes:
        ours, theirs = runs.get(f"gpuflow {route}"), runs.get(f"transformers serve {route}")
        if not ours or not theirs:
            continue
        for level, target in TARGETS.items():
            if level not in ours or level not in theirs or not theirs[level]["tokens_per_s"]:
                continue
            ratio = ours[level]["tokens_per_s"] / theirs[level]["tokens_per_s"]
            ttft = (ours[level]["ttft_p50_ms"], theirs[level]["ttft_p50_ms"])
            verdicts[f"{route} c{level}"] = {
                "tokens_per_s_ratio": ratio, "target_min": target,
                "ttft_p50_ms": {"gpuflow": ttft[0], "transformers serve": ttft[1]},
                "met": ratio >= target and None not in ttft and ttft[0] <= ttft[1]}
    return verdicts


ENGINE_TOTALS = ("gpuflow_engine_step_seconds_count", "gpuflow_engine_step_seconds_sum",
                 "gpuflow_engine_forward_seconds_sum", "gpuflow_engine_step_rows_total")


def engine_totals(contender: Contender) -> dict[str, float] | None:
    """The step counters of a gpuflow generation engine's /metrics (None for others)."""
    if not contender.name.startswith("gpuflow") or contender.path == "/v1/predict":
        return None
    try:
        found = metric_values(contender.url, ENGINE_TOTALS)
    except httpx.HTTPError:  # a server that stopped answering is the round's own finding
        return None
    return found if len(found) == len(ENGINE_TOTALS) else None


def engine_steps(before: dict[str, float] | None, after: dict[str, float] | None
                 ) -> dict[str, float] | None:
    """The engine's steps over a warm-up and window: how many, their mean time (against the
    clients' inter-token gaps: a slow step or a slow path to the clients), their model
    runner's call (on a GPU its launches: near the step's time when launch-bound), and
    their mean rows."""
    if before is None or after is None:
        return None
    delta = {key: after[key] - before[key] for key in ENGINE_TOTALS}
    steps = delta["gpuflow_engine_step_seconds_count"]
    if not steps:
        return None
    return {"steps": steps,
            "step_ms": 1000 * delta["gpuflow_engine_step_seconds_sum"] / steps,
            "forward_ms": 1000 * delta["gpuflow_engine_forward_seconds_sum"] / steps,
            "rows_per_step": delta["gpuflow_engine_step_rows_total"] / steps}


def measure(contenders: list[Contender], servers: Servers) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        c.name: {str(level): [] for level in ARGS.levels} for c in contenders}
    for number in range(ARGS.rounds):
        if number:
            servers.restart()
        for level in ARGS.levels:
            for contender in contenders:
                # A server still generating for requests its clients dropped (as a stalled
                # contender does) would slow the next one measured.
                quiet = (wait_for_idle(ARGS.quiet_wait_s, threshold=QUIET_SHARE, log=print)
                         if ARGS.quiet_wait_s else None)
                before = engine_totals(contender)
                figures = asyncio.run(drive(contender, level, ARGS.warmup_s, ARGS.window_s))
                figures["foreign_cpu_share_before"] = quiet
                figures["engine"] = engine_steps(before, engine_totals(contender))
                results[contender.name][str(level)].append(figures)
                print(f"round {number + 1} c{level:<3} {contender.name:>30}: "
                      f"{figures['tokens_per_s']:8.1f} tok/s  ttft p50 "
                      f"{figures['ttft_p50_ms'] or 0:8.1f} ms  itl p50 "
                      f"{figures['itl_p50_ms'] or 0:6.2f} ms  errors {figures['errors']}"
                      + ("" if not (steps := figures["engine"]) else
                         f"  step {steps['step_ms']:.2f} ms (forward {steps['forward_ms']:.2f})"
                         f" x {steps['rows_per_step']:.1f} rows"), flush=True)
    return {name: {level: median_of_rounds(rounds) for level, rounds in by_level.items()}
            for name, by_level in results.items()}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", choices=["hub-llama", "textlm", "smollm2"], default="hub-llama")
    add("--model-size", help="textlm: --model-size of the served model (default tiny)")
    add("--routes", default="completions,chat", help="hub-llama: comma-separated routes")
    add("--concurrency", default="1,8,32", help="comma-separated client counts")
    add("--tokens", type=int, default=64, help="tokens generated per request")
    add("--prompt-tokens", type=int, default=64)
    add("--max-batch-size", type=int, default=32)
    add("--rounds", type=int, default=3)
    add("--warmup-s", type=float, default=3.0)
    add("--window-s", type=float, default=10.0)
    add("--device", default="auto", help="gpuflow serve --device (default auto)")
    add("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    add("--compile", action="store_true", help="gpuflow serve --compile")
    add("--max-autotune", action="store_true", help="gpuflow serve --max-autotune")
    add("--cuda-graphs", action="store_true",
        help="gpuflow serve --cuda-graphs (CUDA only); without it --no-cuda-graphs")
    add("--no-transformers", action="store_true", help="leave `transformers serve` out")
    add("--no-vllm", action="store_true", help="leave vLLM out")
    add("--no-hf", action="store_true", help="textlm: leave out gpuflow on the HF export")
    add("--no-llama-cpp", action="store_true", help="textlm, smollm2: leave llama.cpp out")
    add("--llama-server", default=os.environ.get("LLAMA_SERVER"),
        help="textlm, smollm2: a built llama-server (default $LLAMA_SERVER, else built in "
        ".cache-llama, except with --quick)")
    add("--quiet-wait-s", type=float, default=60.0,
        help="before each window, wait up to this long for the CPUs to go idle (0: do not)")
    add("--quick", action="store_true",
        help="1 round of 1 s at 4 clients, 16 tokens, no transformers serve")
    add("--out", type=Path, help="default benchmarks/results/generation-<machine>.json")
    args = parser.parse_args()
    args.out = args.out or default_result_path(
        {"textlm": "generation", "hub-llama": "generation-hub-llama"}.get(
            args.model, f"generation-{args.model}"))
    if args.quick:
        args.rounds, args.warmup_s, args.window_s, args.concurrency = 1, 0.5, 1.0, "4"
        args.quiet_wait_s, args.tokens, args.no_transformers = 0.0, 16, True
    args.levels = [int(level) for level in args.concurrency.split(",")]
    args.routes = args.routes.split(",")
    return args


def table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Each contender's figures by concurrency, as the run prints them."""
    lines = [f"{'contender':32} {'clients':>7} {'tok/s':>8} {'TTFT p50/p99 ms':>17} "
             f"{'ITL p50/p99 ms':>15} {'errors':>6}"]
    for name, by_level in runs.items():
        for level, got in by_level.items():
            lines.append(f"{name:32} {level:>7} {got['tokens_per_s']:8.0f} "
                         f"{got['ttft_p50_ms'] or 0:8.1f}/{got['ttft_p99_ms'] or 0:<8.1f} "
                         f"{got['itl_p50_ms'] or 0:7.2f}/{got['itl_p99_ms'] or 0:<7.2f} "
                         f"{got['errors']:6d}")
    return lines


def main() -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    machine = machine_info()  # before the clients are moved off the servers' core
    # Servers on core 0, the clients (this process) on the others, where there are others.
    cores = usable_cores()
    server_cores = {0} if cores >= 2 and not ARGS.device.startswith("cuda") else None
    if server_cores:
        os.sched_setaffinity(0, set(range(1, cores)))
    servers = Servers(env, server_cores)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            build = {"hub-llama": hub_contenders, "textlm": textlm_contenders,
                     "smollm2": smollm2_contenders}[ARGS.model]
            contenders, info = build(servers, Path(scratch))
            runs = measure(contenders, servers)
        finally:
            stop(servers.processes)
    write_json(ARGS.out, {
        "benchmark": "generation",
        **provenance(transformers=package_version("transformers"),
                     fastapi=package_version("fastapi"), uvicorn=package_version("uvicorn"),
                     uvloop=package_version("uvloop"), httptools=package_version("httptools")),
        **info,
        "settings": {k: getattr(ARGS, k) for k in (
            "model", "routes", "concurrency", "tokens", "prompt_tokens", "max_batch_size",
            "rounds", "warmup_s", "window_s", "quiet_wait_s", "quick", "device", "precision",
            "compile", "max_autotune", "cuda_graphs")}
        | {"server_cores": sorted(server_cores or [])},
        "runs": runs,
        "targets": judge(runs) if ARGS.model == "hub-llama" else llama_cpp.judge(
            runs, ARGS.model),
        "table": table(runs),
        "notes": servers.notes,
        "machine": machine,
    })
    print("\n".join(table(runs)))
    print(f"-> {ARGS.out}")
    return 0


if __name__ == "__main__":
    ARGS = parse()
    sys.exit(main())
