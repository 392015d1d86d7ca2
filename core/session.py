"""ChatSession: one conversation over a model, served from the session's own cache.

Every turn renders the whole conversation through the checkpoint's chat template, tokenizes it, and lets
the session's :class:`~mlxchat.prompt_cache.PromptCache` cut back to the longest prefix it already
holds, so only the rest is prefilled. The model therefore always sees exactly what a stateless run
would show it (templates that drop earlier reasoning, edited history, regenerate and rewind all stay
right), and a turn costs what changed. Caches that cannot be cut back take snapshots just before the last
prompt token, where the next turn's render will part from this prompt, and at the end of the reply.

Around the turn the session keeps what changes what history *is*, each costing only the tokens that
changed: message ids and times, reply versions (a regenerate keeps the old reply), checkpoints (back to a
message by id), and tools it calls by itself (``auto_tools``), pausing for the user's approval where a
tool asks for it.

A session owns no weights: its turns run on the model's worker thread, whose decode steps serve every
session decoding at that moment in one pass (:mod:`mlxchat.batching`).
Tools run on the reader's side (the thread iterating the stream, or the event loop), never on the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from . import profiling
from .batching import DecodeRow
from .errors import (
    ContextLengthError,
    ImageError,
    InvalidInputError,
    SessionClosedError,
    SessionStateError,
    StreamConsumedError,
    TemplateError,
)
from .generation import GenerationChunk, GenerationConfig, GenerationReport
from .images import ImageSource, ProcessedImage, as_data_url
from .limits import check_depth, check_strings, check_text
from .messages import ChatMessage, FunctionCall, ReplyVersion, ToolCall
from .multimodal import IMAGE_PART_TYPES, ImageTokens, MultimodalPrompt, expand_images, split_image_parts
from .prompt_cache import PromptCache, common_prefix_length
from .reply import ReplyEvent, ReplyParser, TextDelta, ThinkingDelta, ToolCallEvent
from .tools.context import Ask
from .tools.parsing import ToolCallParser
from .tools.running import arun_tool, run_tool
from .tools.schema import Tool, ToolSpec, tool_functions, tool_schemas
from .worker import END, Cancelled, StreamJob, Worker

ContextPolicy = Literal["error", "truncate_oldest"]
TurnFinish = Literal["stop", "length", "tool_calls", "cancelled", "max_tool_rounds", "approval_required"]
"""How a turn ended: a generation's own reasons, or where automatic tool calling stopped (too many
rounds; a call waiting for the user's approval)."""
DEFAULT_MAX_TOOL_ROUNDS = 8


class ChatResult(BaseModel):
    """One reply: visible text, reasoning (``None`` when the model did not reason), calls, and costs. With
    automatic tool calls it is the turn's last reply (the earlier ones and the tool results are in the
    history)."""

    text: str
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: TurnFinish
    report: GenerationReport
    tokens: list[int] = Field(default_factory=list)
    """The reply's token ids (the stop token excluded)."""


class ToolResultEvent(BaseModel):
    """A tool the session ran by itself (or a call the user denied), and the result the model will see."""

    type: Literal["tool_result"] = "tool_result"
    call_id: str
    name: str
    content: str


class Done(BaseModel):
    """The last event of a stream, with the turn's result (already committed to the session)."""

    type: Literal["done"] = "done"
    result: ChatResult


StreamEvent = TextDelta | ThinkingDelta | ToolCallEvent | ToolResultEvent | Done


@runtime_checkable
class SessionCapableModel(Protocol):
    """What a :class:`ChatSession` needs from a model (``GenerativeModel`` is one; so can a plugin's)."""

    defaults: GenerationConfig
    worker: Worker
    context_length: int

    @property
    def supports_tools(self) -> bool: ...

    @property
    def reasoning_markers(self) -> tuple[str, str] | None: ...

    @property
    def renders_tool_calls(self) -> bool: ...

    @property
    def supports_images(self) -> bool: ...

    @property
    def image_tokens(self) -> ImageTokens: ...

    def process_image(self, image: ImageSource) -> ProcessedImage: ...

    def render_prompt(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                      add_generation_prompt: bool = True, **template_kwargs: Any) -> tuple[str, list[int]]: ...

    def render_text(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str: ...

    def tool_parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser | None: ...

    def make_prompt_cache(self) -> PromptCache: ...

    def run_generation(self, prompt: Sequence[int] | MultimodalPrompt, cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = ()) -> Iterator[GenerationChunk | DecodeRow]:
        ...


@dataclass(frozen=True)
class TurnPlan:
    """One turn's prompt and where its prefill takes snapshots (see :meth:`ChatSession._plan`)."""

    prompt: list[int] | MultimodalPrompt
    in_reasoning: bool
    """The generation prompt opened a reasoning block: the reply starts inside it."""
    snapshot_at: list[int]


class _TurnEnd:
    """Sent by the worker after a turn's last event: how the generation ended (no text of its own)."""

    def __init__(self, parser: ReplyParser, report: GenerationReport, tokens: list[int]):
        self.parser, self.report, self.tokens = parser, report, tokens


@dataclass
class _Decision:
    approved: bool
    reason: str | None = None
    arguments: dict[str, Any] | None = None


@dataclass
class _ToolWork:
    """A call the session answers by itself: run ``tool`` with ``arguments``, or record ``denial``."""

    call: ToolCall
    tool: Tool
    arguments: dict[str, Any]
    denial: str | None = None


@dataclass
class _Generate:
    """Step: run a generation on the conversation as it stands."""


@dataclass
class _Run:
    """Step: answer these calls, then go on."""

    works: list[_ToolWork]


@dataclass
class _Stop:
    """Step: the turn ends here (``finish`` overrides the last reply's own reason when set)."""

    finish: TurnFinish | None = None


_Step = _Generate | _Run | _Stop


class ChatStream:
    """One turn, streamed. Nothing runs until it is iterated; it is iterated once (sync or async).

    Breaking out of the loop (sync or async) cancels the reply at the next token and keeps exactly what was
    streamed so far as the assistant turn (``finish_reason="cancelled"``), before control returns to the
    code after the loop; :meth:`cancel` stops generating from anywhere while the loop goes on to receive
    the ``Done`` event. ``result`` holds the turn's result once it is done. The turn is committed here, on
    the reader's side, so that the history holds what the reader saw. With automatic tool calls one stream
    covers the whole turn: every reply's events, a :class:`ToolResultEvent` per call the session answered,
    and one ``Done`` at the end.
    """

    def __init__(self, session: ChatSession, prepare: Callable[[], ChatMessage | None],
                 config: GenerationConfig | None, tools: list[ToolSpec], functions: dict[str, Tool],
                 auto_tools: bool, max_tool_rounds: int):
        self._session = session
        self._prepare = prepare
        self._config = config
        self._tools = tools
        self._functions = functions
        self._auto = auto_tools
        self._max_rounds = max_tool_rounds
        self._cancel = Cancelled()
        self._used = False
        self._finished = False
        self._replaces: ChatMessage | None = None
        self._replies = 0
        self._job: StreamJob | None = None
        self._seen: list[ReplyEvent] = []
        self._ended: _TurnEnd | None = None
        self.result: ChatResult | None = None

    def cancel(self) -> None:
        """Stop generating at the next token (or prefill chunk)."""
        self._cancel.set()

    # -- the turn, as steps any reader loop can drive ----------------------------------------------------

    def _start(self) -> None:
        if self._used:
            raise StreamConsumedError("a chat stream can be iterated only once")
        self._used = True
        self._replaces = self._session._begin(self._prepare)

    def _steps(self) -> Generator[_Generate | _Run, ChatResult | None, ChatResult]:
        """Generations, and the calls the session answers between them, until the turn ends."""
        result: ChatResult | None = None
        rounds = 0
        while True:
            step = self._session._next_step(result, self._functions, self._auto)
            if isinstance(step, _Stop):
                if result is None:
                    raise SessionStateError("nothing to respond to")
                if step.finish is not None:
                    result = result.model_copy(update={"finish_reason": step.finish})
                return result
            if isinstance(step, _Run) and result is not None:
                if rounds == self._max_rounds:
                    return result.model_copy(update={"finish_reason": "max_tool_rounds"})
                rounds += 1
            sent = yield step
            if sent is not None:
                result = sent

    def _advance(self, steps: Generator[_Generate | _Run, ChatResult | None, ChatResult],
                 sent: ChatResult | None) -> _Generate | _Run | None:
        """The turn's next step; ``None`` once it is over (its result is then :attr:`result`)."""
        try:
            return steps.send(sent)
        except StopIteration as done:
            self.result = done.value
            return None

    def _produce(self, cancel: Cancelled) -> Iterator[ReplyEvent | _TurnEnd | DecodeRow]:
        """On the worker: one reply's events, remembering how it ended for an abandoned reader."""
        for item in self._session._run_turn(cancel, self._config, self._tools):
            if isinstance(item, _TurnEnd):
                self._ended = item
            yield item

    def _open_reply(self, put: Callable[[Any], Any]) -> StreamJob:
        self._seen, self._ended = [], None
        self._job = self._session._model.worker.start(self._produce, self._cancel, put)
        return self._job

    def _received(self, item: Any) -> Any:
        """An item of the running reply (``END`` when it is over); a failure is raised here."""
        assert self._job is not None
        try:
            item = self._job.received(item)
        except ContextLengthError:
            self._job = None
            if self._replies == 0:
                self._session._undo_turn(self._replaces)
                self._replaces = None
            raise
        except Exception:  # the job failed, and has ended (an interrupt of the reader keeps it to stop)
            self._job = None
            raise
        if item is not END and not isinstance(item, _TurnEnd):
            self._seen.append(item)
        return item

    def _close_reply(self) -> ChatResult:
        """The reply is over: commit it (the first reply of a regenerate becomes a new version)."""
        assert self._ended is not None
        self._job = None
        result = self._session._commit(self._seen, self._ended, abandoned=False, replaces=self._replaces)
        self._replaces, self._replies = None, self._replies + 1
        return result

    def _abandon(self) -> None:
        """The reader left mid-turn: stop the reply that runs (waiting for it to wind up) and keep what the
        reader saw of it; a reply that produced nothing leaves the turn as if it never started."""
        job, self._job = self._job, None
        if job is None or self._finished:
            return
        job.stop()
        if self._ended is not None:
            self._session._commit(self._seen, self._ended, abandoned=True, replaces=self._replaces)
            self._replaces = None
        elif self._replies == 0:
            self._session._undo_turn(self._replaces)
            self._replaces = None

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._replaces is not None:  # a regenerate that failed: the reply it replaced comes back
                self._session._undo_turn(self._replaces)
            self._session._end()

    def _tool_result(self, work: _ToolWork, content: str) -> ToolResultEvent:
        self._session._record(work, content)
        return ToolResultEvent(call_id=work.call.id, name=work.call.name, content=content)

    # -- sync --------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamEvent]:
        self._start()
        return self._events()

    def _events(self) -> Iterator[StreamEvent]:
        try:
            steps, sent = self._steps(), None
            while (step := self._advance(steps, sent)) is not None:
                if isinstance(step, _Generate):
                    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
                    self._open_reply(items.put)
                    while (item := self._received(items.get())) is not END:
                        if not isinstance(item, _TurnEnd):
                            yield item
                    sent = self._close_reply()
                else:
                    sent = None
                    for work in step.works:
                        yield self._tool_result(work, work.denial or run_tool(work.tool, work.call, work.arguments,
                                                                              self._session.input_handler))
            assert self.result is not None
            yield Done(result=self.result)
        except (GeneratorExit, KeyboardInterrupt):  # the reader stopped (break, close, Ctrl-C)
            self._abandon()
            raise
        finally:
            self._finish()

    def collect(self) -> ChatResult:
        """Run the turn to the end and return its result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    # -- asyncio -----------------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        self._start()
        return _AsyncEvents(self, self._aevents())

    async def _aevents(self) -> AsyncIterator[StreamEvent]:
        try:
            steps, sent = self._steps(), None
            loop = asyncio.get_running_loop()
            while (step := self._advance(steps, sent)) is not None:
                if isinstance(step, _Generate):
                    items: asyncio.Queue[Any] = asyncio.Queue()
                    self._open_reply(_threadsafe_put(loop, items))
                    while (item := self._received(await items.get())) is not END:
                        if not isinstance(item, _TurnEnd):
                            yield item
                    sent = self._close_reply()
                else:
                    sent = None
                    for work in step.works:
                        content = work.denial or await arun_tool(work.tool, work.call, work.arguments,
                                                                 self._session.input_handler)
                        yield self._tool_result(work, content)
            assert self.result is not None
            yield Done(result=self.result)
        except (GeneratorExit, asyncio.CancelledError):  # the reader stopped (aclose, task cancelled)
            self._abandon()
            raise
        finally:
            self._finish()

    async def acollect(self) -> ChatResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class _AsyncEvents:
    """The async iterator of a :class:`ChatStream`. A reader that breaks out of ``async for`` drops it at
    once, and then it ends the turn right away (an async generator would only be closed later by the event
    loop, leaving the session busy for a moment): the reply is stopped, what was seen is committed."""

    def __init__(self, stream: ChatStream, events: AsyncIterator[StreamEvent]):
        self._stream = stream
        self._events = events

    def __aiter__(self) -> _AsyncEvents:
        return self

    async def __anext__(self) -> StreamEvent:
        return await anext(self._events)

    async def aclose(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()

    def __del__(self) -> None:
        stream = self._stream
        if not stream._finished:
            stream._abandon()
            stream._finish()


ConfigArg = GenerationConfig | dict[str, Any] | None


class ChatSession:
    """A conversation over one model. See the module docstring for how turns reuse the cache."""

    def __init__(
        self,
        model: SessionCapableModel,
        *,
        system: str | None = None,
        default_config: ConfigArg = None,
        tools: Sequence[Any] | None = None,
        cache: PromptCache | None = None,
        context_policy: ContextPolicy = "error",
        auto_tools: bool = False,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        new_id: Callable[[], str] | None = None,
        clock: Callable[[], float] | None = None,
        input_handler: Ask | None = None,
    ):
        """``cache``: a prompt cache of this model to start from (say, one a server keeps between requests
        that carry the whole conversation); the session takes it over.

        ``context_policy`` says what a turn does when the conversation outgrows the model's context:
        ``"error"`` raises :class:`ContextLengthError` (and the turn is not added); ``"truncate_oldest"``
        leaves the oldest whole turns out of the prompt (the system prompt stays; :attr:`messages` keeps
        them all) until the prompt leaves room for ``max_tokens``, or a quarter of the context if that is
        less. Either way a reply is cut at the end of the context (``finish_reason="length"``).

        ``auto_tools``: when the model calls tools that have a Python function (``@tool``), run them,
        record each result as a tool message and reply again, until a reply makes no calls or
        ``max_tool_rounds`` rounds have run (``finish_reason="max_tool_rounds"``); a tool marked
        ``needs_approval`` stops the turn first (``finish_reason="approval_required"``, see
        :meth:`respond_to_approval`). Each send/respond can override both.

        ``new_id`` and ``clock`` make message ids and times (by default random ids and ``time.time``);
        ``input_handler`` answers a tool's :meth:`~mlxchat.tools.ToolContext.request_input`.
        """
        if context_policy not in ("error", "truncate_oldest"):
            raise ValueError(f"context_policy must be 'error' or 'truncate_oldest', got {context_policy!r}")
        if max_tool_rounds < 0:
            raise ValueError(f"max_tool_rounds must be at least 0, got {max_tool_rounds}")
        self._model = model
        self._defaults = model.defaults.merged(default_config)
        self._new_id = new_id or (lambda: f"msg_{uuid.uuid4().hex[:24]}")
        self._clock = clock or time.time
        self.input_handler = input_handler
        self._system = system
        self._tools = self._offer(tools) or []
        self._functions = tool_functions(tools or [])
        self._auto_tools = auto_tools
        self._max_tool_rounds = max_tool_rounds
        self._messages: list[ChatMessage] = []
        if system:
            self._messages.append(self._stamped(ChatMessage(role="system", content=system)))
        self._cache: PromptCache | None = cache if cache is not None else model.make_prompt_cache()
        self._report: GenerationReport | None = None
        self._tool_calls: list[ToolCall] = []
        self._decisions: dict[str, _Decision] = {}
        self._images: dict[Any, ProcessedImage] = {}
        self._closed = False
        self._busy = False
        self._lock = threading.Lock()
        self._calls_made = 0
        self._context_policy = context_policy
        self._hidden = 0
        self._turn_start = 0

    # -- state ----------------------------------------------------------------------------------------

    @property
    def model(self) -> SessionCapableModel:
        return self._model

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation so far (a copy), the system turn first when there is one."""
        return [m.model_copy(deep=True) for m in self._messages]

    @property
    def report(self) -> GenerationReport | None:
        """The last reply's report; ``None`` before the first reply and after :meth:`reset`."""
        return self._report

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls the last reply made, ids filled in (invalid ones included, with their raw text)."""
        return [c.model_copy(deep=True) for c in self._tool_calls]

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """The last reply's calls that no tool result answers yet."""
        return [c.model_copy(deep=True) for c in self._pending_calls()]

    @property
    def pending_approvals(self) -> list[ToolCall]:
        """Pending calls to tools marked ``needs_approval`` that wait for :meth:`respond_to_approval`."""
        return [c.model_copy(deep=True) for c in self._pending_calls()
                if (tool := self._functions.get(c.name)) is not None and tool.needs_approval
                and c.id not in self._decisions]

    @property
    def turns(self) -> int:
        """How many user turns the conversation has."""
        return sum(m.role == "user" for m in self._messages)

    @property
    def has_images(self) -> bool:
        """Whether any message carries an image."""
        return any(isinstance(m.content, list) and any(p.get("type") in IMAGE_PART_TYPES for p in m.content)
                   for m in self._messages)

    @property
    def tools(self) -> list[ToolSpec]:
        return list(self._tools)

    @property
    def truncated_messages(self) -> int:
        """How many of the oldest messages (after the system prompt) the context policy leaves out of the
        prompt; 0 unless ``context_policy="truncate_oldest"`` had to drop turns."""
        return self._hidden

    @property
    def cache(self) -> PromptCache:
        self._check_open()
        assert self._cache is not None
        return self._cache

    # -- turns ----------------------------------------------------------------------------------------

    def send(self, content: str, *, config: ConfigArg = None, images: Sequence[ImageSource] = (),
             tools: Sequence[Any] | None = None, auto_tools: bool | None = None,
             max_tool_rounds: int | None = None) -> ChatResult:
        """Append a user turn and reply to it (blocking)."""
        return self.send_stream(content, config=config, images=images, tools=tools, auto_tools=auto_tools,
                                max_tool_rounds=max_tool_rounds).collect()

    def send_stream(self, content: str, *, config: ConfigArg = None, images: Sequence[ImageSource] = (),
                    tools: Sequence[Any] | None = None, auto_tools: bool | None = None,
                    max_tool_rounds: int | None = None) -> ChatStream:
        """:meth:`send`, streamed: the user turn is appended when the stream is first iterated.

        ``images`` (paths, encoded bytes, ``PIL.Image`` objects or ``data:`` URLs) go before the text in
        the user message, each as a ``{"type": "image", "image": <data: URL>}`` content part (so the
        conversation holds them whole); the model's processor reads them now, so a bad image is an error
        here. Empty content without images, content that is not valid Unicode, or images for a model that
        reads none are an :class:`InvalidInputError` (and nothing is added)."""
        self._check_open()
        if not isinstance(content, str):
            raise InvalidInputError(f"send() takes the message as a string, got {type(content).__name__}")
        if not check_text(content, "the message").strip() and not images:
            raise InvalidInputError("nothing to send: the message is empty")
        message = ChatMessage(role="user", content=self._with_images(content, images) if images else content)
        self._check_no_pending_calls()

        def prepare() -> None:
            self._check_no_pending_calls()
            self._messages.append(self._stamped(message))

        return self._stream(prepare, config, tools, auto_tools, max_tool_rounds)

    def _with_images(self, text: str, images: Sequence[ImageSource]) -> list[dict[str, Any]]:
        if not self._model.supports_images:
            raise ImageError(f"{self._model!r} reads no images (its checkpoint has no vision tower)")
        parts: list[dict[str, Any]] = []
        for image in images:
            url = as_data_url(image)
            self._processed(url)
            parts.append({"type": "image", "image": url})
        return parts + ([{"type": "text", "text": text}] if text else [])

    def respond(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatResult:
        """Reply to the conversation as it stands: it ends with a user turn or a tool result, or (with
        automatic tool calls) with a reply whose calls the session can now answer itself (after
        :meth:`respond_to_approval`)."""
        return self.respond_stream(config=config, tools=tools, auto_tools=auto_tools,
                                   max_tool_rounds=max_tool_rounds).collect()

    def respond_stream(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                       auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatStream:
        self._check_open()
        stream = self._stream(lambda: None, config, tools, auto_tools, max_tool_rounds)
        self._check_can_respond(stream._functions, stream._auto)
        stream._prepare = lambda: self._check_can_respond(stream._functions, stream._auto)
        return stream

    def add_tool_result(self, call_id: str, content: Any, name: str = "") -> None:
        """Answer the call ``call_id`` of the last reply (non-string content is sent as JSON)."""
        self._check_open()
        self._check_idle()
        pending = {c.id: c for c in self._pending_calls()}
        if call_id not in pending:
            raise SessionStateError(
                f"no unanswered tool call with id {call_id!r} (unanswered: {', '.join(pending) or 'none'})"
            )
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        self._answer(pending[call_id], text, name)

    def send_tool_result(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                         tools: Sequence[Any] | None = None) -> ChatResult:
        """:meth:`add_tool_result`, then :meth:`respond`."""
        self.add_tool_result(call_id, content, name)
        return self.respond(config=config, tools=tools)

    def send_tool_result_stream(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                                tools: Sequence[Any] | None = None) -> ChatStream:
        self.add_tool_result(call_id, content, name)
        return self.respond_stream(config=config, tools=tools)

    def respond_to_approval(self, call_id: str, approved: bool, reason: str | None = None,
                            arguments: dict[str, Any] | None = None) -> None:
        """Decide a call waiting for approval (:attr:`pending_approvals`). Approved, the tool runs when the
        turn continues, with ``arguments`` if given (which the history then records as the call's);
        denied, the model sees ``reason`` (or a plain "denied") as the tool's result. Once every waiting
        call is decided, :meth:`respond` continues the turn."""
        self._check_open()
        self._check_idle()
        waiting = {c.id: c for c in self.pending_approvals}
        if call_id not in waiting:
            raise SessionStateError(f"no call {call_id!r} waits for approval (waiting: {', '.join(waiting) or 'none'})")
        if arguments is not None:
            if not approved:
                raise ValueError("arguments edit an approved call; a denied call takes a reason")
            if not isinstance(arguments, dict):
                raise InvalidInputError(f"arguments must be a dict, got {type(arguments).__name__}")
            check_strings(check_depth(arguments, what="the arguments"), "the arguments")
            self._edit_call(call_id, arguments)
        if reason is not None:
            check_text(reason, "the reason")
        self._decisions[call_id] = _Decision(approved, reason, arguments)

    def regenerate(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                   auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatResult:
        """Reply again to the conversation before the last reply; the old reply is kept as another version
        of the same message (see :meth:`select_version`)."""
        return self.regenerate_stream(config=config, tools=tools, auto_tools=auto_tools,
                                      max_tool_rounds=max_tool_rounds).collect()

    def regenerate_stream(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                          auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatStream:
        self._check_open()
        self._check_idle()
        self._check_ends_with_reply()

        def prepare() -> ChatMessage:
            self._check_ends_with_reply()
            self._tool_calls = []
            return self._messages.pop()

        return self._stream(prepare, config, tools, auto_tools, max_tool_rounds)

    def select_version(self, message_id: str, index: int) -> None:
        """Show reply version ``index`` of the assistant message ``message_id`` (0 is its first reply). When
        that message is not the last one, the messages after it are dropped (they answered another
        version); the last message switches in place. The next turn reuses the cache as far as the
        conversation still agrees with it."""
        self._check_open()
        self._check_idle()
        position = self._position(message_id)
        message = self._messages[position]
        if message.role != "assistant" or not message.versions:
            raise SessionStateError(f"message {message_id!r} has no reply versions")
        message.select(index)
        del self._messages[position + 1 :]
        self._after_edit()

    def restore_checkpoint(self, message_id: str) -> None:
        """Keep the conversation up to and including message ``message_id``; drop what came after. The next
        turn reuses the cache up to there (through snapshots where layers cannot be cut back)."""
        self._check_open()
        self._check_idle()
        del self._messages[self._position(message_id) + 1 :]
        self._after_edit()

    def rewind(self, keep: int) -> None:
        """Keep only the first ``keep`` messages (as :attr:`messages` lists them) and drop the rest: the
        positional form of :meth:`restore_checkpoint`."""
        self._check_open()
        self._check_idle()
        if not 0 <= keep <= len(self._messages):
            raise ValueError(f"keep must be between 0 and {len(self._messages)}, got {keep}")
        del self._messages[keep:]
        self._after_edit()

    def set_system(self, system: str | None) -> None:
        """Replace the system prompt (``None`` removes it); the rest of the conversation stays."""
        self._check_open()
        self._check_idle()
        self._system = system
        head = [self._stamped(ChatMessage(role="system", content=system))] if system else []
        self._messages = head + self._rest()

    def reset(self, keep_system: bool = True) -> None:
        """Forget the conversation, the last report and its calls (the cache stays for prefix reuse)."""
        self._check_open()
        self._check_idle()
        keep = [m for m in self._messages[:1] if m.role == "system"] if keep_system else []
        self._messages = keep
        self._hidden = 0
        self._report = None
        self._tool_calls = []
        self._decisions = {}

    def close(self) -> None:
        """End the session and free its cache; the model stays open. Later calls raise."""
        self._check_idle()
        self._closed = True
        self._cache = None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the conversation and its prompt cache (snapshots included) to one file; :meth:`load` resumes
        it with nothing to prefill again (see :mod:`mlxchat.persistence`)."""
        from .persistence import save_session

        save_session(self, path)

    @classmethod
    def load(cls, model: SessionCapableModel, path: str | os.PathLike[str], **options: Any) -> ChatSession:
        """The session saved at ``path``, resumed over ``model`` (the model it was saved with: another one is a
        :class:`~mlxchat.errors.SavedStateError`); ``options`` replace saved settings (``tools``, ...)."""
        from .persistence import restore_session

        return restore_session(cls, model, path, **options)

    def prime_history(self, messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
        """Load a stored transcript into a session that has not spoken yet (no inference runs).

        The session's system prompt is put first unless the transcript has its own. Messages keep their
        ids, times and reply versions; those without get new ones. Follow with :meth:`start_from_history`
        when the transcript ends with a user turn or tool result.
        """
        self._check_open()
        self._check_idle()
        if any(m.role != "system" for m in self._messages):
            raise SessionStateError("prime_history() is for a session that has not spoken yet; reset() it first")
        primed = [self._stamped(ChatMessage.coerce(m).model_copy(deep=True)) for m in messages]
        if self._system and not (primed and primed[0].role == "system"):
            primed.insert(0, self._messages[0] if self._messages else self._stamped(
                ChatMessage(role="system", content=self._system)))
        ids = [m.id for m in primed]
        if len(set(ids)) != len(ids):
            raise InvalidInputError("the transcript repeats a message id")
        self._messages = primed
        self._hidden = 0
        numbers = [int(m.group(1)) for msg in primed for c in msg.tool_calls or []
                   if (m := re.fullmatch(r"call_(\d+)", c.id))]
        self._calls_made = max(numbers, default=0)

    def start_from_history(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None) -> ChatResult:
        """Reply to a primed transcript (a cold start: the whole history is prefilled once)."""
        return self.respond(config=config, tools=tools)

    def start_from_history_stream(self, *, config: ConfigArg = None,
                                  tools: Sequence[Any] | None = None) -> ChatStream:
        return self.respond_stream(config=config, tools=tools)

    # -- asyncio --------------------------------------------------------------------------------------

    async def asend(self, content: str, *, config: ConfigArg = None, images: Sequence[ImageSource] = (),
                    tools: Sequence[Any] | None = None, auto_tools: bool | None = None,
                    max_tool_rounds: int | None = None) -> ChatResult:
        return await self.send_stream(content, config=config, images=images, tools=tools, auto_tools=auto_tools,
                                      max_tool_rounds=max_tool_rounds).acollect()

    def astream(self, content: str, *, config: ConfigArg = None, images: Sequence[ImageSource] = (),
                tools: Sequence[Any] | None = None, auto_tools: bool | None = None,
                max_tool_rounds: int | None = None) -> ChatStream:
        """:meth:`send_stream` for ``async for`` (the same stream object supports both)."""
        return self.send_stream(content, config=config, images=images, tools=tools, auto_tools=auto_tools,
                                max_tool_rounds=max_tool_rounds)

    async def arespond(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                       auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatResult:
        return await self.respond_stream(config=config, tools=tools, auto_tools=auto_tools,
                                         max_tool_rounds=max_tool_rounds).acollect()

    async def aregenerate(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                          auto_tools: bool | None = None, max_tool_rounds: int | None = None) -> ChatResult:
        return await self.regenerate_stream(config=config, tools=tools, auto_tools=auto_tools,
                                            max_tool_rounds=max_tool_rounds).acollect()

    async def asend_tool_result(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                                tools: Sequence[Any] | None = None) -> ChatResult:
        self.add_tool_result(call_id, content, name)
        return await self.arespond(config=config, tools=tools)

    async def astart_from_history(self, *, config: ConfigArg = None,
                                  tools: Sequence[Any] | None = None) -> ChatResult:
        return await self.arespond(config=config, tools=tools)

    # -- the turn itself (runs on the model's worker) ---------------------------------------------------

    def _run_turn(self, cancel: Cancelled, override: GenerationConfig | None,
                  tools: list[ToolSpec]) -> Iterator[ReplyEvent | _TurnEnd | DecodeRow]:
        config = self._defaults.merged(override)
        kwargs = dict(config.chat_template_kwargs)
        if config.enable_thinking is not None:
            kwargs["enable_thinking"] = config.enable_thinking
        plan = self._plan(config, tools, kwargs)
        parser = ReplyParser(self._model.reasoning_markers, plan.in_reasoning, self._model.tool_parser(tools),
                             self._new_call_id)
        tokens: list[int] = []
        report: GenerationReport | None = None
        assert self._cache is not None
        parse = profiling.timed("parse", parser.feed)
        for chunk in self._model.run_generation(plan.prompt, self._cache, config, cancel, plan.snapshot_at):
            if isinstance(chunk, DecodeRow):  # a decode step, for the worker to run (with others' if it can)
                yield chunk
                continue
            if chunk.token is not None:
                tokens.append(chunk.token)
            yield from parse(chunk.text)
            report = chunk.report or report
        yield from parser.finish()
        self._cache.snapshot()
        assert report is not None
        yield _TurnEnd(parser, report, tokens)

    def _plan(self, config: GenerationConfig, tools: list[ToolSpec], kwargs: dict[str, Any]) -> TurnPlan:
        """What this turn sends the model: one rendering of the visible conversation (text and ids, images
        expanded to their placeholders), plus the text of its head to see whether the generation prompt
        opens a reasoning block; and for caches that cannot be cut back, where snapshots pay off: just
        before the last prompt token (a regenerate returns there), where the next turn's render will part
        from this prompt, before earlier replies the cache does not hold yet, and before each image (a
        changed image then costs only what follows it)."""
        assert self._cache is not None
        history, sources, text, prompt = self._fitted_prompt(config, tools, kwargs)
        head = self._model.render_text(history, tools=tools or None, add_generation_prompt=False, **kwargs)
        generation_prompt = text[len(head):] if text.startswith(head) else text
        markers = self._model.reasoning_markers
        inside = markers is not None and generation_prompt.rfind(markers[0]) > generation_prompt.rfind(markers[1])
        snapshot_at: set[int] = set()
        if self._cache.needs_snapshots:
            ids = _ids(prompt)
            snapshot_at = {len(ids) - 1, *self._next_turn_agrees(history, sources, tools, kwargs, ids),
                           *self._reply_starts(history, sources, tools, kwargs, ids)}
            if isinstance(prompt, MultimodalPrompt):
                snapshot_at |= {span.start for span in prompt.images}
        return TurnPlan(prompt=prompt, in_reasoning=inside, snapshot_at=sorted(snapshot_at))

    def _rendered(self, messages: list[dict[str, Any]], sources: list[Any], tools: list[ToolSpec],
                  kwargs: dict[str, Any], add_generation_prompt: bool) -> tuple[str, list[int] | MultimodalPrompt]:
        """Messages (images reduced to ``{"type": "image"}``) as text and as a prompt whose images, the first
        of ``sources``, are expanded to their placeholder tokens as the model's processor does."""
        text, ids = self._model.render_prompt(messages, tools=tools or None,
                                              add_generation_prompt=add_generation_prompt, **kwargs)
        count = sum(isinstance(m.get("content"), list) and sum(p.get("type") == "image" for p in m["content"])
                    for m in messages)
        if not count:
            return text, ids
        images = [self._processed(source) for source in sources[:count]]
        return text, expand_images(ids, images, self._model.image_tokens)

    def _processed(self, source: Any) -> ProcessedImage:
        """An image as the model reads it, preprocessed once per session (keyed by its data: URL)."""
        if source not in self._images:
            self._images[source] = self._model.process_image(source)
        return self._images[source]

    def _next_turn_agrees(self, history: list[dict[str, Any]], sources: list[Any], tools: list[ToolSpec],
                          kwargs: dict[str, Any], prompt: list[int]) -> list[int]:
        """How far the next turn's render will agree with this prompt: templates re-render a reply once a
        later turn exists (Qwen3.5 drops its reasoning, so the new render parts right after
        ``<|im_start|>assistant\\n``). Probed with a placeholder reply and question."""
        probe = history + [{"role": "assistant", "content": "\ue002"}, {"role": "user", "content": "\ue002"}]
        try:
            rendered = self._rendered(probe, sources, tools, kwargs, add_generation_prompt=False)[1]
        except TemplateError:
            return []
        return [common_prefix_length(_ids(rendered), prompt)]

    def _fitted_prompt(self, config: GenerationConfig, tools: list[ToolSpec], kwargs: dict[str, Any]
                       ) -> tuple[list[dict[str, Any]], list[Any], str, list[int] | MultimodalPrompt]:
        """The visible history (as the template sees it, images reduced to markers), its images, and its
        prompt (text and ids); under ``truncate_oldest``, the oldest whole turns are hidden until the
        prompt leaves room for the reply (see :meth:`__init__`)."""
        while True:
            head = self._messages[:1] if self._messages and self._messages[0].role == "system" else []
            history, sources = split_image_parts([m.template_dict() for m in head + self._rest()[self._hidden:]])
            text, prompt = self._rendered(history, sources, tools, kwargs, add_generation_prompt=True)
            room = min(config.max_tokens, self._model.context_length // 4)
            later_turn = next((i for i, m in enumerate(self._rest()) if i > self._hidden and m.role == "user"),
                              None)
            if (self._context_policy == "error" or len(prompt) + room <= self._model.context_length
                    or later_turn is None):
                return history, sources, text, prompt
            self._hidden = later_turn

    def _rest(self) -> list[ChatMessage]:
        """The conversation after the system prompt."""
        return self._messages[1:] if self._messages and self._messages[0].role == "system" else self._messages

    def _reply_starts(self, history: list[dict[str, Any]], sources: list[Any], tools: list[ToolSpec],
                      kwargs: dict[str, Any], prompt: list[int]) -> set[int]:
        """Where the turns before earlier replies end in ``prompt``, beyond what the cache holds (a primed
        transcript, an edit): templates re-render a reply differently once a later user turn exists (they
        drop its reasoning), so a cache that cannot be cut back wants a snapshot just before each reply,
        and one after the system prompt, which a reset conversation starts from again."""
        assert self._cache is not None
        held = common_prefix_length(self._cache.tokens, prompt)

        def ids(messages: list[dict[str, Any]]) -> list[int]:
            return _ids(self._rendered(messages, sources, tools, kwargs, add_generation_prompt=False)[1])

        starts: set[int] = set()
        for index in range(len(history) - 1, 1, -1):
            if history[index]["role"] != "assistant":
                continue
            try:
                starts.add(common_prefix_length(ids(history[:index]), prompt))
            except TemplateError:  # a prefix this template refuses to render: no snapshot there
                continue
            if min(starts) <= held:
                return starts
        if history and history[0]["role"] == "system":
            # Some templates refuse a system turn alone: two probes that differ only in the user's words
            # agree exactly up to where that turn's content starts.
            try:
                probes = [ids(history[:1] + [{"role": "user", "content": text}]) for text in ("a", "b")]
            except TemplateError:
                return starts
            starts.add(min(common_prefix_length(*probes), common_prefix_length(probes[0], prompt)))
        return starts

    def _commit(self, events: list[ReplyEvent], end: _TurnEnd, abandoned: bool,
                replaces: ChatMessage | None = None) -> ChatResult:
        """Add the reply as the reader received it (as a new version of ``replaces``, for a regenerate),
        and record its report and calls."""
        parser, report = end.parser, end.report
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta)) if parser.saw_reasoning else None
        calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
        ok_calls = [c for c in calls if c.status == "ok"]
        finish: TurnFinish = "cancelled" if abandoned else report.finish_reason
        if ok_calls and finish == "stop":
            finish = "tool_calls"
        report = report.model_copy(update={"finish_reason": finish})
        with_calls = not self._model.renders_tool_calls
        if abandoned:  # what the reader saw: its text, and the markup of the calls it saw that must stay
            kept = [c.raw for c in calls if with_calls or c.status == "invalid"]
            content = text + "".join(dict.fromkeys(kept))
        else:
            content = parser.content(with_calls)
        version = ReplyVersion(content=content, thinking=thinking, tool_calls=ok_calls, report=report)
        if replaces is not None:
            message = replaces
            message.versions = (message.versions or [_version_of(message)]) + [version]
        else:
            message = self._stamped(ChatMessage(role="assistant", versions=[version], selected_version=0))
        message.select(len(message.versions or []) - 1)
        self._messages.append(message)
        self._report = report
        self._tool_calls = calls
        return ChatResult(text=text, thinking=thinking, tool_calls=calls, finish_reason=finish, report=report,
                          tokens=end.tokens)

    # -- tools the session answers itself ---------------------------------------------------------------

    def _next_step(self, result: ChatResult | None, functions: dict[str, Tool], auto: bool) -> _Step:
        """What a turn does next, after ``result`` (``None``: it has just started)."""
        if result is not None and (not auto or result.finish_reason == "cancelled"):
            return _Stop()
        pending = self._pending_calls()
        if not pending:
            return _Generate() if self._messages and self._messages[-1].role != "assistant" else _Stop()
        works, waiting = [], False
        for call in pending:
            tool, decision = functions.get(call.name), self._decisions.get(call.id)
            if tool is None:
                continue  # the application answers it
            if decision is not None:
                denial = None if decision.approved else (decision.reason or "The user denied this call.")
                works.append(_ToolWork(call, tool, decision.arguments or call.arguments, denial))
            elif tool.needs_approval:
                waiting = True
            elif auto:
                works.append(_ToolWork(call, tool, call.arguments))
        if waiting:
            return _Stop("approval_required")  # nothing runs before every waiting call is decided
        return _Run(works) if works else _Stop("tool_calls")

    def _record(self, work: _ToolWork, content: str) -> None:
        self._answer(work.call, content, work.call.name)

    def _answer(self, call: ToolCall, content: str, name: str) -> None:
        self._decisions.pop(call.id, None)
        self._insert_tool_result(self._stamped(ChatMessage(role="tool", tool_call_id=call.id, name=name or call.name,
                                                           content=content)))

    def _load_decisions(self, saved: dict[str, Any]) -> None:
        """Approval decisions as :mod:`mlxchat.persistence` saved them."""
        self._decisions = {str(call_id): _Decision(bool(d["approved"]), d.get("reason"), d.get("arguments"))
                           for call_id, d in saved.items()}

    def _edit_call(self, call_id: str, arguments: dict[str, Any]) -> None:
        """Give a pending call other arguments, in the history and in the version it belongs to."""
        message = next(m for m in reversed(self._messages) if m.role == "assistant")
        text = json.dumps(arguments, ensure_ascii=False)
        versions = message.versions or []
        selected = versions[message.selected_version or 0].tool_calls if versions else []
        for call in (*(message.tool_calls or []), *selected):
            if call.id == call_id:
                call.function = FunctionCall(name=call.name, arguments=text)

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _stream(self, prepare: Callable[[], ChatMessage | None], config: ConfigArg, tools: Sequence[Any] | None,
                auto_tools: bool | None, max_tool_rounds: int | None) -> ChatStream:
        rounds = self._max_tool_rounds if max_tool_rounds is None else max_tool_rounds
        if rounds < 0:
            raise ValueError(f"max_tool_rounds must be at least 0, got {rounds}")
        functions = self._functions if tools is None else tool_functions(tools)
        auto = self._auto_tools if auto_tools is None else auto_tools
        return ChatStream(self, prepare, _config(config), self._offered(tools), functions, auto, rounds)

    def _stamped(self, message: ChatMessage) -> ChatMessage:
        """``message`` with an id and a time (kept if it has them)."""
        if message.id is None:
            message.id = self._new_id()
        if message.created_at is None:
            message.created_at = self._clock()
        return message

    def _position(self, message_id: str) -> int:
        for index, message in enumerate(self._messages):
            if message.id == message_id:
                return index
        raise SessionStateError(f"no message with id {message_id!r} in this conversation")

    def _after_edit(self) -> None:
        """The history was cut back: what referred to its old end goes."""
        self._hidden = min(self._hidden, len(self._rest()))
        self._tool_calls = []
        self._decisions = {}

    def _begin(self, prepare: Callable[[], ChatMessage | None]) -> ChatMessage | None:
        with self._lock:
            self._check_open()
            if self._busy:
                raise SessionStateError("a turn of this session is in progress; finish or cancel it first")
            self._turn_start = len(self._messages)
            replaced = prepare()
            self._busy = True
            return replaced

    def _undo_turn(self, replaced: ChatMessage | None) -> None:
        """Take back what a turn's start did (a turn that cannot fit the context, or that never ran)."""
        del self._messages[self._turn_start :]
        if replaced is not None:
            self._messages.append(replaced)

    def _end(self) -> None:
        with self._lock:
            self._busy = False

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed")

    def _check_idle(self) -> None:
        if self._busy:
            raise SessionStateError("a turn of this session is in progress; finish or cancel it first")

    def _offer(self, tools: Sequence[Any] | None) -> list[ToolSpec] | None:
        if tools is None:
            return None
        schemas = tool_schemas(tools)
        if schemas and not self._model.supports_tools:
            raise ValueError(f"{self._model!r} takes no tools (its chat template or plugin has no tool format)")
        return schemas

    def _offered(self, tools: Sequence[Any] | None) -> list[ToolSpec]:
        offered = self._offer(tools)
        return self._tools if offered is None else offered

    def _new_call_id(self) -> str:
        self._calls_made += 1
        return f"call_{self._calls_made}"

    def _pending_calls(self) -> list[ToolCall]:
        for index in range(len(self._messages) - 1, -1, -1):
            message = self._messages[index]
            if message.role == "assistant":
                answered = {m.tool_call_id for m in self._messages[index + 1 :] if m.role == "tool"}
                return [c for c in message.tool_calls or [] if c.id not in answered]
            if message.role == "user":
                return []
        return []

    def _check_ends_with_reply(self) -> None:
        if not self._messages or self._messages[-1].role != "assistant":
            raise SessionStateError("regenerate() needs the conversation to end with a reply")

    def _check_no_pending_calls(self) -> None:
        pending = self._pending_calls()
        if pending:
            raise SessionStateError(
                f"the last reply's tool calls {', '.join(c.id for c in pending)} are unanswered: answer each "
                "with add_tool_result() (or respond_to_approval()) and then respond()"
            )

    def _check_can_respond(self, functions: dict[str, Tool], auto: bool) -> None:
        """A reply needs a user turn or tool results to answer, or calls the session can answer itself."""
        if self._pending_calls():
            step = self._next_step(None, functions, auto)
            if not isinstance(step, _Run):
                self._check_no_pending_calls()
        elif not self._messages or self._messages[-1].role not in ("user", "tool"):
            raise SessionStateError("respond() needs the conversation to end with a user turn or a tool result")

    def _insert_tool_result(self, message: ChatMessage) -> None:
        """Insert a tool result so that results follow the order of their calls (templates that match
        results to calls by position need that, whatever order the caller answers in)."""
        index = max(i for i, m in enumerate(self._messages) if m.role == "assistant")
        order = [c.id for c in self._messages[index].tool_calls or []]
        position = index + 1
        while (position < len(self._messages) and self._messages[position].role == "tool"
               and order.index(self._messages[position].tool_call_id or "") < order.index(message.tool_call_id or "")):
            position += 1
        self._messages.insert(position, message)


def _ids(prompt: list[int] | MultimodalPrompt) -> list[int]:
    return list(prompt.ids) if isinstance(prompt, MultimodalPrompt) else prompt


def _threadsafe_put(loop: asyncio.AbstractEventLoop, items: asyncio.Queue[Any]) -> Callable[[Any], object]:
    """Put into an event loop's queue from another thread."""
    return lambda item: loop.call_soon_threadsafe(items.put_nowait, item)


def _version_of(message: ChatMessage) -> ReplyVersion:
    """The reply a message shows, as a version (for a message that has no versions yet: a primed one)."""
    return ReplyVersion(content=message.content if isinstance(message.content, str) else None,
                        thinking=message.reasoning_content, tool_calls=message.tool_calls or [])


def _config(config: ConfigArg) -> GenerationConfig | None:
    if isinstance(config, dict):
        return GenerationConfig.model_validate(config)
    return config
