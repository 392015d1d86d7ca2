"""ChatSession: one conversation over a model, served from the session's own cache.

Every turn renders the whole conversation through the checkpoint's chat template, tokenizes it, and lets
the session's :class:`~mlxchat.prompt_cache.PromptCache` cut back to the longest prefix it already
holds, so only the rest is prefilled. The model therefore always sees exactly what a stateless run
would show it (templates that drop earlier reasoning, edited history, regenerate and rewind all stay
right), and a turn costs what changed. Snapshots for caches that cannot be cut back are taken at the
start of the generation prompt, at the last prompt token and at the end of the reply.

A session owns no weights: it runs on the model's worker thread, one session at a time, in FIFO order.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from .errors import (
    ContextLengthError,
    InvalidInputError,
    SessionClosedError,
    SessionStateError,
    StreamConsumedError,
    TemplateError,
)
from .generation import FinishReason, GenerationChunk, GenerationConfig, GenerationReport
from .limits import check_text
from .messages import ChatMessage, ToolCall
from .prompt_cache import PromptCache, common_prefix_length
from .reply import ReplyEvent, ReplyParser, TextDelta, ThinkingDelta, ToolCallEvent
from .tools.parsing import ToolCallParser
from .tools.schema import ToolSpec, tool_schemas
from .worker import Cancelled, Worker

ContextPolicy = Literal["error", "truncate_oldest"]


class ChatResult(BaseModel):
    """One reply: visible text, reasoning (``None`` when the model did not reason), calls, and costs."""

    text: str
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    report: GenerationReport
    tokens: list[int] = Field(default_factory=list)
    """The reply's token ids (the stop token excluded)."""


class Done(BaseModel):
    """The last event of a stream, with the turn's result (already committed to the session)."""

    type: Literal["done"] = "done"
    result: ChatResult


StreamEvent = TextDelta | ThinkingDelta | ToolCallEvent | Done


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

    def render_prompt(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                      add_generation_prompt: bool = True, **template_kwargs: Any) -> tuple[str, list[int]]: ...

    def render_text(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str: ...

    def tool_parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser | None: ...

    def make_prompt_cache(self) -> PromptCache: ...

    def run_generation(self, tokens: Sequence[int], cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = ()) -> Iterator[GenerationChunk]: ...


@dataclass(frozen=True)
class TurnPlan:
    """One turn's prompt and where its prefill takes snapshots (see :meth:`ChatSession._plan`)."""

    prompt: list[int]
    in_reasoning: bool
    """The generation prompt opened a reasoning block: the reply starts inside it."""
    snapshot_at: list[int]


class _TurnEnd:
    """Sent by the worker after a turn's last event: how the generation ended (no text of its own)."""

    def __init__(self, parser: ReplyParser, report: GenerationReport, tokens: list[int]):
        self.parser, self.report, self.tokens = parser, report, tokens


class ChatStream:
    """One turn, streamed. Nothing runs until it is iterated; it is iterated once (sync or async).

    Breaking out of the loop cancels the reply at the next token and keeps exactly what was streamed so
    far as the assistant turn (``finish_reason="cancelled"``); :meth:`cancel` stops generating from
    anywhere while the loop goes on to receive the ``Done`` event. ``result`` holds the turn's result
    once it is done. The turn is committed here, on the reader's side, so that the history holds what the
    reader saw.
    """

    def __init__(self, session: ChatSession, prepare: Callable[[], None], config: GenerationConfig | None,
                 tools: list[ToolSpec]):
        self._session = session
        self._prepare = prepare
        self._config = config
        self._tools = tools
        self._cancel = Cancelled()
        self._used = False
        self._events_seen: list[ReplyEvent] = []
        self._ended: _TurnEnd | None = None
        self.result: ChatResult | None = None

    def cancel(self) -> None:
        """Stop generating at the next token."""
        self._cancel.set()

    def _start(self) -> None:
        if self._used:
            raise StreamConsumedError("a chat stream can be iterated only once")
        self._used = True
        self._session._begin(self._prepare)

    def _produce(self, cancel: Cancelled) -> Iterator[ReplyEvent | _TurnEnd]:
        """On the worker: the turn's events, remembering how it ended for an abandoned reader."""
        for item in self._session._run_turn(cancel, self._config, self._tools):
            if isinstance(item, _TurnEnd):
                self._ended = item
            yield item

    def _receive(self, item: ReplyEvent | _TurnEnd) -> StreamEvent:
        if isinstance(item, _TurnEnd):
            self.result = self._session._commit(self._events_seen, item, abandoned=False)
            return Done(result=self.result)
        self._events_seen.append(item)
        return item

    def _finish(self, abandoned: bool) -> None:
        # The worker has wound up by now (closing the inner stream waits for it).
        if abandoned and self.result is None and self._ended is not None:
            self.result = self._session._commit(self._events_seen, self._ended, abandoned=True)
        self._session._end()

    def __iter__(self) -> Iterator[StreamEvent]:
        self._start()
        return self._events()

    def _events(self) -> Iterator[StreamEvent]:
        inner = self._session._model.worker.stream(self._produce, self._cancel)
        abandoned = False
        try:
            for item in inner:
                yield self._receive(item)
        except (GeneratorExit, KeyboardInterrupt):  # the reader stopped (break, close, Ctrl-C)
            abandoned = True
            raise
        except ContextLengthError:
            self._session._undo_turn()
            raise
        finally:
            inner.close()
            self._finish(abandoned)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        self._start()
        return self._aevents()

    async def _aevents(self) -> AsyncIterator[StreamEvent]:
        inner = self._session._model.worker.astream(self._produce, self._cancel)
        abandoned = False
        try:
            async for item in inner:
                yield self._receive(item)
        except (GeneratorExit, asyncio.CancelledError):  # the reader stopped (aclose, task cancelled)
            abandoned = True
            raise
        except ContextLengthError:
            self._session._undo_turn()
            raise
        finally:
            await inner.aclose()
            self._finish(abandoned)

    def collect(self) -> ChatResult:
        """Run the turn to the end and return its result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def acollect(self) -> ChatResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class ChatSession:
    """A conversation over one model. See the module docstring for how turns reuse the cache."""

    def __init__(
        self,
        model: SessionCapableModel,
        *,
        system: str | None = None,
        default_config: GenerationConfig | dict[str, Any] | None = None,
        tools: Sequence[Any] | None = None,
        cache: PromptCache | None = None,
        context_policy: ContextPolicy = "error",
    ):
        """``cache``: a prompt cache of this model to start from (say, one a server keeps between requests
        that carry the whole conversation); the session takes it over.

        ``context_policy`` says what a turn does when the conversation outgrows the model's context:
        ``"error"`` raises :class:`ContextLengthError` (and the turn is not added); ``"truncate_oldest"``
        leaves the oldest whole turns out of the prompt (the system prompt stays; :attr:`messages` keeps
        them all) until the prompt leaves room for ``max_tokens``, or a quarter of the context if that is
        less. Either way a reply is cut at the end of the context (``finish_reason="length"``).
        """
        if context_policy not in ("error", "truncate_oldest"):
            raise ValueError(f"context_policy must be 'error' or 'truncate_oldest', got {context_policy!r}")
        self._model = model
        self._defaults = model.defaults.merged(default_config)
        self._system = system
        self._tools = self._offer(tools) or []
        self._messages: list[ChatMessage] = [ChatMessage(role="system", content=system)] if system else []
        self._cache: PromptCache | None = cache if cache is not None else model.make_prompt_cache()
        self._report: GenerationReport | None = None
        self._tool_calls: list[ToolCall] = []
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

    def send(self, content: str, *, config: GenerationConfig | dict[str, Any] | None = None,
             images: Sequence[bytes] = (), tools: Sequence[Any] | None = None) -> ChatResult:
        """Append a user turn and reply to it (blocking)."""
        return self.send_stream(content, config=config, images=images, tools=tools).collect()

    def send_stream(self, content: str, *, config: GenerationConfig | dict[str, Any] | None = None,
                    images: Sequence[bytes] = (), tools: Sequence[Any] | None = None) -> ChatStream:
        """:meth:`send`, streamed: the user turn is appended when the stream is first iterated.

        Empty content, or content that is not valid Unicode, is an :class:`InvalidInputError` (and nothing is
        added)."""
        self._check_open()
        offered = self._offered(tools)
        if images:
            raise ValueError(f"{self._model!r} takes no images (its plugin serves text only)")
        if not isinstance(content, str):
            raise InvalidInputError(f"send() takes the message as a string, got {type(content).__name__}")
        if not check_text(content, "the message").strip():
            raise InvalidInputError("nothing to send: the message is empty")
        message = ChatMessage(role="user", content=content)
        self._check_no_pending_calls()

        def prepare() -> None:
            self._check_no_pending_calls()
            self._messages.append(message)

        return ChatStream(self, prepare, _config(config), offered)

    def respond(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                tools: Sequence[Any] | None = None) -> ChatResult:
        """Reply to the conversation as it stands (the last turn is a user turn or a tool result)."""
        return self.respond_stream(config=config, tools=tools).collect()

    def respond_stream(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                       tools: Sequence[Any] | None = None) -> ChatStream:
        self._check_open()
        offered = self._offered(tools)
        self._check_can_respond()
        return ChatStream(self, self._check_can_respond, _config(config), offered)

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
        message = ChatMessage(role="tool", tool_call_id=call_id, name=name or pending[call_id].name, content=text)
        self._insert_tool_result(message)

    def send_tool_result(self, call_id: str, content: Any, name: str = "", *,
                         config: GenerationConfig | dict[str, Any] | None = None,
                         tools: Sequence[Any] | None = None) -> ChatResult:
        """:meth:`add_tool_result`, then :meth:`respond`."""
        self.add_tool_result(call_id, content, name)
        return self.respond(config=config, tools=tools)

    def send_tool_result_stream(self, call_id: str, content: Any, name: str = "", *,
                                config: GenerationConfig | dict[str, Any] | None = None,
                                tools: Sequence[Any] | None = None) -> ChatStream:
        self.add_tool_result(call_id, content, name)
        return self.respond_stream(config=config, tools=tools)

    def regenerate(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                   tools: Sequence[Any] | None = None) -> ChatResult:
        """Drop the last reply and reply again to the same conversation."""
        return self.regenerate_stream(config=config, tools=tools).collect()

    def regenerate_stream(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                          tools: Sequence[Any] | None = None) -> ChatStream:
        self._check_open()
        self._check_idle()
        if not self._messages or self._messages[-1].role != "assistant":
            raise SessionStateError("regenerate() needs the conversation to end with a reply")
        offered = self._offered(tools)
        self._messages.pop()
        self._tool_calls = []
        return ChatStream(self, self._check_can_respond, _config(config), offered)

    def rewind(self, keep: int) -> None:
        """Keep only the first ``keep`` messages (as :attr:`messages` lists them) and drop the rest.

        The next turn reuses the cache up to where the conversations still agree.
        """
        self._check_open()
        self._check_idle()
        if not 0 <= keep <= len(self._messages):
            raise ValueError(f"keep must be between 0 and {len(self._messages)}, got {keep}")
        del self._messages[keep:]
        self._hidden = min(self._hidden, len(self._rest()))
        self._tool_calls = []

    def set_system(self, system: str | None) -> None:
        """Replace the system prompt (``None`` removes it); the rest of the conversation stays."""
        self._check_open()
        self._check_idle()
        self._system = system
        rest = [m for m in self._messages[:1] if m.role != "system"] + self._messages[1:]
        self._messages = ([ChatMessage(role="system", content=system)] if system else []) + rest

    def reset(self, keep_system: bool = True) -> None:
        """Forget the conversation, the last report and its calls (the cache stays for prefix reuse)."""
        self._check_open()
        self._check_idle()
        keep = [m for m in self._messages[:1] if m.role == "system"] if keep_system else []
        self._messages = keep
        self._hidden = 0
        self._report = None
        self._tool_calls = []

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

        The session's system prompt is put first unless the transcript has its own. Follow with
        :meth:`start_from_history` when the transcript ends with a user turn or tool result.
        """
        self._check_open()
        self._check_idle()
        if any(m.role != "system" for m in self._messages):
            raise SessionStateError("prime_history() is for a session that has not spoken yet; reset() it first")
        primed = [ChatMessage.coerce(m) for m in messages]
        if self._system and not (primed and primed[0].role == "system"):
            primed.insert(0, ChatMessage(role="system", content=self._system))
        self._messages = primed
        self._hidden = 0
        ids = [int(m.group(1)) for msg in primed for c in msg.tool_calls or []
               if (m := re.fullmatch(r"call_(\d+)", c.id))]
        self._calls_made = max(ids, default=0)

    def start_from_history(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                           tools: Sequence[Any] | None = None) -> ChatResult:
        """Reply to a primed transcript (a cold start: the whole history is prefilled once)."""
        return self.respond(config=config, tools=tools)

    def start_from_history_stream(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                                  tools: Sequence[Any] | None = None) -> ChatStream:
        return self.respond_stream(config=config, tools=tools)

    # -- asyncio --------------------------------------------------------------------------------------

    async def asend(self, content: str, *, config: GenerationConfig | dict[str, Any] | None = None,
                    images: Sequence[bytes] = (), tools: Sequence[Any] | None = None) -> ChatResult:
        return await self.send_stream(content, config=config, images=images, tools=tools).acollect()

    def astream(self, content: str, *, config: GenerationConfig | dict[str, Any] | None = None,
                images: Sequence[bytes] = (), tools: Sequence[Any] | None = None) -> ChatStream:
        """:meth:`send_stream` for ``async for`` (the same stream object supports both)."""
        return self.send_stream(content, config=config, images=images, tools=tools)

    async def arespond(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                       tools: Sequence[Any] | None = None) -> ChatResult:
        return await self.respond_stream(config=config, tools=tools).acollect()

    async def asend_tool_result(self, call_id: str, content: Any, name: str = "", *,
                                config: GenerationConfig | dict[str, Any] | None = None,
                                tools: Sequence[Any] | None = None) -> ChatResult:
        self.add_tool_result(call_id, content, name)
        return await self.arespond(config=config, tools=tools)

    async def astart_from_history(self, *, config: GenerationConfig | dict[str, Any] | None = None,
                                  tools: Sequence[Any] | None = None) -> ChatResult:
        return await self.arespond(config=config, tools=tools)

    # -- the turn itself (runs on the model's worker) ---------------------------------------------------

    def _run_turn(self, cancel: Cancelled, override: GenerationConfig | None,
                  tools: list[ToolSpec]) -> Iterator[ReplyEvent | _TurnEnd]:
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
        for chunk in self._model.run_generation(plan.prompt, self._cache, config, cancel, plan.snapshot_at):
            if chunk.token is not None:
                tokens.append(chunk.token)
            yield from parser.feed(chunk.text)
            report = chunk.report or report
        yield from parser.finish()
        self._cache.snapshot()
        assert report is not None
        yield _TurnEnd(parser, report, tokens)

    def _plan(self, config: GenerationConfig, tools: list[ToolSpec], kwargs: dict[str, Any]) -> TurnPlan:
        """What this turn sends the model: one rendering of the visible conversation (text and ids), plus
        the text of its head to see whether the generation prompt opens a reasoning block; and for caches
        that cannot be cut back, where snapshots pay off: just before the last prompt token (a regenerate
        returns there), where the next turn's render will part from this prompt, and before earlier replies
        the cache does not hold yet."""
        assert self._cache is not None
        history, text, prompt = self._fitted_prompt(config, tools, kwargs)
        head = self._model.render_text(history, tools=tools or None, add_generation_prompt=False, **kwargs)
        generation_prompt = text[len(head):] if text.startswith(head) else text
        markers = self._model.reasoning_markers
        inside = markers is not None and generation_prompt.rfind(markers[0]) > generation_prompt.rfind(markers[1])
        snapshot_at: set[int] = set()
        if self._cache.needs_snapshots:
            snapshot_at = {len(prompt) - 1, *self._next_turn_agrees(history, tools, kwargs, prompt),
                           *self._reply_starts(history, tools, kwargs, prompt)}
        return TurnPlan(prompt=prompt, in_reasoning=inside, snapshot_at=sorted(snapshot_at))

    def _next_turn_agrees(self, history: list[dict[str, Any]], tools: list[ToolSpec], kwargs: dict[str, Any],
                          prompt: list[int]) -> list[int]:
        """How far the next turn's render will agree with this prompt: templates re-render a reply once a
        later turn exists (Qwen3.5 drops its reasoning, so the new render parts right after
        ``<|im_start|>assistant\\n``). Probed with a placeholder reply and question."""
        probe = history + [{"role": "assistant", "content": "\ue002"}, {"role": "user", "content": "\ue002"}]
        try:
            ids = self._model.render_prompt(probe, tools=tools or None, add_generation_prompt=False, **kwargs)[1]
        except TemplateError:
            return []
        return [common_prefix_length(ids, prompt)]

    def _fitted_prompt(self, config: GenerationConfig, tools: list[ToolSpec],
                       kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], str, list[int]]:
        """The visible history and its prompt (text and ids); under ``truncate_oldest``, the oldest whole
        turns are hidden until the prompt leaves room for the reply (see :meth:`__init__`)."""
        while True:
            head = self._messages[:1] if self._messages and self._messages[0].role == "system" else []
            history = [m.template_dict() for m in head + self._rest()[self._hidden:]]
            text, prompt = self._model.render_prompt(history, tools=tools or None, add_generation_prompt=True,
                                                     **kwargs)
            room = min(config.max_tokens, self._model.context_length // 4)
            later_turn = next((i for i, m in enumerate(self._rest()) if i > self._hidden and m.role == "user"),
                              None)
            if (self._context_policy == "error" or len(prompt) + room <= self._model.context_length
                    or later_turn is None):
                return history, text, prompt
            self._hidden = later_turn

    def _rest(self) -> list[ChatMessage]:
        """The conversation after the system prompt."""
        return self._messages[1:] if self._messages and self._messages[0].role == "system" else self._messages

    def _undo_turn(self) -> None:
        """Take back what the failed turn's start added (a turn that cannot fit the context)."""
        del self._messages[self._turn_start:]

    def _reply_starts(self, history: list[dict[str, Any]], tools: list[ToolSpec], kwargs: dict[str, Any],
                      prompt: list[int]) -> set[int]:
        """Where the turns before earlier replies end in ``prompt``, beyond what the cache holds (a primed
        transcript, an edit): templates re-render a reply differently once a later user turn exists (they
        drop its reasoning), so a cache that cannot be cut back wants a snapshot just before each reply,
        and one after the system prompt, which a reset conversation starts from again."""
        assert self._cache is not None
        held = common_prefix_length(self._cache.tokens, prompt)

        def ids(messages: list[dict[str, Any]]) -> list[int]:
            return self._model.render_prompt(messages, tools=tools or None, add_generation_prompt=False, **kwargs)[1]

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

    def _commit(self, events: list[ReplyEvent], end: _TurnEnd, abandoned: bool) -> ChatResult:
        """Append the reply as the reader received it, and record its report and calls."""
        parser, report = end.parser, end.report
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta)) if parser.saw_reasoning else None
        calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
        ok_calls = [c for c in calls if c.status == "ok"]
        finish: FinishReason = "cancelled" if abandoned else report.finish_reason
        if ok_calls and finish == "stop":
            finish = "tool_calls"
        report = report.model_copy(update={"finish_reason": finish})
        with_calls = not self._model.renders_tool_calls
        if abandoned:  # what the reader saw: its text, and the markup of the calls it saw that must stay
            kept = [c.raw for c in calls if with_calls or c.status == "invalid"]
            content = text + "".join(dict.fromkeys(kept))
        else:
            content = parser.content(with_calls)
        self._messages.append(ChatMessage(role="assistant", content=content, reasoning_content=thinking,
                                          tool_calls=ok_calls or None))
        self._report = report
        self._tool_calls = calls
        return ChatResult(text=text, thinking=thinking, tool_calls=calls, finish_reason=finish, report=report,
                          tokens=end.tokens)

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _begin(self, prepare: Callable[[], None]) -> None:
        with self._lock:
            self._check_open()
            if self._busy:
                raise SessionStateError("a turn of this session is in progress; finish or cancel it first")
            self._turn_start = len(self._messages)
            prepare()
            self._busy = True

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

    def _check_no_pending_calls(self) -> None:
        pending = self._pending_calls()
        if pending:
            raise SessionStateError(
                f"the last reply's tool calls {', '.join(c.id for c in pending)} are unanswered: answer each "
                "with add_tool_result() and then respond()"
            )

    def _check_can_respond(self) -> None:
        self._check_no_pending_calls()
        if not self._messages or self._messages[-1].role not in ("user", "tool"):
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


def _config(config: GenerationConfig | dict[str, Any] | None) -> GenerationConfig | None:
    if isinstance(config, dict):
        return GenerationConfig.model_validate(config)
    return config
