"""``POST /v1/chat/completions`` (OpenAI-compatible): messages rendered through the model's
chat template (or ``--chat-template``) with the generation prompt added, tokenized without
the tokenizer's own special tokens (a template that writes BOS gets no second one), and
completed by the generation engine: ``n`` choices, whole or streamed as
``chat.completion.chunk`` events (the role first, then content deltas, then the finish),
with ``usage`` and, when asked, the tokens' log-probabilities. With ``tools`` the answer's
calls are read back as ``tool_calls`` (``tool_calls.py``), streamed as OpenAI's tool-call
deltas while the model writes them (``tool_parsers.py``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request

from gpuflow.serve.errors import ApiError
from gpuflow.serve.generate.requests import Delta, Done
from gpuflow.serve.generate.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer
from gpuflow.serve.routes.client import body_schema
from gpuflow.serve.routes.generation import Choice, Reply, accept, check_prompt, generate, usage
from gpuflow.serve.routes.logprobs import chat_logprobs
from gpuflow.serve.routes.sampling_fields import GenerationFields
from gpuflow.serve.routes.structured import compiled, requested
from gpuflow.serve.routes.tool_calls import ToolCall, ToolChoice, ToolPlan, ToolSpec
from gpuflow.serve.routes.tool_parsers import ToolCallReader, syntax_of
from gpuflow.serve.state import ServerState

router = APIRouter()
MAX_TOP_LOGPROBS = 20


class TextPart(BaseModel):
    """One part of a message's content, as LangChain and the openai SDK send lists."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # none in an assistant's tool calls
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it; ``developer`` is the system prompt of
        OpenAI's newer models, which templates know as ``system``."""
        role = "system" if self.role == "developer" else self.role
        extra: dict[str, Any] = {k: v for k, v in (("name", self.name),
                                                   ("tool_call_id", self.tool_call_id))
                                 if v is not None}
        if self.tool_calls:
            extra["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return {"role": role, "content": self.text(), **extra}


class ChatRequest(GenerationFields):
    """The body of ``POST /v1/chat/completions``."""

    served_here = ("tools", "tool_choice", "parallel_tool_calls")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; see below")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="tokens to generate at most (default: the rest of the context)")
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None

    def check(self) -> None:
        self.check_served()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", "invalid_value",
                           "top_logprobs")
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise ApiError(400, f"messages.{index}.content: a {message.role} message "
                               "needs content.", "invalid_value", f"messages.{index}.content")


@router.post("/v1/chat/completions", summary="Answer a conversation (OpenAI-compatible)",
             openapi_extra=body_schema(ChatRequest))
async def chat_completions(request: Request) -> Response:
    state, engine, body, target = await accept(request, ChatRequest)
    body.check()
    prompt = _encode(state, engine.tokenizer, body)
    asked = body.max_completion_tokens or body.max_tokens
    max_tokens = asked or max(1, engine.context - len(prompt))
    check_prompt(prompt, max_tokens, engine, param="messages",
                 max_tokens_param="max_completion_tokens" if body.max_completion_tokens
                 else "max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    asked = requested(body)
    syntax = syntax_of(state.settings.tool_call_parser,
                       engine.tokenizer.template_source(state.chat_template))
    plan = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls, syntax)
    demanded = None if plan is None else plan.constraint()
    if demanded is not None:
        if asked is not None:
            raise ApiError(400, "tool_choice: a required or named tool call has its own "
                           "grammar; leave out response_format and guided_*.",
                           "invalid_value", "tool_choice")
        asked = (demanded, "tools")
    constraint = await compiled(asked, engine)
    params = [body.sampling(state.generation_defaults, max_tokens, choice, logprobs,
                            constraint=constraint)
              for choice in range(body.n)]
    answer = _ChatAnswer(target.name, engine.tokenizer, body.include_usage, plan)
    return await generate(request, [prompt], params, answer, body.stream, target.adapter)


def _encode(state: ServerState, tokenizer: Tokenizer, body: ChatRequest) -> list[int]:
    """The conversation's ids through the chat template; 400 without one, or when the
    template refuses the conversation (e.g. roles out of order), with its message."""
    tools = None
    if body.tools:
        if not tokenizer.template_reads_tools(state.chat_template):
            raise ApiError(400, "tools: this model's chat template does not render tools; "
                           "start the server with a --chat-template that does.",
                           "unsupported_parameter", "tools")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    try:
        return tokenizer.encode_chat([m.for_template() for m in body.messages],
                                     state.chat_template, tools)
    except NoChatTemplate:
        raise ApiError(400, "This model has no chat template (none in its tokenizer_config.json "
                       "or chat_template.jinja): start the server with --chat-template FILE, "
                       "or use /v1/completions.", "no_chat_template", "messages") from None
    except ChatTemplateError as exc:
        raise ApiError(400, f"The chat template refused the messages: {exc}",
                       "invalid_messages", "messages") from None


class _ChatAnswer(Reply):
    """Choices' events as OpenAI's ``chat.completion``, whole or chunk by chunk."""

    def __init__(self, model: str, tokenizer: Tokenizer, include_usage: bool,
                 tools: ToolPlan | None = None) -> None:
        super().__init__(model, "chatcmpl")
        self.tokenizer, self.include_usage, self.tools = tokenizer, include_usage, tools
        self.started: set[int] = set()
        self.readers: dict[int, ToolCallReader] = {}  # each streamed choice's

    def _logprobs(self, choice: Choice, deltas: list[Delta]) -> dict[str, Any] | None:
        if choice.generation.params.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, [e for delta in deltas for e in delta.logprobs])

    def _message(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish: its calls, when it made any."""
        finish = choice.done.finish_reason if choice.done else None
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if self.tools is not None:
            content, calls = self.tools.reader().message(choice.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = _finish(finish, calls=True)
        return message, finish

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        answers = [(c, *self._message(c)) for c in choices]
        return self.payload("chat.completion", [
            {"index": c.index, "message": message, "logprobs": self._logprobs(c, c.deltas),
             "finish_reason": finish}
            for c, message, finish in answers], usage=usage(choices))

    def chunks(self, choice: Choice, event: Delta | Done) -> list[dict[str, Any]]:
        chunks = []
        if choice.index not in self.started:  # each choice's first chunk names the role
            self.started.add(choice.index)
            chunks.append(self._chunk(choice, {"role": "assistant", "content": ""}))
        if isinstance(event, Delta):
            logprobs = self._logprobs(choice, [event])
            delta = ({"content": event.text} if self.tools is None
                     else self._reader(choice).feed(event.text))
            if delta or logprobs:
                chunks.append(self._chunk(choice, delta, logprobs))
            return chunks
        finish = event.finish_reason
        if self.tools is not None:  # what the reader held back, and whether it called
            reader = self._reader(choice)
            if delta := reader.finish():
                chunks.append(self._chunk(choice, delta))
            finish = _finish(finish, reader.called)
        chunks.append(self._chunk(choice, {}, finish_reason=finish))
        return chunks

    def _reader(self, choice: Choice) -> ToolCallReader:
        assert self.tools is not None
        if choice.index not in self.readers:
            self.readers[choice.index] = self.tools.reader()
        return self.readers[choice.index]

    def text_chunk(self, choice: Choice, delta: Delta) -> bytes | None:
        if (choice.index not in self.started or choice.generation.params.logprobs is not None
                or self.tools is not None):
            return None
        return self.templated(choice.index,
                              lambda text: self._chunk(choice, {"content": text}), delta.text)

    def _chunk(self, choice: Choice, delta: dict[str, Any],
               logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        extra = {"usage": None} if self.include_usage else {}
        return self.payload("chat.completion.chunk", [
            {"index": choice.index, "delta": delta, "logprobs": logprobs,
             "finish_reason": finish_reason}], **extra)

    def last(self, choices: list[Choice]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self.payload("chat.completion.chunk", [], usage=usage(choices))]


def _finish(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish of an answer that stopped on its own after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason
