"""``POST /v1/completions`` (OpenAI-compatible): a prompt, as text or token ids, completed by
the generation engine and answered whole, or streamed as server-sent events with
``stream: true``; the answer carries ``usage`` token counts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request

from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.engine import Delta, Done, GenerationEngine
from gpuflow.serve.generate.sampling import SamplingParams
from gpuflow.serve.routes.client import body_schema
from gpuflow.serve.routes.generation import Reply, accept, check_prompt, generate, usage

MAX_STOP = 4
router = APIRouter()


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's fields; ``top_k`` as vLLM adds it).
    Fields it does not know are refused, as OpenAI does; booleans are JSON's true and
    false; NaN and infinities are refused (JSON has none; Python writes them)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 keeps every token")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    user: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k,
                              self.seed, tuple(self.stops()))

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


@router.post("/v1/completions", summary="Complete a prompt (OpenAI-compatible)",
             openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request) -> Response:
    state, engine, body = await accept(request, CompletionRequest)
    prompt = _prompt_tokens(body, engine)
    return await generate(request, prompt, body.sampling(),
                          _Completion(state.model_name, body), body.stream)


def _prompt_tokens(body: CompletionRequest, engine: GenerationEngine) -> list[int]:
    if len(body.stops()) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} strings.", "invalid_stop", "stop")
    prompt = body.prompt
    tokens = engine.lm.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    check_prompt(tokens, body.max_tokens, engine)
    return tokens


class _Completion(Reply):
    """A completion's events as OpenAI's ``text_completion``, whole or chunk by chunk."""

    def __init__(self, model: str, body: CompletionRequest) -> None:
        super().__init__(model, "cmpl")
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        text = "".join(delta.text for delta in deltas)
        return self.payload("text_completion", [self._choice(text, done.finish_reason)],
                            usage=usage(done))

    def chunks(self, event: Delta | Done) -> list[dict[str, Any]]:
        if isinstance(event, Delta):
            return [self.payload("text_completion", [self._choice(event.text, None)])]
        finish = [self.payload("text_completion", [self._choice("", event.finish_reason)])]
        if self.include_usage:
            finish.append(self.payload("text_completion", [], usage=usage(event)))
        return finish
