"""``POST /v1/completions`` (OpenAI-compatible): prompts, as text or token ids, one or a
list, each completed ``n`` times by the generation engine and answered whole, or streamed
as server-sent events with ``stream: true``; with ``usage`` token counts, and on request
the log-probabilities of the generated tokens and, with ``echo``, of the prompt's (as
evaluation harnesses score text)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import Field, StrictBool
from starlette.requests import Request

from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.requests import Delta, Done
from gpuflow.serve.generate.tokenizer import Tokenizer
from gpuflow.serve.routes.client import body_schema
from gpuflow.serve.routes.generation import Choice, Reply, accept, check_prompt, generate, usage
from gpuflow.serve.routes.logprobs import completion_logprobs
from gpuflow.serve.routes.sampling_fields import GenerationFields
from gpuflow.serve.routes.structured import compiled, requested

MAX_LOGPROBS = 20
router = APIRouter()


class CompletionRequest(GenerationFields):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="alternatives reported with each token")
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """One prompt, or each of a list's."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


@router.post("/v1/completions", summary="Complete a prompt (OpenAI-compatible)",
             openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request) -> Response:
    state, engine, body, target = await accept(request, CompletionRequest)
    body.check_served()
    prompts = _prompt_tokens(body, engine)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    constraint = await compiled(requested(body), engine)
    params = [body.sampling(state.generation_defaults, body.max_tokens, choice, body.logprobs,
                            prompt_logprobs, constraint) for choice in range(body.n)]
    answer = _Completion(target.name, engine.tokenizer, body)
    return await generate(request, prompts, params, answer, body.stream, target.adapter)


def _prompt_tokens(body: CompletionRequest, engine: GenerationEngine) -> list[list[int]]:
    """Each prompt's tokens (text through the tokenizer, with the special tokens it adds),
    checked against the vocabulary and the context."""
    prompts = body.prompts()
    found = []
    for index, prompt in enumerate(prompts):
        tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(tokens, body.max_tokens, engine,
                     param="prompt" if len(prompts) == 1 else f"prompt.{index}")
        found.append(tokens)
    return found


class _Completion(Reply):
    """Choices' events as OpenAI's ``text_completion``, whole or chunk by chunk; with
    ``echo`` each choice's text starts with its prompt's."""

    def __init__(self, model: str, tokenizer: Tokenizer, body: CompletionRequest) -> None:
        super().__init__(model, "cmpl")
        self.tokenizer, self.body = tokenizer, body
        self.echoed: set[int] = set()
        self.include_usage = body.include_usage

    def _prompt_text(self, choice: Choice) -> str:
        given = self.body.prompts()[choice.prompt_index]
        return given if isinstance(given, str) else self.tokenizer.decode(given)

    def _logprobs(self, choice: Choice, deltas: list[Delta],
                  echo: bool) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        entries = [entry for delta in deltas for entry in delta.logprobs]
        tokens = [entry.token for entry in entries]
        prompt_entries = choice.generation.prompt_logprobs or []
        if echo:
            return completion_logprobs(self.tokenizer, [*choice.generation.prompt, *tokens],
                                       [*prompt_entries, *entries])
        return completion_logprobs(self.tokenizer, tokens, entries)

    def _choice(self, choice: Choice, text: str, deltas: list[Delta],
                finish_reason: str | None, echo: bool) -> dict[str, Any]:
        return {"text": (self._prompt_text(choice) if echo else "") + text,
                "index": choice.index, "logprobs": self._logprobs(choice, deltas, echo),
                "finish_reason": finish_reason}

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        return self.payload("text_completion", [
            self._choice(c, c.text, c.deltas, c.done.finish_reason if c.done else None,
                         self.body.echo) for c in choices], usage=usage(choices))

    def chunks(self, choice: Choice, event: Delta | Done) -> list[dict[str, Any]]:
        echo = self.body.echo and choice.index not in self.echoed
        self.echoed.add(choice.index)
        if isinstance(event, Delta):
            part = self._choice(choice, event.text, [event], None, echo)
        else:
            part = self._choice(choice, "", [], event.finish_reason, echo)
        return [self.payload("text_completion", [part])]

    def text_chunk(self, choice: Choice, delta: Delta) -> bytes | None:
        if self.body.logprobs is not None or (self.body.echo
                                               and choice.index not in self.echoed):
            return None
        return self.templated(choice.index, lambda text: self.payload(
            "text_completion", [self._choice(choice, text, [], None, False)]), delta.text)

    def last(self, choices: list[Choice]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self.payload("text_completion", [], usage=usage(choices))]
