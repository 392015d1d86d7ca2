"""``POST /v1/chat/completions``: OpenAI's chat API over a :class:`~mlxchat.session.ChatSession`.

Each request carries the whole conversation. It is validated field by field (``ChatCompletionRequest``),
served with the pooled prompt cache that shares the most with it (so a follow-up prefills only what
changed; ``usage.prompt_tokens_details.cached_tokens`` says how much was reused), and stopped as soon as
its client is gone, during prefill or decoding, streaming or not. Errors found before the reply starts
(a prompt that does not fit the context, a token id outside the vocabulary, messages the template
refuses) are 4xx responses; a stream that fails after it started ends with an error event and ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ContextLengthError, InvalidInputError, MlxchatError, SessionStateError, TemplateError
from ..generation import GenerationConfig, GenerationReport
from ..messages import ChatMessage, ToolCall
from ..reply import TextDelta, ThinkingDelta, ToolCallEvent
from ..session import ChatResult, Done, StreamEvent
from .errors import ApiError, invalid, log

# OpenAI's and vLLM's bounds on the sampling fields.
_PENALTY = Field(None, ge=-2.0, le=2.0)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
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
    n: int = Field(1, ge=1)
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
    top_logprobs: int | None = None
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
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys are token ids (non-negative integers), got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are between -100 and 100, got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        unsupported = {
            "n > 1": self.n > 1,
            "logprobs": bool(self.logprobs) or self.top_logprobs is not None,
            "response_format": self.response_format not in (None, {"type": "text"}),
            "tool_choice": isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required",
            "parallel_tool_calls": self.parallel_tool_calls is False,
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported by this server yet (leave it unset)")
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
            "max_tokens": self.max_completion_tokens or self.max_tokens,
        }
        values = {k: v for k, v in values.items() if v is not None}
        if self.logit_bias:
            values["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        kwargs = dict(self.chat_template_kwargs or {})
        if "enable_thinking" in kwargs:
            values["enable_thinking"] = kwargs.pop("enable_thinking")
        if kwargs:
            values["chat_template_kwargs"] = kwargs
        try:
            return GenerationConfig.model_validate(values)
        except ValidationError as exc:
            raise invalid(exc) from None

    def tool_list(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def parse_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from None


def request_error(exc: MlxchatError) -> ApiError:
    """The API error for a failure found before any reply text: the request's fault, or ours (500)."""
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, InvalidInputError | TemplateError | SessionStateError):
        return ApiError(400, str(exc))
    log.error("generation failed", exc_info=exc)
    return ApiError(500, "the model failed while generating; see the server log", "server_error")


def message_of(result: ChatResult) -> dict[str, Any]:
    """The assistant message of a finished reply; a malformed call's raw text is kept as content."""
    raw = "".join(dict.fromkeys(c.raw for c in result.tool_calls if c.status == "invalid"))
    message: dict[str, Any] = {"role": "assistant", "content": (result.text + raw) or None}
    if result.thinking is not None:
        message["reasoning_content"] = result.thinking
    calls = [c for c in result.tool_calls if c.status == "ok"]
    if calls:
        message["tool_calls"] = [c.model_dump() for c in calls]
    return message


def usage_of(report: GenerationReport) -> dict[str, Any]:
    return {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.generated_tokens,
            "total_tokens": report.prompt_tokens + report.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": report.cached_prompt_tokens}}


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

    def response(self, result: ChatResult) -> dict[str, Any]:
        choice = {"index": 0, "message": message_of(result), "finish_reason": finish_of(result.finish_reason)}
        return self.envelope("chat.completion", [choice], usage=usage_of(result.report))

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return sse(self.envelope("chat.completion.chunk", [choice]))

    async def lines(self, first: StreamEvent, rest: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
        """The SSE stream: a role chunk, one chunk per event, the finish, usage if asked, ``[DONE]``."""
        yield self.chunk({"role": "assistant", "content": ""})
        calls = 0
        try:
            event: StreamEvent | None = first
            while event is not None:
                if isinstance(event, TextDelta):
                    yield self.chunk({"content": event.text})
                elif isinstance(event, ThinkingDelta):
                    yield self.chunk({"reasoning_content": event.text})
                elif isinstance(event, ToolCallEvent) and event.call.status == "ok":
                    yield self.chunk({"tool_calls": [call_delta(calls, event.call)]})
                    calls += 1
                elif isinstance(event, ToolCallEvent):  # malformed: the client sees what the model wrote
                    yield self.chunk({"content": event.call.raw})
                elif isinstance(event, Done):
                    yield self.chunk({}, finish_of(event.result.finish_reason))
                    if self.include_usage:
                        yield sse(self.envelope("chat.completion.chunk", [], usage=usage_of(event.result.report)))
                event = await anext(rest, None)
        except MlxchatError as exc:
            yield sse(request_error(exc).body())
        yield "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
