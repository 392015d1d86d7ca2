"""Anthropic's Messages API: ``POST /v1/messages``, for clients written against Anthropic's SDK.

The request (``system``, ``messages`` of text, ``tool_use``, ``tool_result`` and ``thinking`` blocks, custom
``tools``, ``tool_choice``, ``thinking``, ``stop_sequences``, sampling) becomes a conversation of chat
messages and runs as a turn over the pooled cache that shares the most with it, as chat.completions does;
``usage.cache_read_input_tokens`` says how much of the prompt came from the cache (``input_tokens`` is the
rest, as Anthropic counts). The reply's blocks are ``thinking`` (its signature empty: there is nothing to
sign), ``text`` and ``tool_use``. A stream sends ``message_start``, ``ping``, per block
``content_block_start``, ``content_block_delta`` (``thinking_delta`` then ``signature_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason and the final usage)
and ``message_stop``; an error after the start is an ``error`` event. Errors are Anthropic-shaped
(``{"type": "error", "error": {"type", "message"}}``); ``x-api-key`` authenticates.

User messages may carry ``image`` blocks (``base64``, or ``url`` where the server allows remote images:
:mod:`mlxchat.server.images`), reused by their pixels as on chat.completions. Refused with a 400: document
and redacted-thinking blocks, images in tool results, server tools (web search, ...).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..reply import TextDelta, ThinkingDelta, ToolCallEvent
from ..session import ChatResult, Done, StreamEvent
from .chat_completions import generation_config
from .errors import ANTHROPIC_PATHS, ApiError, validated
from .guard import read_json
from .images import check_images
from .lifecycle import Exchange
from .turns import Messages, ToolChoice, Turn, check_model, tool_setup

if TYPE_CHECKING:
    from .state import ServerState

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=128)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking"]
    thinking: str


class Base64Source(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["base64"]
    media_type: str
    data: str

    @field_validator("media_type")
    @classmethod
    def _image(cls, value: str) -> str:
        if value not in IMAGE_MEDIA_TYPES:
            raise ValueError(f"media_type {value[:40]!r}: one of {', '.join(IMAGE_MEDIA_TYPES)}")
        return value


class UrlSource(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]

    def part(self) -> dict[str, Any]:
        """The block as an OpenAI ``image_url`` part (a ``data:`` URL, or the remote URL to fetch)."""
        source = self.source
        url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        for block in value if isinstance(value, list) else []:
            if isinstance(block, dict) and block.get("type") not in BLOCK_TYPES:
                raise ValueError(f"content blocks of type {block.get('type')!r} are not supported by this server "
                                 f"({', '.join(BLOCK_TYPES)})")
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ToolChoiceSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceSpec:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool choice of type 'tool' names the tool (and only it does)")
        return self


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesRequest(BaseModel):
    """The request fields mlxchat reads; unknown ones (``metadata``, ``service_tier``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    thinking: Thinking | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                raise ValueError(f"{index}: server tools ({tool.get('type')!r}) are not supported (custom tools only)")
        return value

    def choice(self) -> ToolChoice:
        spec = self.tool_choice
        if spec is None or spec.type == "auto":
            return ToolChoice("auto")
        if spec.type == "tool":
            return ToolChoice("function", spec.name)
        return ToolChoice("required" if spec.type == "any" else "none")

    def conversation(self) -> Messages:
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "\n".join(block.text for block in self.system)
        messages: Messages = [{"role": "system", "content": system}] if system else []
        names: dict[str, str] = {}
        asked: list[str] = []  # the tool_use ids of the reply before, which this user message must answer
        for index, message in enumerate(self.messages):
            if message.role == "user":
                self._answers(index, message, asked)
                asked = []
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            misplaced = {"user": ("tool_use", "thinking"), "assistant": ("tool_result", "image")}[message.role]
            if any(block.type in misplaced for block in message.content):
                article = "an" if message.role == "assistant" else "a"
                raise ApiError(400, f"messages.{index}: {article} {message.role} message cannot hold "
                                    f"{' or '.join(misplaced)} blocks", param=f"messages.{index}")
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            if message.role == "assistant":
                reply: dict[str, Any] = {"role": "assistant", "content": text}
                thinking = [b.thinking for b in message.content if isinstance(b, ThinkingBlock)]
                if thinking:
                    reply["reasoning_content"] = "\n".join(thinking)
                calls = [b for b in message.content if isinstance(b, ToolUseBlock)]
                reused = [call.id for call in calls if call.id in names or [c.id for c in calls].count(call.id) > 1]
                if reused:
                    raise ApiError(400, f"messages.{index}: tool_use id {reused[0][:64]!r} is used twice",
                                   param=f"messages.{index}")
                names.update({call.id: call.name for call in calls})
                asked = [call.id for call in calls]
                if calls:
                    reply["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.name, "arguments": json.dumps(c.input, ensure_ascii=False)}} for c in calls]
                messages.append(reply)
                continue
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    name = {"name": names[block.tool_use_id]} if block.tool_use_id in names else {}
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, **name, "content": block.text})
            if any(isinstance(b, ImageBlock) for b in message.content):
                messages.append({"role": "user", "content": [
                    b.part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                    for b in message.content if isinstance(b, ImageBlock | TextBlock)]})
            elif text:
                messages.append({"role": "user", "content": text})
        return messages


    @staticmethod
    def _answers(index: int, message: Any, asked: list[str]) -> None:
        """A user message answers each tool_use of the reply before it with a tool_result (as Anthropic's API
        requires; a tool_result that answers none is refused for every API, by the turn's
        :func:`~mlxchat.session_state.check_tool_answers`)."""
        given = [] if isinstance(message.content, str) else \
            [b.tool_use_id for b in message.content if isinstance(b, ToolResultBlock)]
        missing = [call_id for call_id in asked if call_id not in given]
        if missing:
            raise ApiError(400, f"messages.{index}: the tool_use {missing[0][:64]!r} of the message before has no "
                                "tool_result here", param=f"messages.{index}")


def stop_of(result: ChatResult, tokenizer: Any, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a reply: a stop sequence is told from the end of
    turn by finding it in the reply's own tokens (the text returned stops before it)."""
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    written = tokenizer.decode(result.tokens)
    found = sorted((written.find(s), s) for s in stops if s and s in written)
    return ("stop_sequence", found[0][1]) if found else ("end_turn", None)


class Blocks:
    """A reply's content blocks, built from a turn's events, and the stream events announcing them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None

    def feed(self, event: StreamEvent) -> list[dict[str, Any]]:
        if isinstance(event, ThinkingDelta):
            return self._delta("thinking", event.text)
        if isinstance(event, TextDelta):
            return self._delta("text", event.text)
        if isinstance(event, ToolCallEvent) and event.call.status != "ok":  # what the model wrote, as text
            return self._delta("text", event.call.raw) if event.opens_block else []
        if isinstance(event, ToolCallEvent):
            call, index = event.call, len(self.blocks)
            events = self.close()
            self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
            return [*events, {"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": call.id, "name": call.name, "input": {}}},
                    {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": call.function.arguments}},
                    {"type": "content_block_stop", "index": index}]
        return []

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self.close()
            self._open = kind
            self.blocks.append({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                           "content_block": dict(self.blocks[-1])})
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def close(self) -> list[dict[str, Any]]:
        """End the open text or thinking block, if any."""
        if self._open is None:
            return []
        index, kind = len(self.blocks) - 1, self._open
        self._open = None
        signature = [{"type": "content_block_delta", "index": index,
                      "delta": {"type": "signature_delta", "signature": ""}}] if kind == "thinking" else []
        return [*signature, {"type": "content_block_stop", "index": index}]


def usage_of(result: ChatResult) -> dict[str, Any]:
    report = result.report
    return {"input_tokens": report.prefilled_tokens, "output_tokens": report.generated_tokens,
            "cache_read_input_tokens": report.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def remembered(conversation: Messages, blocks: list[dict[str, Any]]) -> Messages:
    """The conversation with the reply as the client will send it back."""
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(b["text"] for b in blocks if b["type"] == "text")}
    thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    if thinking:
        reply["reasoning_content"] = "\n".join(thinking)
    calls = [b for b in blocks if b["type"] == "tool_use"]
    if calls:
        reply["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["input"], ensure_ascii=False)}} for c in calls]
    return [*conversation, reply]


async def prepare(state: ServerState, request: Any) -> MessageExchange:
    """``POST /v1/messages`` as a turn (its life is :class:`~mlxchat.server.lifecycle.Lifecycle`)."""
    parsed = validated(MessagesRequest, await read_json(request, state.settings))
    check_model(parsed.model, state.name, "not_found_error")
    conversation = parsed.conversation()
    thinking = None if parsed.thinking is None else parsed.thinking.type != "disabled"
    config = generation_config({"max_tokens": parsed.max_tokens, "temperature": parsed.temperature,
                                "top_p": parsed.top_p, "top_k": parsed.top_k, "stop": parsed.stop_sequences},
                               None if thinking is None else {"enable_thinking": thinking})
    tools, config = tool_setup(state.model, conversation, [t.chat_tool() for t in parsed.tools or []] or None,
                               parsed.choice(), config)
    remote = check_images(conversation, allow_remote=state.settings.allow_remote_images,
                          reads_images=state.model.supports_images)
    single = parsed.tool_choice is not None and parsed.tool_choice.disable_parallel_tool_use
    turn = Turn(state, conversation, tools=tools, config=config, max_calls=1 if single else None,
                tool_choice=parsed.choice().library)
    return MessageExchange(turn, parsed, conversation, state, remote)


class MessageExchange(Exchange):
    """An Anthropic message: its content blocks, from the turn's events."""

    def __init__(self, turn: Turn, parsed: MessagesRequest, conversation: Messages, state: ServerState,
                 remote_images: list[dict[str, Any]]):
        super().__init__(turn, parsed.stream, remote_images)
        self.conversation, self.state = conversation, state
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = Blocks()
        self.stops = parsed.stop_sequences or []

    def message(self, result: ChatResult | None) -> dict[str, Any]:
        reason, sequence = stop_of(result, self.state.model.tokenizer, self.stops) if result else (None, None)
        usage = usage_of(result) if result else {"input_tokens": 0, "output_tokens": 0}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.name,
                "content": self.blocks.blocks if result else [], "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}

    async def complete(self) -> dict[str, Any]:
        while (event := await self.turn.next()) is not None:
            self.blocks.feed(event)
        self.blocks.close()
        return self.message(self.turn.result)

    async def lines(self, first: StreamEvent | None) -> AsyncGenerator[str, None]:
        yield sse({"type": "message_start", "message": self.message(None)})
        yield sse({"type": "ping"})
        event = first
        while event is not None:
            if isinstance(event, Done):
                for announced in self.blocks.close():
                    yield sse(announced)
                final = self.message(event.result)
                yield sse({"type": "message_delta", "usage": final["usage"], "delta": {
                    "stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}})
                yield sse({"type": "message_stop"})
            else:
                for announced in self.blocks.feed(event):
                    yield sse(announced)
            event = await self.turn.next()

    def error_lines(self, error: ApiError) -> list[str]:
        return [sse(error.body(ANTHROPIC_PATHS[0]))]

    def remembered(self) -> Messages | None:
        return remembered(self.conversation, self.blocks.blocks)


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
