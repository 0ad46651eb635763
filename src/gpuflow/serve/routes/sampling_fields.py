"""The request fields OpenAI's completions and chat completions share: how many choices,
how to sample them, when to stop, how to stream. A field a request leaves out takes the
model's default from ``generation_config.json`` where it gives one, else OpenAI's."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gpuflow.model_dir import GenerationDefaults
from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.grammar import Constraint
from gpuflow.serve.generate.sampling import SamplingParams

MAX_STOP = 4
MAX_CHOICES = 128  # OpenAI's limit on n
# OpenAI fields gpuflow does not serve: a request that sets one gets a 400 naming it,
# rather than an answer that silently ignored what it asked for.
UNSERVED = ("logit_bias", "tools", "tool_choice", "functions", "function_call",
            "parallel_tool_calls", "audio", "modalities", "prediction", "reasoning_effort",
            "web_search_options", "suffix")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class GenerationFields(BaseModel):
    """Fields of both routes. Unknown fields are refused, as OpenAI does; booleans are
    JSON's true and false; NaN and infinities are refused (JSON has none, Python writes
    them). ``top_k``, ``repetition_penalty``, ``ignore_eos`` and the ``guided_*`` fields
    (structured outputs, ``structured.py``) are vLLM's additions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    served_here: ClassVar[tuple[str, ...]] = ()  # of UNSERVED, the fields a route serves

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate")
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 keeps every token")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    parallel_tool_calls: StrictBool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    suffix: str | None = None

    def check_served(self) -> None:
        """400 naming the first field set that gpuflow does not serve."""
        for name in UNSERVED:
            if getattr(self, name) is not None and name not in self.served_here:
                raise ApiError(400, f"{name} is not served on this route (tools are served "
                               "on /v1/chat/completions; there is no logit bias).",
                               "unsupported_parameter", name)
        if len(self.stops()) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} strings.", "invalid_stop", "stop")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, defaults: GenerationDefaults, max_tokens: int, choice: int = 0,
                 logprobs: int | None = None,
                 prompt_logprobs: int | None = None,
                 constraint: Constraint | None = None) -> SamplingParams:
        """The engine's parameters for choice number ``choice``: with a ``seed``, choice
        ``i`` draws from ``seed + i``, so the ``n`` choices differ and each repeats."""
        def pick(asked: Any, default: Any, fallback: Any) -> Any:
            return asked if asked is not None else default if default is not None else fallback

        top_k = pick(self.top_k, defaults.top_k, 0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, defaults.temperature, 1.0),
            top_p=pick(self.top_p, defaults.top_p, 1.0),
            top_k=max(top_k, 0),
            seed=None if self.seed is None else self.seed + choice,
            stop=tuple(self.stops()),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty,
                                    1.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=self.ignore_eos,
            constraint=constraint)
