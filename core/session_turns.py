"""A session's turns, one at a time: the :class:`~mlxchat.chat_stream.TurnHost` its streams drive.

A turn begins when its stream is first iterated (never while another turn of the session runs), each reply
is planned on the reader's thread and generated on the model's worker into the session's own cache, and
the reply is committed to the history as the reader received it. A turn that cannot start (its prompt
does not fit the context) or that a reader left before anything was produced is taken back whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from . import profiling
from .chat_stream import TurnEnd
from .constraints import Constraint
from .errors import SessionClosedError, SessionStateError
from .generation import GenerationConfig, GenerationReport
from .history import History
from .messages import ChatMessage, ReplyVersion
from .prefix_cache import PromptCachePool
from .prompt_cache import PromptCache
from .reply import ReplyEvent, ReplyParser, TextDelta, ThinkingDelta, ToolCallEvent
from .session_types import ChatResult, SessionCapableModel, TurnFinish
from .tools.context import Ask
from .tools.schema import Tool, ToolSpec
from .turn_plan import TurnPlan, TurnPlanner
from .turn_steps import Step, ToolWork, next_step
from .worker import Cancelled, Together, Worker


class SessionTurns:
    """The turns of one session over ``model``: its history, its cache (shared through ``prefixes`` when
    given) and whether a turn runs. Once closed, it refuses turns and has freed its cache."""

    def __init__(self, model: SessionCapableModel, history: History, cache: PromptCache,
                 prefixes: PromptCachePool | None, input_handler: Ask | None):
        self._model = model
        self._history = history
        self.cache: PromptCache | None = cache
        self._prefixes = prefixes
        if prefixes is not None:
            prefixes.add(cache)
        self.planner = TurnPlanner(model)
        self.input_handler = input_handler
        self.ending: Future[None] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._busy = False
        self._changer: int | None = None
        """The thread making a change outside a turn (:meth:`exclusive`)."""
        self._start = 0

    @property
    def worker(self) -> Worker:
        return self._model.worker

    def check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed")

    def check_idle(self) -> None:
        if self._changer is not None:
            raise SessionStateError("another thread is changing this session (an edit or a save); wait for it")
        if self._busy and self.ending is not None and not self.ending.done():  # an asyncio reader left it
            raise SessionStateError("the turn a reader left is still stopping on the model's worker: await its "
                                    "stream's aended() first (the next turn waits for it by itself)")
        if self._busy:
            raise SessionStateError("a turn of this session is in progress; finish or cancel it first")

    def close(self) -> None:
        with self.exclusive(open_required=False):
            self._closed = True
            if self._prefixes is not None and self.cache is not None:
                self._prefixes.discard(self.cache)
            self.cache = None

    @contextlib.contextmanager
    def exclusive(self, *, open_required: bool = True) -> Iterator[None]:
        """Hold the session for a change made outside a turn (an edit, a save, closing): it must be idle (and
        open), and a turn or change that another thread begins meanwhile is refused (checking, then changing,
        would lose a turn begun in between, or save a cache as it changes). A change the same thread makes
        inside one (a save reads the state through :meth:`ChatSession.export_state`) is part of it."""
        me = threading.get_ident()
        with self._lock:
            if self._changer == me:
                nested = True
            else:
                nested = False
                if open_required:
                    self.check_open()
                self.check_idle()
                self._changer = me
        try:
            yield
        finally:
            if not nested:
                self._changer = None

    # -- the turn, as its stream drives it ------------------------------------------------------------

    def begin(self, prepare: Callable[[], ChatMessage | None]) -> ChatMessage | None:
        with self._lock:
            self.check_open()
            self.check_idle()
            self._start = len(self._history.messages)
            replaced = prepare()
            self._busy = True
            return replaced

    def next_step(self, result: ChatResult | None, functions: dict[str, Tool], auto: bool) -> Step:
        return next_step(self._history, result, functions, auto)

    def plan(self, config: GenerationConfig | None, tools: list[ToolSpec]) -> TurnPlan:
        assert self.cache is not None
        plan = self.planner.plan(self._history.state, self.cache, config, tools)
        self._history.state.hidden = plan.hidden
        return plan

    def run(self, cancel: Cancelled, plan: TurnPlan, tools: list[ToolSpec], constraint: Constraint | None,
            prefix: str | None) -> Iterator[ReplyEvent | TurnEnd | Together]:
        config = plan.config
        parser = ReplyParser(self._model.reasoning_markers, plan.in_reasoning, self._model.tool_parser(tools),
                             self._history.new_call_id)
        tokens: list[int] = []
        report: GenerationReport | None = None
        assert self.cache is not None
        if self._prefixes is not None:  # its prefill copies what another conversation holds of the prompt
            self._prefixes.add(self.cache)
        parse = profiling.timed("parse", parser.feed)
        if constraint is not None:  # it starts after the reasoning this prompt leaves the reply
            constraint = dataclasses.replace(constraint, reasoning=plan.reasoning, reasoning_budget=config.budget)
        if prefix is not None:  # a required call in a format without a grammar: its opener, after the reasoning
            config = config.model_copy(update={"reply_prefix": prefix, "reply_prefix_after": plan.reasoning})
        for chunk in self._model.run_generation(plan.prompt, self.cache, config, cancel, plan.snapshot_at,
                                                constraint):
            if isinstance(chunk, Together):  # a decode step or prefill chunk, for the worker (with others' if it can)
                yield chunk
                continue
            if chunk.token is not None:
                tokens.append(chunk.token)
            yield from parse(chunk.text)
            report = chunk.report or report
        yield from parser.finish()
        self.cache.snapshot()
        assert report is not None
        yield TurnEnd(parser, report, tokens)

    def commit(self, events: list[ReplyEvent], end: TurnEnd, abandoned: bool,
               replaces: ChatMessage | None) -> ChatResult:
        """Add the reply as the reader received it, with its report and calls. A reply the reader left keeps
        what it saw: its text, and the markup of the calls it saw that the template would not render."""
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
        if abandoned:
            kept = [c.raw for c in calls if with_calls or c.status == "invalid"]
            content = text + "".join(dict.fromkeys(kept))
        else:
            content = parser.content(with_calls)
        self._history.add_reply(ReplyVersion(content=content, thinking=thinking, tool_calls=ok_calls, report=report),
                                calls, replaces)
        return ChatResult(text=text, thinking=thinking, tool_calls=calls, finish_reason=finish, report=report,
                          tokens=end.tokens)

    def record(self, work: ToolWork, content: str) -> None:
        self._history.answer(work.call, content)

    def undo(self, replaced: ChatMessage | None) -> None:
        self._history.take_back(self._start, replaced)

    def end(self) -> None:
        with self._lock:
            self._busy = False
