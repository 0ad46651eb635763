"""What one server process is told: the model to serve and the limits to serve it under."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from gpuflow.devices import resolve_device
from gpuflow.errors import UserError
from gpuflow.serve.batcher import INLINE_BELOW_MS
from gpuflow.serve.engine import EngineOptions
from gpuflow.serve.generate.limits import EngineLimits

SETTINGS_ENV = "GPUFLOW_SERVE_SETTINGS"


@dataclass(frozen=True)
class ServeSettings:
    """Everything a server process needs; JSON-able, so uvicorn workers can read it from env."""

    source: str
    workload: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    inline_below_ms: float = INLINE_BELOW_MS
    max_queue: int = 1024
    timeout_ms: float = 2000.0
    max_body_bytes: int = 8 << 20
    device: str = "auto"
    precision: str = "fp32"
    compile: bool = False
    max_autotune: bool = False  # decode steps compiled with inductor's kernel tuning
    cuda_graphs: bool | None = None  # None: decode steps on CUDA only (decode_graphs)
    quantize: str | None = None  # "int8": linear weights through torchao (serve/quantize.py)
    token: str | None = None
    threads: int | None = None
    retry_after_s: int = 1
    kv_cache_gib: float | None = None
    block_size: int = 16  # tokens per KV block
    prefix_cache: bool = True
    max_num_batched_tokens: int = 2048  # tokens one generation step computes at most
    chunked_prefill: bool = True  # False: a prompt is prefilled whole in one step
    ttft_timeout_ms: float | None = None  # a generation's wait for its first token
    workers: int = 1
    failure_file: str | None = None
    served_model_name: tuple[str, ...] = ()  # the first is the one answers name
    chat_template: str | None = None  # a Jinja file that replaces the model's own
    tool_call_parser: str = "auto"  # the syntax of tool calls (routes/tool_parsers.py)
    max_model_len: int | None = None
    num_speculative_tokens: int = 0  # drafted per decoding sequence a step (0: none)
    draft_model: str | None = None  # drafts them; None: prompt lookup
    prompt_lookup_max: int = 3
    lora: tuple[tuple[str, str], ...] = ()  # (name, directory) of each LoRA adapter at start
    max_loras: int = 0  # adapters held on the device at once (0: none served)
    max_lora_rank: int = 16
    engine_process: bool = True  # the generation engine's core in a process of its own
    dtype: str = "auto"  # the weights' (serve/dtypes.py)
    kv_cache_dtype: str = "auto"

    def check_device(self) -> None:
        """Refuse --cuda-graphs where the model will not run on a CUDA device, rather than
        run without them."""
        if not self.cuda_graphs:
            return
        device = resolve_device(self.device)
        if device.type != "cuda":
            raise UserError(f"--cuda-graphs captures CUDA graphs, and this server runs on "
                            f"{device} (--device {self.device}): drop --cuda-graphs, or serve "
                            "on a GPU with --device cuda.")

    def engine_limits(self) -> EngineLimits:
        """The generation engine's: ``--max-batch-size`` sequences running at once."""
        return EngineLimits(self.max_batch_size, self.max_queue, self.kv_cache_gib,
                            self.block_size, self.prefix_cache, self.max_num_batched_tokens,
                            self.chunked_prefill, self.num_speculative_tokens,
                            self.prompt_lookup_max, self.max_loras, self.max_lora_rank)

    @property
    def decode_graphs(self) -> bool:
        """Whether the generation engine's decode steps replay CUDA graphs where it serves on
        CUDA: unless --no-cuda-graphs, as the field's engines do (a CPU never has them)."""
        return self.cuda_graphs is not False

    def engine_options(self) -> EngineOptions:
        return EngineOptions(self.device, self.precision, self.compile, bool(self.cuda_graphs),
                             self.max_batch_size, self.quantize, self.dtype)


def settings_json(settings: ServeSettings) -> str:
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str) -> ServeSettings:
    return ServeSettings(**json.loads(text))
