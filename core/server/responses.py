"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, and
``GET /v1/responses/{id}/input_items``.

A request's ``input`` (a string, or items: messages with or without ``"type": "message"``, ``function_call``,
``function_call_output`` and ``reasoning`` items as clients replay them) follows the items of the chain
that ``previous_response_id`` names, read from the :class:`~mlxchat.server.store.ResponseStore`; together,
with ``instructions`` as the system message, they are one conversation of chat messages, run as a turn
over the pooled cache that shares the most with it. A follow-up therefore continues the warm cache its
previous response left (only the new input is prefilled, ``usage.input_tokens_details.cached_tokens``
says so), a client that resends its whole item list is served the same way, and after a restart the
chain is read back from the store and prefilled once.

A stored response (``store`` defaults to true) is written before its turn runs and finished after, or
marked failed. The stream sends the official events: ``response.created``, ``response.in_progress``, per
output item ``response.output_item.added``, its content (``response.content_part.added``,
``response.reasoning_text.delta``/``.done`` or ``response.output_text.delta``/``.done``,
``response.content_part.done``; ``response.function_call_arguments.delta``/``.done`` for a call) and
``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it, ``response.failed`` on an error).

User messages may carry ``input_image`` parts (a ``data:`` URL, or an ``http(s)`` one where the server
allows remote images: :mod:`mlxchat.server.images`), reused by their pixels as on chat.completions.

``text.format`` (``json_object``, ``json_schema``) constrains the reply (see :mod:`mlxchat.constraints`).
Refused with a 400 (never ignored): tools other than functions, ``background``, ``conversation``,
``prompt``, item references, file ids and content other than text and images, log-probabilities
(``/v1/chat/completions`` returns them).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from ..reply import TextDelta, ThinkingDelta, ToolCallEvent
from ..session import ChatResult, Done, StreamEvent
from .chat_completions import FUNCTION_NAME, generation_config
from .errors import ApiError, validated
from .guard import ascii_digits, read_json
from .images import check_images
from .lifecycle import Exchange
from .store import ChainError
from .turns import Messages, ToolChoice, Turn, check_model, tool_setup

if TYPE_CHECKING:
    from .state import ServerState

_writes: set[asyncio.Future[None]] = set()  # store writes in flight (held until done)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None

    @model_validator(mode="after")
    def _text_or_image(self) -> ContentPart:
        if self.type == "input_image":
            if self.image_url is None:
                raise ValueError("an input_image part needs its image_url (a data: URL, or an http(s) URL where "
                                 "the server allows remote images); file ids are not supported")
            return self
        if self.type not in TEXT_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported by this server (send text "
                             "and input_image parts)")
        if (self.refusal if self.type == "refusal" else self.text) is None:
            raise ValueError(f"a {self.type} part needs its text")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.value for p in self.content)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content of the chat message: the text, or text and ``image_url`` parts in order."""
        if isinstance(self.content, str) or all(p.type != "input_image" for p in self.content):
            return self.text
        return [{"type": "image_url", "image_url": {"url": p.image_url}} if p.type == "input_image"
                else {"type": "text", "text": p.value} for p in self.content]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[ContentPart]

    @model_validator(mode="after")
    def _text_only(self) -> FunctionCallOutputItem:
        if not isinstance(self.output, str) and any(part.type == "input_image" for part in self.output):
            raise ValueError("a function_call_output holds text only: send its images in a user message")
        return self

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.value for p in self.output)


class ReasoningPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        """The reasoning itself when the client kept it, else its summary."""
        return "\n".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict`` beside
    the type, where chat.completions nests them under ``json_schema``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs a schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The same format in :attr:`~mlxchat.generation.GenerationConfig.response_format`'s shape."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.json_schema,
                                                       "strict": bool(self.strict)}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(BaseModel):
    """The request fields mlxchat reads. Unknown fields (``user``, ``prompt_cache_key``, ...) are ignored;
    known ones that cannot be honoured are refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                          "message.input_image.image_url", "computer_call_output.output.image_url",
                          "code_interpreter_call.outputs", "reasoning.encrypted_content",
                          "message.output_text.logprobs"]] | None = None
    """What to add to the output: nothing here needs adding (reasoning comes in the clear; the tools and
    images the others name are refused), except log-probabilities, which are refused."""
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _items_and_tools(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("input"), list):
            items = []
            for index, item in enumerate(data["input"]):
                if isinstance(item, dict) and "type" not in item and "role" in item:
                    item = {**item, "type": "message"}
                if isinstance(item, dict) and item.get("type") not in ITEM_TYPES:
                    raise ValueError(f"input.{index}: items of type {item.get('type')!r} are not supported "
                                     f"(send {', '.join(ITEM_TYPES)} items)")
                items.append(item)
            data = {**data, "input": items}
        for index, tool in enumerate(data.get("tools") or []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"tools.{index}: tools of type {tool.get('type')!r} are not supported (function "
                                 "tools only)")
        return data

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        refused = {
            "background": bool(self.background), "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "top_logprobs": self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ()),
        }
        named = [name for name, used in refused.items() if used]
        if named:
            raise ValueError(f"{', '.join(named)}: not supported by this server (log-probabilities come from "
                             "/v1/chat/completions)" if "top_logprobs" in named else
                             f"{', '.join(named)}: not supported by this server")
        if self.metadata is not None and (len(self.metadata) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise ValueError("metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return self

    def choice(self) -> ToolChoice:
        if isinstance(self.tool_choice, NamedFunction):
            return ToolChoice("function", self.tool_choice.name)
        return ToolChoice(self.tool_choice or "auto")

    def max_calls(self) -> int | None:
        limits = [n for n in (1 if self.parallel_tool_calls is False else None, self.max_tool_calls) if n]
        return min(limits) if limits else None

    def thinking(self) -> dict[str, Any]:
        """Chat-template keyword arguments: ``reasoning.effort`` none or minimal turns reasoning off, any other
        effort on (models that reason take no finer budget); ``chat_template_kwargs`` as in chat.completions."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None:
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
        return kwargs


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def stored_input(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items to store and list, shaped as OpenAI lists them: a string is a user message,
    a message's string content one text part; each item gets an id."""
    if isinstance(request.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": request.input}]
    else:
        items = [item.model_dump(exclude_none=True) for item in request.input]
    for item in items:
        if item["type"] == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    return [{"id": new_id(prefixes[item["type"]]), **item, "status": "completed"} if "id" not in item
            else {**item, "status": item.get("status", "completed")} for item in items]


def to_messages(items: list[dict[str, Any]]) -> Messages:
    """Chat messages from Responses items: reasoning, an assistant message and the function calls that follow
    are one assistant turn; each function call's output is a tool message."""
    messages: Messages = []
    reasoning: list[str] = []
    names: dict[str, str] = {}

    def assistant(fresh: bool) -> dict[str, Any]:
        """The assistant turn being read: the last message, unless reasoning or ``fresh`` starts another."""
        if not fresh and not reasoning and messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for raw in items:
        item = _item(raw)
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            after_calls = bool(messages and messages[-1].get("tool_calls"))  # text after calls: another turn
            if not isinstance(item.chat_content(), str):
                raise ApiError(400, "images go in user messages", param="input")
            assistant(after_calls)["content"] += item.text
        elif isinstance(item, MessageItem):
            role = "system" if item.role in ("system", "developer") else "user"
            content = item.chat_content()
            if role != "user" and not isinstance(content, str):
                raise ApiError(400, "images go in user messages", param="input")
            messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            assistant(False).setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            name = {"name": names[item.call_id]} if item.call_id in names else {}
            messages.append({"role": "tool", "tool_call_id": item.call_id, **name, "content": item.text})
    return messages


_ITEMS: TypeAdapter[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem] = TypeAdapter(InputItem)


def _item(raw: dict[str, Any]) -> MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem:
    return _ITEMS.validate_python(raw)


def usage_of(result: ChatResult, reasoning_tokens: int) -> dict[str, Any]:
    report = result.report
    return {"input_tokens": report.prompt_tokens,
            "input_tokens_details": {"cached_tokens": report.cached_prompt_tokens,
                                     "cache_write_tokens": report.prefilled_tokens},
            "output_tokens": report.generated_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": report.prompt_tokens + report.generated_tokens}


class Output:
    """A response's output items, built from a turn's events, and the stream events announcing them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""

    def feed(self, event: StreamEvent) -> list[dict[str, Any]]:
        if isinstance(event, ThinkingDelta):
            return self._delta("reasoning", event.text)
        if isinstance(event, TextDelta):
            return self._delta("message", event.text)
        if isinstance(event, ToolCallEvent) and event.call.status != "ok":  # what the model wrote, as text
            return self._delta("message", event.call.raw) if event.opens_block else []
        if isinstance(event, ToolCallEvent):
            call, closed = event.call, self.close()
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                    "arguments": call.function.arguments, "status": "completed"}
            index = len(self.items)
            self.items.append(item)
            where = {"item_id": item["id"], "output_index": index}
            return [*closed, {"type": "response.output_item.added", "output_index": index,
                              "item": {**item, "arguments": "", "status": "in_progress"}},
                    {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"],
                     "name": item["name"]},
                    {"type": "response.output_item.done", "output_index": index, "item": item}]
        return []

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            item: dict[str, Any] = ({"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                                    if kind == "reasoning" else
                                    {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []})
            self._open, self._text = {**item, "status": "in_progress"}, ""
            events += [{"type": "response.output_item.added", "output_index": len(self.items), "item": self._open},
                       {"type": "response.content_part.added", **self._where(), "part": self._part("")}]
        self._text += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, {"type": delta, **self._where(), "delta": text, **extra}]

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item (text or reasoning), if any."""
        if self._open is None:
            return []
        where, part = self._where(), self._part(self._text)
        item = {**self._open, "content": [part], "status": status}
        self.items.append(item)
        self._open = None
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
        else:
            done = {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []}
        return [done, {"type": "response.content_part.done", **where, "part": part},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}

    def _part(self, text: str) -> dict[str, Any]:
        assert self._open is not None
        if self._open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Reply:
    """One response: its id and the request fields it echoes, as an object in any state."""

    def __init__(self, state: ServerState, request: ResponsesRequest, tools: list[dict[str, Any]] | None,
                 config: Any):
        self.state, self.request = state, request
        self.id = new_id("resp")
        self.created = int(time.time())
        self.tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        self.config = config
        self.offered = tools

    def _format(self) -> dict[str, Any]:
        text = self.request.text
        if text is None or text.format is None:
            return {"type": "text"}
        return text.format.model_dump(by_alias=True, exclude_none=True)

    def body(self, status: str, output: list[dict[str, Any]] | None = None, *, usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None, incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.request
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, NamedFunction) else r.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "model": self.state.name, "output": output or [],
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": r.store, "temperature": self.config.temperature, "text": {"format": self._format()},
            "tool_choice": choice, "tools": self.tools, "top_p": self.config.top_p,
            "truncation": r.truncation or "disabled", "usage": usage, "user": None, "metadata": r.metadata or {},
        }

    def finished(self, result: ChatResult, output: list[dict[str, Any]]) -> dict[str, Any]:
        reasoning = "".join(item["content"][0]["text"] for item in output if item["type"] == "reasoning")
        tokens = len(self.state.model.tokenizer.encode(reasoning)) if reasoning else 0
        usage = usage_of(result, tokens)
        if result.finish_reason == "length":
            return self.body("incomplete", output, usage=usage, incomplete={"reason": "max_output_tokens"})
        return self.body("cancelled" if result.finish_reason == "cancelled" else "completed", output, usage=usage)

    def failed(self, error: ApiError, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        return self.body("failed", output, error={"code": code, "message": error.message})

    async def save(self, body: dict[str, Any]) -> None:
        """Record the response's end; the write goes on even when this request is being cancelled."""
        if self.request.store:
            write = asyncio.ensure_future(self.state.store.finish(body))
            _writes.add(write)
            write.add_done_callback(_writes.discard)
            await asyncio.shield(write)


async def prepare(state: ServerState, request: Any) -> ResponseExchange:
    """``POST /v1/responses`` as a turn (its life is :class:`~mlxchat.server.lifecycle.Lifecycle`); a stored
    response is written before its turn is admitted."""
    parsed = validated(ResponsesRequest, await read_json(request, state.settings))
    check_model(parsed.model, state.name)
    items = stored_input(parsed)
    history: list[dict[str, Any]] = []
    if parsed.previous_response_id is not None:
        try:
            history = await state.store.history(parsed.previous_response_id)
        except ChainError as exc:
            raise ApiError(404 if exc.missing else 400, str(exc), code="previous_response_not_found"
                           if exc.missing else None, param="previous_response_id") from None
    conversation = ([{"role": "system", "content": parsed.instructions}] if parsed.instructions else []) + \
        to_messages(history + items)
    text_format = parsed.text.format if parsed.text is not None and parsed.text.format is not None else None
    config = generation_config({"temperature": parsed.temperature, "top_p": parsed.top_p,
                                "max_tokens": parsed.max_output_tokens,
                                "response_format": text_format.response_format() if text_format else None},
                               parsed.thinking())
    config = state.model.defaults.merged(config)
    tools, config = tool_setup(state.model, conversation, [t.chat_tool() for t in parsed.tools or []] or None,
                               parsed.choice(), config)
    remote = check_images(conversation, allow_remote=state.settings.allow_remote_images,
                          reads_images=state.model.supports_images)
    reply = Reply(state, parsed, tools, config)
    if parsed.store:
        await state.store.create(reply.body("in_progress"), items)
    turn = Turn(state, conversation, tools=tools, config=config, max_calls=parsed.max_calls(),
                context_policy="truncate_oldest" if parsed.truncation == "auto" else "error",
                tool_choice=parsed.choice().library)
    return ResponseExchange(turn, parsed.stream, reply, conversation, remote)


class ResponseExchange(Exchange):
    """A response: its output items from the turn's events, and its record in the store (finished, failed,
    or cancelled when the client left mid-stream)."""

    def __init__(self, turn: Turn, stream: bool, reply: Reply, conversation: Messages,
                 remote_images: list[dict[str, Any]]):
        super().__init__(turn, stream, remote_images)
        self.reply, self.conversation = reply, conversation
        self.output = Output()
        self._sequence = 0
        self._saved = False

    async def _save(self, body: dict[str, Any]) -> None:
        await self.reply.save(body)
        self._saved = True

    def _finished(self, result: ChatResult) -> dict[str, Any]:
        return self.reply.finished(result, self.output.items)

    async def complete(self) -> dict[str, Any]:
        while (event := await self.turn.next()) is not None:
            self.output.feed(event)
        assert self.turn.result is not None
        self.output.close("incomplete" if self.turn.result.finish_reason == "length" else "completed")
        body = self._finished(self.turn.result)
        await self._save(body)
        return body

    def sse(self, event: dict[str, Any]) -> str:
        data = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def lines(self, first: StreamEvent | None) -> AsyncGenerator[str, None]:
        yield self.sse({"type": "response.created", "response": self.reply.body("in_progress")})
        yield self.sse({"type": "response.in_progress", "response": self.reply.body("in_progress")})
        event = first
        while event is not None:
            if isinstance(event, Done):
                status = "incomplete" if event.result.finish_reason == "length" else "completed"
                for announced in self.output.close(status):
                    yield self.sse(announced)
                body = self._finished(event.result)
                await self._save(body)
                kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield self.sse({"type": kind, "response": body})
            else:
                for announced in self.output.feed(event):
                    yield self.sse(announced)
            event = await self.turn.next()

    def error_lines(self, error: ApiError) -> list[str]:
        return [self.sse({"type": "response.failed", "response": self.reply.failed(error, self.output.items)})]

    async def failed(self, error: ApiError) -> None:
        if not self._saved:
            await self._save(self.reply.failed(error, self.output.items))

    async def left(self) -> None:
        """What the client saw is kept, as cancelled."""
        if not self._saved:
            self.output.close("incomplete")
            await self._save(self.reply.body("cancelled", self.output.items))

    def remembered(self) -> Messages | None:
        return self.conversation + to_messages(self.output.items)


async def retrieve(state: ServerState, request: Any) -> Any:
    """``GET /v1/responses/{id}``."""
    from starlette.responses import JSONResponse

    if request.query_params.get("stream") in ("true", "1"):
        raise ApiError(400, "stream: replaying a stored response as a stream is not supported", param="stream")
    return JSONResponse(await _stored(state, request.path_params["response_id"]))


async def delete(state: ServerState, request: Any) -> Any:
    """``DELETE /v1/responses/{id}``: the response goes; responses that continue it cannot be continued."""
    from starlette.responses import JSONResponse

    response_id = request.path_params["response_id"]
    if not await state.store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def input_items(state: ServerState, request: Any) -> Any:
    """``GET /v1/responses/{id}/input_items`` (``limit`` 1-100, default 20; ``order`` desc or asc; ``after``
    an item id)."""
    from starlette.responses import JSONResponse

    response_id = request.path_params["response_id"]
    query = request.query_params
    limit_text, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not ascii_digits(limit_text) or not 1 <= int(limit_text) <= 100:
        raise ApiError(400, "limit: an integer from 1 to 100", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: 'asc' or 'desc'", param="order")
    found = await state.store.input_items(response_id)
    if found is None:
        raise _not_found(response_id)
    items = found[::-1] if order == "desc" else found
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


async def _stored(state: ServerState, response_id: str) -> dict[str, Any]:
    body = await state.store.get(response_id)
    if body is None:
        raise _not_found(response_id)
    return body


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response {response_id[:128]!r} (responses made with store: false are not "
                         "kept)", "not_found_error", code="response_not_found")
