"""`gpuflow serve`: an HTTP server with dynamic batching for a run dir or an export."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import ipaddress
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuflow.errors import UserError
from gpuflow.serve.batcher import INLINE_BELOW_MS
from gpuflow.serve.dtypes import CHOICES
from gpuflow.serve.routes.tool_parsers import PARSERS

TOKEN_ENV = "GPUFLOW_TOKEN"
DEFAULT_MAX_LORAS = 4


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="serve a model over HTTP with dynamic batching",
        description="Serve a run dir, an exported .safetensors file, or a Hugging Face model "
                    "directory (a `gpuflow export --format hf` one, or any causal LM as the "
                    "Hub lays it out) over HTTP (POST /v1/predict, /healthz, /readyz, "
                    "/metrics; for language models also the OpenAI-compatible POST "
                    "/v1/completions, POST /v1/chat/completions and GET /v1/models; API docs "
                    "at /docs).")
    add = parser.add_argument
    add("source", metavar="RUN_DIR|MODEL.safetensors|MODEL_DIR",
        help="a gpuflow run dir, a `gpuflow export` file, or a Hugging Face model directory "
             "(config.json, safetensors weights, tokenizer; read locally, never downloaded)")
    add("--served-model-name", nargs="+", metavar="NAME",
        help="the names clients call the model by (the `model` field, /v1/models); the first "
             "is the one answers give (default: the workload's name, or the directory path)")
    add_chat_flags(parser)
    add("--workload", help="rebuild the model with this workload instead of the saved one")
    add("--host", default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs --token)")
    add("--port", type=int, default=8000, help="default 8000")
    add("--max-batch-size", type=int, default=32,
        help="rows per batch; for language models also the sequences generated at once "
             "(default 32)")
    add("--max-wait-ms", type=float, default=5.0,
        help="longest a partial batch waits for requests already on their way in "
             "(default 5); a request that finds the model idle and nobody else coming "
             "runs at once")
    add("--inline-below-ms", type=float, default=INLINE_BELOW_MS,
        help="a lone request runs on the event loop, skipping the hand-off to the batch "
             "thread, while lone runs of its kind of input take less than this (a running "
             f"estimate; default {INLINE_BELOW_MS:g}; 0: always hand off)")
    add("--max-queue", type=int, default=1024,
        help="requests that may wait (predictions for a batch, generations to start); more "
             "get 503 queue_full (default 1024)")
    add("--timeout-ms", type=float, default=2000.0,
        help="/v1/predict: deadline of a request in the queue; 504 when it passes "
             "(default 2000)")
    add("--ttft-timeout-ms", type=float, metavar="MS",
        help="language models: deadline of a generation's first token; 504 when it passes "
             "(default: none, a generation waits for KV blocks as long as its client does)")
    add("--max-body-bytes", type=int, default=8 << 20,
        help="larger request bodies get 413 (default 8 MiB)")
    add("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    add("--dtype", default="auto", choices=CHOICES,
        help="the dtype weights are held in: auto (default: the checkpoint's on a GPU, or "
             "--precision's when bf16 or fp16; fp32 on a CPU), float32, bfloat16, float16 "
             "(also fp32, bf16, fp16, half)")
    add("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
        help="inference autocast dtype over fp32 weights: fp32 (none), bf16 or fp16 "
             "(default fp32)")
    add("--quantize", metavar="int8",
        help="int8: weight-only quantization of the linear layers through torchao (per-row "
             "scales; activations keep --precision; needs torchao, pip install "
             "'gpuflow[fp8]'); default: weights as saved")
    add("--compile", action="store_true",
        help="torch.compile the model for each batch bucket, and for language models the "
             "decode step of /v1/completions for each bucket of active sequences")
    add("--max-autotune", action="store_true",
        help="compile the decode steps of /v1/completions with inductor's kernel tuning: "
             "each matrix product's fastest kernel is measured at start-up (on the CPU, C++ "
             "kernels over frozen weights); faster steps, a longer warm-up (docs/serving.md)")
    add("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="CUDA only: capture CUDA graphs for the fixed buckets, decode steps included "
             "(implies --compile); default: on for the decode steps of language models "
             "served on CUDA, off for /v1/predict; --no-cuda-graphs: off for both")
    add_engine_flags(parser)
    add("--workers", type=int, default=1,
        help="server processes, each with its own copy of the model (default 1)")
    add("--threads", type=int,
        help="torch intra-op threads per worker (default: torch's choice, one per core); "
             "keep workers x threads within the cores")
    add("--token", help=f"bearer token every request must carry (or ${TOKEN_ENV})")
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(handler=run)


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """The language models' chat template, tool-call syntax and longest sequence."""
    add = parser.add_argument
    add("--chat-template", type=Path, metavar="FILE",
        help="a Jinja chat template for /v1/chat/completions, in place of the model's own")
    add("--tool-call-parser", default="auto", choices=PARSERS,
        help="the syntax the model writes tool calls in, read back as tool_calls on "
             "/v1/chat/completions: hermes (<tool_call> blocks), mistral ([TOOL_CALLS] "
             "list), llama3_json (a bare {\"name\", \"parameters\"} object); default auto: "
             "the one the chat template writes, else hermes")
    add("--max-model-len", type=int, metavar="TOKENS",
        help="language models: the longest sequence (prompt and completion) served, at most "
             "the model's context (default: the model's context)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The language-model engine's KV cache and scheduling flags."""
    add = parser.add_argument
    add("--kv-cache-dtype", default="auto", choices=CHOICES,
        help="language models: the KV cache's dtype (default auto: the weights' when "
             "reduced, else the autocast dtype, else fp32)")
    add("--engine-process", action=argparse.BooleanOptionalAction, default=True,
        help="language models: run the generation engine's core (scheduler, KV cache, model "
             "runner, sampling) in a process of its own, the HTTP server, tokenizing, "
             "detokenizing and streaming in this one (default); --no-engine-process: a "
             "thread of this process")
    add("--kv-cache-gib", type=float,
        help="language models: memory for the paged KV cache, in blocks; admission counts "
             "blocks, up to --max-batch-size sequences at once (default: half the GPU's free "
             "memory, a quarter of a CPU's RAM, at most what --max-batch-size whole contexts "
             "fill)")
    add("--block-size", type=int, default=16, metavar="TOKENS",
        help="language models: tokens per KV cache block (default 16)")
    add("--no-prefix-cache", dest="prefix_cache", action="store_false",
        help="language models: do not reuse the cached KV blocks of a prompt's prefix "
             "(shared system prompts, few-shot examples, chat histories)")
    add("--max-num-batched-tokens", type=int, default=2048, metavar="TOKENS",
        help="language models: tokens one engine step computes at most, running sequences' "
             "next tokens first, then chunks of prompts (a longer prompt is prefilled over "
             "several steps; default 2048)")
    add("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
        help="language models: prefill each prompt whole in one step (the step's token "
             "budget is then raised to the model's context)")
    add("--num-speculative-tokens", type=int, default=0, metavar="K",
        help="language models: speculative decoding: draft K tokens after each decoding "
             "sequence's last and verify them in one forward (greedy text unchanged, "
             "sampled text keeps the model's distribution); drafted by --draft-model, or "
             "else by prompt lookup (default 0: off)")
    add("--draft-model", metavar="DIR|RUN",
        help="language models: a smaller model with the served model's tokenizer that "
             "drafts the --num-speculative-tokens tokens")
    add("--prompt-lookup-max", type=int, default=3, metavar="N",
        help="language models: prompt lookup drafts what followed the latest earlier "
             "occurrence of the last N tokens (then N-1, down to 1; default 3)")
    add("--lora", nargs="+", metavar="NAME=ADAPTER_DIR", default=[],
        help="language models (Llama, Mistral, Qwen2): serve these LoRA adapters (PEFT's "
             "directories, as `gpuflow export` of a --lora-rank run writes them) on the "
             "model, each under NAME: a request's `model` picks one, and one engine step "
             "batches rows of every adapter and of the base")
    add("--max-loras", type=int, metavar="N",
        help="language models: LoRA adapters held on the device at once; more are read in "
             "on first use in the place of one no running request uses (default "
             f"{DEFAULT_MAX_LORAS} with --lora; adapters loaded at run time through POST "
             "/v1/load_lora_adapter need it)")
    add("--max-lora-rank", type=int, default=16, metavar="R",
        help="language models: the largest rank of an adapter served (default 16); the "
             "adapters' slots take max-loras x rank columns beside each projection")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import uvicorn

    from gpuflow.serve.model import check_source
    from gpuflow.serve.quantize import quantization_api
    from gpuflow.serve.settings import SETTINGS_ENV, ServeSettings, settings_json

    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not _is_loopback(args.host) and token is None:
        raise UserError(f"--host {args.host} exposes the server beyond this machine: give "
                        f"--token TOKEN (or set {TOKEN_ENV}) so that every request must carry "
                        "'Authorization: Bearer TOKEN'.")
    for name in ("max_batch_size", "max_queue", "workers", "max_body_bytes", "threads",
                 "max_model_len", "block_size", "max_num_batched_tokens",
                 "prompt_lookup_max"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1.")
    lora, max_loras = _adapters(args)
    if args.num_speculative_tokens < 0:
        raise UserError("--num-speculative-tokens must be 0 (off) or more.")
    if args.draft_model is not None:
        if not args.num_speculative_tokens:
            raise UserError("--draft-model drafts --num-speculative-tokens tokens: give "
                            "--num-speculative-tokens K (5 is common).")
        check_source(Path(args.draft_model))
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise UserError("--kv-cache-gib must be positive.")
    if args.max_wait_ms < 0 or args.timeout_ms <= 0 or args.inline_below_ms < 0 \
            or (args.ttft_timeout_ms is not None and args.ttft_timeout_ms <= 0):
        raise UserError("--max-wait-ms and --inline-below-ms must be 0 or more, "
                        "--timeout-ms and --ttft-timeout-ms positive.")
    check_source(Path(args.source))  # exit code 2 on a wrong path, before uvicorn starts
    if args.quantize is not None:
        quantization_api(args.quantize)  # an unknown scheme, or no torchao: exit code 2
    if args.chat_template is not None and not args.chat_template.is_file():
        raise UserError(f"--chat-template {args.chat_template} is not a file.")
    settings = ServeSettings(
        source=args.source, workload=args.workload, host=args.host, port=args.port,
        max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
        inline_below_ms=args.inline_below_ms, max_queue=args.max_queue, timeout_ms=args.timeout_ms,
        max_body_bytes=args.max_body_bytes, device=args.device, precision=args.precision,
        compile=args.compile or bool(args.cuda_graphs),
        max_autotune=args.max_autotune, cuda_graphs=args.cuda_graphs,
        quantize=args.quantize, token=token,
        threads=args.threads, workers=args.workers, kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size, prefix_cache=args.prefix_cache,
        chunked_prefill=args.chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_timeout_ms=args.ttft_timeout_ms,
        served_model_name=tuple(args.served_model_name or ()),
        chat_template=str(args.chat_template) if args.chat_template else None,
        tool_call_parser=args.tool_call_parser,
        max_model_len=args.max_model_len,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model, prompt_lookup_max=args.prompt_lookup_max,
        lora=lora, max_loras=max_loras, max_lora_rank=args.max_lora_rank,
        engine_process=args.engine_process, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype)
    settings.check_device()
    with tempfile.TemporaryDirectory(prefix="gpuflow-serve-") as scratch:
        failure = Path(scratch) / "failure.json"
        settings = dataclasses.replace(settings, failure_file=str(failure))
        os.environ[SETTINGS_ENV] = settings_json(settings)
        print(f"gpuflow serve: http://{args.host}:{args.port} (API docs at /docs); "
              f"{args.workers} worker(s), batches of up to {args.max_batch_size}, "
              f"--dtype {args.dtype}, --precision {args.precision}"
              + (f", {args.quantize} weights" if args.quantize else "")
              + "; /readyz turns 200 after warm-up (and says what runs)", flush=True)
        uvicorn.run("gpuflow.serve.app:app_from_env", factory=True, host=args.host,
                    port=args.port, workers=args.workers, log_level=args.log_level,
                    log_config=log_config(args.log_level))
        if not failure.is_file():
            return 0
        found = json.loads(failure.read_text())
    if found["user_error"]:
        raise UserError(f"{args.source} cannot be served: {found['reason']}")
    print(f"gpuflow serve: the model failed to load or warm up: {found['reason']}",
          file=sys.stderr)
    return 1


def _adapters(args: argparse.Namespace) -> tuple[tuple[tuple[str, str], ...], int]:
    """``--lora NAME=DIR ...`` as (name, directory) pairs, each name once, each a
    directory (the adapter's files are checked against the model once it loads), and the
    slots ``--max-loras`` gives them."""
    pairs: dict[str, str] = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora {spec}: give NAME=ADAPTER_DIR, e.g. "
                            "--lora support=runs/support/export.")
        if name in pairs:
            raise UserError(f"--lora names {name!r} twice: each adapter needs a name of its "
                            "own.")
        if not Path(path).is_dir():
            raise UserError(f"--lora {spec}: {path} is not a directory (an adapter is PEFT's "
                            "adapter_config.json and adapter_model.safetensors).")
        pairs[name] = path
    slots = args.max_loras if args.max_loras is not None else (DEFAULT_MAX_LORAS if pairs else 0)
    if slots < 0 or args.max_lora_rank < 1:
        raise UserError("--max-loras must be 0 (no adapters) or more, --max-lora-rank 1 or "
                        "more.")
    if pairs and not slots:
        raise UserError("--lora serves adapters, and --max-loras 0 leaves them no slot: give "
                        "--max-loras 1 or more.")
    return tuple(pairs.items()), slots


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with gpuflow's own messages (what runs once ready, a client gone
    early, a failure) through its handler at the same level."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["gpuflow"] = {"handlers": ["default"], "level": level.upper(),
                                    "propagate": False}
    return config
