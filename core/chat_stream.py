"""ChatStream: one turn of a chat session, streamed, and what it needs from the session.

The stream is the reader's side of a turn: it starts the turn when first iterated, plans each reply on the
reader's thread, runs it as a job on the model's worker, hands its events over as they come, answers the
calls the session runs itself between replies, and commits what the reader saw. It reaches its session only
through a :class:`TurnHost` (the session's :class:`~mlxchat.session_turns.SessionTurns`), so the rules of a
turn (one at a time, what is committed, what an abandoned turn leaves) live in one place on each side.
"""

from __future__ import annotations

import asyncio
import functools
import queue
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from . import profiling
from .constraints import Constraint, ReplyShape
from .errors import InvalidInputError, SessionStateError, StreamConsumedError
from .generation import GenerationConfig, GenerationReport
from .messages import ChatMessage
from .reply import ReplyEvent, ReplyParser
from .session_types import ChatResult, Done, StreamEvent, ToolResultEvent
from .tools.context import Ask
from .tools.running import arun_tool, run_tool
from .tools.schema import Tool, ToolSpec
from .turn_plan import TurnPlan
from .turn_steps import Generate, Run, Step, Stop, ToolWork
from .worker import END, Cancelled, StreamJob, Together, Worker


class TurnEnd:
    """The last item of a reply's run on the worker: how the generation ended. The stream keeps it for the
    commit; the reader never sees it."""

    def __init__(self, parser: ReplyParser, report: GenerationReport, tokens: list[int]):
        self.parser, self.report, self.tokens = parser, report, tokens


class TurnHost(Protocol):
    """What a stream needs from its session: every change a turn makes to the session goes through these."""

    input_handler: Ask | None
    """Answers a tool's request for input while the stream runs the tool."""
    ending: Future[None] | None
    """The end of a turn whose reader left mid-reply (it ends once its reply has stopped on the worker):
    the next turn starts after it."""

    @property
    def worker(self) -> Worker: ...

    def begin(self, prepare: Callable[[], ChatMessage | None]) -> ChatMessage | None:
        """Start a turn: ``prepare`` changes the history for it (and returns the reply a regenerate replaces)."""
        ...

    def next_step(self, result: ChatResult | None, functions: dict[str, Tool], auto: bool) -> Step: ...

    def plan(self, config: GenerationConfig | None, tools: list[ToolSpec]) -> TurnPlan:
        """The next reply's plan, on the reader's thread."""
        ...

    def run(self, cancel: Cancelled, plan: TurnPlan, tools: list[ToolSpec], constraint: Constraint | None,
            prefix: str | None) -> Iterator[ReplyEvent | TurnEnd | Together]:
        """On the worker: the reply's events, then its :class:`TurnEnd`."""
        ...

    def commit(self, events: list[ReplyEvent], end: TurnEnd, abandoned: bool,
               replaces: ChatMessage | None) -> ChatResult:
        """Add the reply as the reader received it (a new version of ``replaces``, for a regenerate)."""
        ...

    def record(self, work: ToolWork, content: str) -> None:
        """Add the result of a call the session answered."""
        ...

    def undo(self, replaced: ChatMessage | None) -> None:
        """Take back what the turn's start did (``replaced`` comes back)."""
        ...

    def end(self) -> None: ...


@dataclass(frozen=True)
class TurnOptions:
    """How one turn's replies are made: the session's settings with the call's overrides."""

    config: GenerationConfig | None
    """Overrides of the session's defaults (merged when each reply is planned)."""
    tools: list[ToolSpec]
    functions: dict[str, Tool]
    """The tools the session can run itself, by name."""
    auto_tools: bool
    max_tool_rounds: int
    shape: ReplyShape
    """What ``response_format`` and ``tool_choice`` ask of the replies."""


class ChatStream:
    """One turn, streamed. Nothing runs until it is iterated; it is iterated once (sync or async).

    Breaking out of the loop (sync or async) cancels the reply at the next token and keeps exactly what was
    streamed so far as the assistant turn (``finish_reason="cancelled"``): before control returns to the
    code after a sync loop; after an async one, once the reply has stopped on the worker (the event loop
    never waits for it), which the session's next turn waits for and :meth:`aended` awaits. :meth:`cancel`
    stops generating from anywhere while the loop goes on to receive the ``Done`` event. ``result`` holds the
    turn's result once it is done. The turn is committed here, on the reader's side, so that the history
    holds what the reader saw. With automatic tool calls one stream covers the whole turn: every reply's
    events, a :class:`ToolResultEvent` per call the session answered, and one ``Done`` at the end.
    """

    def __init__(self, host: TurnHost, prepare: Callable[[], ChatMessage | None], options: TurnOptions):
        self._host = host
        self._prepare = prepare
        self._options = options
        self._cancel = Cancelled()
        self._paced = True
        """Whether its replies run at the reader's pace (a reader that collects takes everything anyway)."""
        self._used = False
        self._finished = False
        self._replaces: ChatMessage | None = None
        self._replies = 0
        self._job: StreamJob | None = None
        self._seen: list[ReplyEvent] = []
        self._ended: TurnEnd | None = None
        self._begun = False
        self._abandoning = False
        self._settled: Future[None] = Future()  # resolved once the turn has ended
        self.result: ChatResult | None = None

    def cancel(self) -> None:
        """Stop generating at the next token (or prefill chunk)."""
        self._cancel.set()

    # -- the turn, as steps any reader loop can drive ----------------------------------------------------

    def _use(self) -> None:
        if self._used:
            raise StreamConsumedError("a chat stream can be iterated only once")
        self._used = True

    def _begin(self) -> None:
        """Start the turn (after the session's previous turn has ended: an abandoned one ends once its reply
        has stopped)."""
        self._replaces = self._host.begin(self._prepare)
        self._begun = True

    def _steps(self) -> Generator[Generate | Run, ChatResult | None, ChatResult]:
        """Generations, and the calls the session answers between them, until the turn ends."""
        result: ChatResult | None = None
        rounds = 0
        while True:
            step = self._host.next_step(result, self._options.functions, self._options.auto_tools)
            if isinstance(step, Stop):
                if result is None:
                    raise SessionStateError("nothing to respond to")
                if step.finish is not None:
                    result = result.model_copy(update={"finish_reason": step.finish})
                return result
            if isinstance(step, Run) and result is not None:
                if rounds == self._options.max_tool_rounds:
                    return result.model_copy(update={"finish_reason": "max_tool_rounds"})
                rounds += 1
            sent = yield step
            if sent is not None:
                result = sent

    def _advance(self, steps: Generator[Generate | Run, ChatResult | None, ChatResult],
                 sent: ChatResult | None) -> Generate | Run | None:
        """The turn's next step; ``None`` once it is over (its result is then :attr:`result`)."""
        try:
            return steps.send(sent)
        except StopIteration as done:
            self.result = self._options.shape.parse(done.value)
            return None

    def _planned(self) -> tuple[TurnPlan, dict[str, float] | None]:
        """The next reply's plan, made on this thread (rendering, tokenizing and image preprocessing never
        hold up the worker's steps), and the phases it took for the reply's profile."""
        try:
            return self._host.plan(self._options.config, self._options.tools), profiling.take_pending()
        except InvalidInputError:  # the model cannot take the prompt (too long; text its tokenizer cannot split)
            self._take_back()  # (retrying it would fail again)
            raise

    def _take_back(self) -> None:
        """A turn that ends before its first reply produced anything (refused, or its reader left) is taken back
        whole: not added, or a regenerate's replaced reply restored."""
        if self._replies == 0:
            self._host.undo(self._replaces)
            self._replaces = None

    def _produce(self, cancel: Cancelled, planned: tuple[TurnPlan, dict[str, float] | None]
                 ) -> Iterator[ReplyEvent | Together]:
        """On the worker: one reply's events for the reader, and how it ended for the commit (kept here, so
        that a reader who left is committed what it saw)."""
        plan, timed = planned
        profiling.give_pending(timed)
        shape, first = self._options.shape, self._replies == 0
        constraint = shape.first if first else shape.later
        prefix = shape.prefix if first else None
        for item in self._host.run(cancel, plan, self._options.tools, constraint, prefix):
            if isinstance(item, TurnEnd):
                self._ended = item
            else:
                yield item

    def _open_reply(self, put: Callable[[Any], Any], planned: tuple[TurnPlan, dict[str, float] | None]) -> None:
        self._seen, self._ended = [], None
        self._job = self._host.worker.start(functools.partial(self._produce, planned=planned), self._cancel, put,
                                            paced=self._paced)

    def _received(self, item: Any) -> Any:
        """An item of the running reply (``END`` when it is over); a failure is raised here."""
        assert self._job is not None
        try:
            item = self._job.received(item)
        except InvalidInputError:
            self._job = None
            self._take_back()
            raise
        except Exception:  # the job failed, and has ended (an interrupt of the reader keeps it to stop)
            self._job = None
            raise
        if item is not END:
            self._seen.append(item)
        return item

    def _close_reply(self) -> ChatResult:
        """The reply is over: commit it (the first reply of a regenerate becomes a new version)."""
        assert self._ended is not None
        self._job = None
        result = self._host.commit(self._seen, self._ended, abandoned=False, replaces=self._replaces)
        self._replaces, self._replies = None, self._replies + 1
        return result

    def _abandon(self) -> bool:
        """The reader left mid-turn: tell the reply that runs to stop, waiting for nothing. Once it has wound
        up (on the worker's thread), what the reader saw of it is kept, a reply that produced nothing leaves
        the turn as if it never started, and the turn ends; the session's next turn waits for that. False
        when no reply runs (the reader ends the turn itself): one who left while the first reply was planned
        (an asyncio task cancelled then, Ctrl-C) takes the turn back whole too, since nothing was produced."""
        job, self._job = self._job, None
        if self._finished or self._abandoning:
            return False
        if job is None:
            if self._begun:
                self._take_back()
            return False
        self._abandoning = True
        self._host.ending = self._settled
        job.stop_soon(self._end_abandoned)
        return True

    def _end_abandoned(self) -> None:
        try:
            if self._ended is not None:
                self._host.commit(self._seen, self._ended, abandoned=True, replaces=self._replaces)
                self._replaces = None
            else:
                self._take_back()
        finally:
            self._finish()

    def _finish(self) -> None:
        if not self._finished and self._begun:
            self._finished = True
            try:
                if self._replaces is not None:  # a regenerate that failed: the reply it replaced comes back
                    self._host.undo(self._replaces)
                self._host.end()
            finally:
                self._settled.set_result(None)

    async def aended(self) -> None:
        """Wait (without blocking the event loop) until the turn has ended: a stream left mid-reply ends
        once its reply has stopped on the worker."""
        if self._begun:
            await asyncio.wrap_future(self._settled)

    def _tool_result(self, work: ToolWork, content: str) -> ToolResultEvent:
        self._host.record(work, content)
        return ToolResultEvent(call_id=work.call.id, name=work.call.name, content=content)

    # -- sync --------------------------------------------------------------------------------------------

    def __iter__(self) -> Generator[StreamEvent, None, None]:
        self._use()
        if self._host.ending is not None:
            self._host.ending.result()
        self._begin()
        return _Events(self, self._events())

    def _events(self) -> Generator[StreamEvent, None, None]:
        try:
            steps, sent = self._steps(), None
            while (step := self._advance(steps, sent)) is not None:
                if isinstance(step, Generate):
                    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
                    self._open_reply(items.put, self._planned())
                    while (item := self._received(items.get())) is not END:
                        yield item
                    sent = self._close_reply()
                else:
                    sent = None
                    for work in step.works:
                        yield self._tool_result(work, work.denial or run_tool(work.tool, work.call, work.arguments,
                                                                              self._host.input_handler))
            assert self.result is not None
            yield Done(result=self.result)
        except (GeneratorExit, KeyboardInterrupt):  # the reader stopped (break, close, Ctrl-C)
            if self._abandon():
                self._settled.result()  # sync code may wait: the turn has ended on return
            raise
        finally:
            if not self._abandoning:
                self._finish()

    def collect(self) -> ChatResult:
        """Run the turn to the end and return its result (its replies never wait for this thread: see
        :meth:`~mlxchat.worker.Worker.start`)."""
        self._paced = False
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    # -- asyncio -----------------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        self._use()
        return _AsyncEvents(self, self._aevents())

    async def _aevents(self) -> AsyncIterator[StreamEvent]:
        if self._host.ending is not None:
            await asyncio.wrap_future(self._host.ending)
        self._begin()
        try:
            steps, sent = self._steps(), None
            loop = asyncio.get_running_loop()
            while (step := self._advance(steps, sent)) is not None:
                if isinstance(step, Generate):
                    items: asyncio.Queue[Any] = asyncio.Queue()
                    planned = await asyncio.to_thread(self._planned)  # the event loop goes on meanwhile
                    self._open_reply(_threadsafe_put(loop, items), planned)
                    while (item := self._received(await items.get())) is not END:
                        yield item
                    sent = self._close_reply()
                else:
                    sent = None
                    for work in step.works:
                        content = work.denial or await arun_tool(work.tool, work.call, work.arguments,
                                                                 self._host.input_handler)
                        yield self._tool_result(work, content)
            assert self.result is not None
            yield Done(result=self.result)
        except (GeneratorExit, asyncio.CancelledError):  # the reader stopped (aclose, task cancelled)
            self._abandon()  # nothing on the event loop waits for the worker
            raise
        finally:
            if not self._abandoning:
                self._finish()

    async def acollect(self) -> ChatResult:
        self._paced = False
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class _Events(Generator[StreamEvent, None, None]):
    """The iterator of a :class:`ChatStream`. Its turn has begun when it is made (``iter()`` puts the prompt in
    the history), so closing or dropping it before its first item ends the turn, taken back whole as a reader
    who left before anything was produced: a generator that never ran would run none of its cleanup, and the
    session would stay in the turn for ever."""

    def __init__(self, stream: ChatStream, events: Generator[StreamEvent, None, None]):
        self._stream = stream
        self._events = events
        self._started = False

    def send(self, value: None) -> StreamEvent:
        self._started = True
        return self._events.send(value)

    def throw(self, *args: Any) -> StreamEvent:
        if not self._started:
            self._started = True
            self._stream._end_abandoned()
        return self._events.throw(*args)

    def __del__(self) -> None:
        if not self._started:
            self.close()


class _AsyncEvents:
    """The async iterator of a :class:`ChatStream`. A reader that breaks out of ``async for`` drops it at
    once, and then it stops the reply right away (an async generator would only be closed later by the
    event loop), without waiting for the worker: what was seen is committed once the reply has stopped,
    and the session's next turn waits for that. :meth:`aclose` returns once the turn has ended."""

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
        await self._stream.aended()

    def __del__(self) -> None:
        stream = self._stream
        if not stream._finished and not stream._abandoning and not stream._abandon():
            stream._finish()


def _threadsafe_put(loop: asyncio.AbstractEventLoop, items: asyncio.Queue[Any]) -> Callable[[Any], object]:
    """Put into an event loop's queue from another thread."""
    return lambda item: loop.call_soon_threadsafe(items.put_nowait, item)
