"""``POST /v1/chat/completions``: OpenAI's chat API over a :class:`~mlxchat.session.ChatSession`.

Each request carries the whole conversation. It is validated field by field (``ChatCompletionRequest``),
served with the pooled prompt cache that shares the most with it (so a follow-up prefills only what
changed; ``usage.prompt_tokens_details.cached_tokens`` says how much was reused), and stopped as soon as
its client is gone, during prefill or decoding, streaming or not. Errors found before the reply starts
(a prompt that does not fit the context, a token id outside the vocabulary, messages the template
refuses) are 4xx responses; a stream that fails after it started ends with an error event and ``[DONE]``.

Honoured: ``tool_choice`` (``none`` offers no tools; ``required`` and a named function make the reply open
a call, see :func:`~mlxchat.server.turns.tool_setup`), ``parallel_tool_calls: false`` (the reply ends after
its first call), ``logprobs``/``top_logprobs`` (the model's own distribution, computed in one more pass over
the reply once it is done; a stream sends them with its last chunk), ``n`` (the choices one after another,
each prefilling only the last prompt token), ``response_format`` (``json_object`` and ``json_schema``,
strict or not, streamed or not: the reply is constrained to it, see :mod:`mlxchat.constraints`; a schema that
cannot be compiled is a 400 naming where it fails).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..generation import GenerationConfig, GenerationReport
from ..messages import ChatMessage, ToolCall
from ..reply import TextDelta, ThinkingDelta, ToolCallEvent
from ..session import ChatResult, Done, StreamEvent
from .errors import ApiError, invalid, validated
from .guard import ascii_digits, read_json
from .images import check_images
from .lifecycle import Exchange
from .turns import Messages, ToolChoice, Turn, check_model, seeded, tool_setup

if TYPE_CHECKING:
    from .state import ServerState

# OpenAI's and vLLM's bounds on the sampling fields.
_PENALTY = Field(None, ge=-2.0, le=2.0)
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
MAX_CHOICES = 16


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpecModel(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The request fields mlxchat reads. Unknown fields (``user``, ``metadata``, ...) are ignored, as
    OpenAI-compatible servers do; known ones that are not supported are refused, never ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = _PENALTY
    frequency_penalty: float | None = _PENALTY
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, lt=2**64)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolSpecModel] | None = None
    tool_choice: Literal["none", "auto"] | NamedToolChoice | Literal["required"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not ascii_digits(key) or len(key) > 12:
                raise ValueError(f"keys are token ids (non-negative integers), got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are between -100 and 100, got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for index, message in enumerate(self.messages):
            if isinstance(message.content, list):
                kinds = sorted({str(part.get("type")) for part in message.content} - {"text", "image_url"})
                if kinds:
                    raise ValueError(f"messages.{index}.content: content parts of type {', '.join(kinds)} are not "
                                     "supported (send text and image_url parts)")
                if message.role != "user" and any(p.get("type") == "image_url" for p in message.content):
                    raise ValueError(f"messages.{index}.content: images go in user messages")
            if message.role == "tool" and not message.tool_call_id:
                raise ValueError(f"messages.{index}: a tool message needs the tool_call_id it answers")
        return self

    def generation_config(self) -> GenerationConfig:
        values: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "top_k": None if self.top_k is None else max(self.top_k, 0),  # vLLM's -1: no top-k
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "seed": self.seed, "stop": self.stop,
            "max_tokens": self.max_completion_tokens or self.max_tokens, "response_format": self.response_format,
        }
        if self.logit_bias:
            values["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return generation_config(values, self.chat_template_kwargs)

    def tool_list(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def choice(self) -> ToolChoice:
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice("function", self.tool_choice.function.name)
        return ToolChoice(self.tool_choice or "auto")


def generation_config(values: dict[str, Any], template_kwargs: dict[str, Any] | None = None) -> GenerationConfig:
    """A generation config from a request's values (``None`` left out) and its chat-template keyword
    arguments (``enable_thinking`` among them); a value the config refuses is a 400 naming it."""
    values = {k: v for k, v in values.items() if v is not None}
    kwargs = dict(template_kwargs or {})
    if "enable_thinking" in kwargs:
        values["enable_thinking"] = kwargs.pop("enable_thinking")
    if kwargs:
        values["chat_template_kwargs"] = kwargs
    try:
        return GenerationConfig.model_validate(values)
    except ValidationError as exc:
        raise invalid(exc) from None


async def prepare(state: ServerState, request: Any) -> CompletionExchange:
    """``POST /v1/chat/completions`` as a turn (its life is :class:`~mlxchat.server.lifecycle.Lifecycle`)."""
    parsed = validated(ChatCompletionRequest, await read_json(request, state.settings))
    check_model(parsed.model, state.name)
    messages = [m.model_dump() for m in parsed.messages]
    remote = check_images(messages, allow_remote=state.settings.allow_remote_images,
                          reads_images=state.model.supports_images)
    tools, config = tool_setup(state.model, messages, parsed.tool_list(), parsed.choice(), parsed.generation_config())
    single = parsed.parallel_tool_calls is False
    turn = Turn(state, messages, tools=tools, config=config, max_calls=1 if single else None,
                tool_choice=parsed.choice().library)
    return CompletionExchange(turn, parsed, messages, config, state.name, remote)


class CompletionExchange(Exchange):
    """A chat completion: ``n`` choices one after another, each with its log-probabilities when asked."""

    def __init__(self, turn: Turn, parsed: ChatCompletionRequest, messages: Messages, config: GenerationConfig,
                 model_name: str, remote_images: list[dict[str, Any]]):
        super().__init__(turn, parsed.stream, remote_images)
        self.n, self.messages, self.config = parsed.n, messages, config
        self.top = (parsed.top_logprobs or 0) if parsed.logprobs else None
        self.completion = Completion(model_name, bool(parsed.stream_options and parsed.stream_options.include_usage))

    async def complete(self) -> dict[str, Any]:
        results: list[tuple[ChatResult, str, list[dict[str, Any]] | None]] = []
        for index in range(self.n):
            if index:
                self.turn.again(seeded(self.config, index))
            result = await self.turn.collect()
            results.append((result, self.turn.shown, None if self.top is None else await self.turn.logprobs(self.top)))
        return self.completion.response(results)

    def lines(self, first: StreamEvent | None) -> AsyncGenerator[str, None]:
        return self.completion.lines(self.turn, first, self.n, self.config, self.top)

    def error_lines(self, error: ApiError) -> list[str]:
        return [sse(error.body()), "data: [DONE]\n\n"]

    def remembered(self) -> Messages | None:
        return self.messages + [message_of(self.turn.result, self.turn.shown)] if self.turn.result else None


def message_of(result: ChatResult, content: str) -> dict[str, Any]:
    """The assistant message of a finished reply, whose ``content`` is what a stream of it shows (malformed
    calls as the text the model wrote, where it wrote them: :attr:`Turn.shown`)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if result.thinking is not None:
        message["reasoning_content"] = result.thinking
    calls = [c for c in result.tool_calls if c.status == "ok"]
    if calls:
        message["tool_calls"] = [c.model_dump() for c in calls]
    return message


def usage_of(reports: list[GenerationReport]) -> dict[str, Any]:
    """Usage of one prompt and its choices (the prompt counted once)."""
    prompt, generated = reports[0].prompt_tokens, sum(r.generated_tokens for r in reports)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": reports[0].cached_prompt_tokens}}


def finish_of(reason: str) -> str:
    return "stop" if reason == "cancelled" else reason


def call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.function.arguments}}


class Completion:
    """One request's reply: the envelope fields, and the SSE lines of its stream."""

    def __init__(self, model_name: str, include_usage: bool):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.include_usage = include_usage

    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def response(self, results: list[tuple[ChatResult, str, list[dict[str, Any]] | None]]) -> dict[str, Any]:
        choices = [{"index": index, "message": message_of(result, content),
                    "finish_reason": finish_of(result.finish_reason),
                    "logprobs": None if logprobs is None else {"content": logprobs}}
                   for index, (result, content, logprobs) in enumerate(results)]
        return self.envelope("chat.completion", choices, usage=usage_of([result.report for result, _, _ in results]))

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return sse(self.envelope("chat.completion.chunk", [choice]))

    async def lines(self, turn: Turn, first: StreamEvent | None, n: int, config: GenerationConfig,
                    top: int | None) -> AsyncGenerator[str, None]:
        """The SSE stream: per choice a role chunk, one chunk per event and the finish (with the reply's
        log-probabilities when asked); then usage if asked, and ``[DONE]``. A failure ends it with the
        lifecycle's error lines (:meth:`CompletionExchange.error_lines`)."""
        reports: list[GenerationReport] = []
        for index in range(n):
            if index:
                turn.again(seeded(config, index))
                first = await turn.next()
            yield self.chunk(index, {"role": "assistant", "content": ""})
            calls = 0
            event = first
            while event is not None:
                if isinstance(event, TextDelta):
                    yield self.chunk(index, {"content": event.text})
                elif isinstance(event, ThinkingDelta):
                    yield self.chunk(index, {"reasoning_content": event.text})
                elif isinstance(event, ToolCallEvent) and event.call.status == "ok":
                    yield self.chunk(index, {"tool_calls": [call_delta(calls, event.call)]})
                    calls += 1
                elif isinstance(event, ToolCallEvent) and event.opens_block:  # malformed: what the model wrote
                    yield self.chunk(index, {"content": event.call.raw})
                elif isinstance(event, Done):
                    logprobs = None if top is None else await turn.logprobs(top)
                    yield self.chunk(index, {}, finish_of(event.result.finish_reason), logprobs)
                    reports.append(event.result.report)
                event = await turn.next()
        if self.include_usage:
            yield sse(self.envelope("chat.completion.chunk", [], usage=usage_of(reports)))
        yield "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
