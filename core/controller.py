"""ChatController: one conversation driven turn by turn for a UI or an agent (seed 002's controller).

It sits above one :class:`~mlxchat.session.ChatSession` and owns what a UI needs around the turns: a
queue of prompts sent while a reply streams, an observable immutable :class:`ChatState` with streamed
deltas coalesced (published at most every ``publish_interval`` seconds; tool calls, approvals, errors and
turn ends at once), stop / error / dismiss, tool approvals and tools' input requests surfaced as state,
and the model resolved at every turn.

Threads: turns run on the controller's own thread (the model's worker does the MLX work; tools run on
the controller's thread, so a tool waiting for the user's input blocks no model). Every method returns at
once and is safe from any thread; the primary way to watch it is :meth:`subscribe` (callbacks run on the
controller's threads, in order), and ``async for state in controller.states()`` serves asyncio.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from .errors import MlxchatError, SessionStateError
from .images import ImageSource, as_data_url
from .messages import ChatMessage, ToolCall
from .reply import TextDelta, ThinkingDelta, ToolCallEvent
from .session import ChatSession, ChatStream, Done, SessionCapableModel, ToolResultEvent

Status = Literal["idle", "streaming", "awaiting_approval", "awaiting_input", "error"]


class QueuedPrompt(BaseModel):
    """A prompt sent while a reply was streaming, waiting for its turn."""

    model_config = ConfigDict(frozen=True)

    id: str
    text: str
    images: list[str] = Field(default_factory=list)
    """The images sent with it, as ``data:`` URLs."""


class InputRequest(BaseModel):
    """A question a running tool asks the user (answer it with :meth:`ChatController.respond_to_input`)."""

    model_config = ConfigDict(frozen=True)

    id: str
    prompt: str
    call_id: str
    name: str


class ChatState(BaseModel):
    """What a UI shows, at one moment (immutable; a new state is published for every change)."""

    model_config = ConfigDict(frozen=True)

    messages: list[ChatMessage] = Field(default_factory=list)
    status: Status = "idle"
    streaming_message: ChatMessage | None = None
    """The reply being written (text, reasoning and calls so far), apart from :attr:`messages`."""
    queue: list[QueuedPrompt] = Field(default_factory=list)
    pending_approvals: list[ToolCall] = Field(default_factory=list)
    input_requests: list[InputRequest] = Field(default_factory=list)
    error: str | None = None
    waiting: bool = False
    """The turn waits before it runs (its :class:`TurnGate`: a server holds the memory its cache may need)."""


MAX_QUEUED = 32
"""Prompts a conversation's queue holds (each is in every state a UI is sent)."""


class TurnGate(Protocol):
    """What a turn waits for before it runs, made for each turn (a server's memory admission:
    :class:`mlxchat.server.admission.ThreadHold`). :meth:`enter` blocks the controller's thread until the turn
    may run over ``session`` with ``prompt`` added to its messages (calling ``waiting`` first when it has to
    wait); False when :meth:`cancel` (from any thread) came first. :meth:`exit` after the turn, when it ran."""

    def enter(self, session: ChatSession, prompt: Sequence[ChatMessage], waiting: Callable[[], None]) -> bool: ...

    def cancel(self) -> None: ...

    def exit(self) -> None: ...


Provider = Callable[[], SessionCapableModel]


class ChatController:
    """One conversation for a UI or an agent; see the module docstring."""

    def __init__(
        self,
        model_or_provider: SessionCapableModel | Provider,
        *,
        system: str | None = None,
        tools: Sequence[Any] | None = None,
        initial_messages: Sequence[ChatMessage | dict[str, Any]] = (),
        new_id: Callable[[], str] | None = None,
        clock: Callable[[], float] | None = None,
        publish_interval: float = 0.032,
        gate: Callable[[], TurnGate] | None = None,
        input_timeout: float | None = None,
    ):
        """``model_or_provider``: a model, or a function called at every turn that returns one. When it
        returns another model than the last turn's, the conversation moves to a new session on that model
        (primed with the messages, ids kept); its next turn prefills the whole conversation once. ``gate``
        makes what each turn waits for before it runs (a prompt stopped while it waits goes back to the head of
        the queue, paused). ``input_timeout``: seconds a tool's question waits for :meth:`respond_to_input`
        (``None``: as long as it takes); past it the tool sees an error, as when the turn is stopped, and the turn
        goes on (a server bounds it: the turn holds its memory while it waits)."""
        if input_timeout is not None and not input_timeout > 0:
            raise ValueError(f"input_timeout must be a positive number of seconds or None, got {input_timeout}")
        if publish_interval < 0:
            raise ValueError(f"publish_interval must be at least 0, got {publish_interval}")
        self._provider: Provider = (model_or_provider if not hasattr(model_or_provider, "chat_session")
                                    else lambda: model_or_provider)  # type: ignore[assignment,return-value]
        self._system = system
        self._tools = list(tools or [])
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self._clock = clock
        self._gate = gate
        self._input_timeout = input_timeout
        self._lock = threading.RLock()
        self._session = self._new_session(self._provider(), initial_messages)
        self._messages = self._session.messages
        self._status: Status = "idle"
        self._error: str | None = None
        self._queue: list[QueuedPrompt] = []
        self._paused = False
        self._turn_running = False
        self._stream: ChatStream | None = None
        self._stopped = False  # the running turn was stopped (before its stream was made, too)
        self._gating: TurnGate | None = None  # what the turn is let through before it runs
        self._waiting = False  # ... and whether it waits there
        self._streaming: dict[str, Any] | None = None
        self._asking: QueuedPrompt | None = None  # a sent prompt, shown until the session holds it
        self._asked: list[ChatMessage] = []  # ... as a message
        self._owed: Callable[[ChatSession], ChatStream] | None = None  # a reply to tools' results that did not
        # run (stopped or refused at the gate): it runs before the next prompt
        self._approvals: list[ToolCall] = []
        self._inputs: dict[str, tuple[InputRequest, threading.Event, list[str]]] = {}
        self._subscribers: list[Callable[[ChatState], object]] = []
        self._publisher = _Publisher(publish_interval, self._deliver, self._lock)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drive, name="mlxchat-controller", daemon=True)
        self._thread.start()

    # -- watching ---------------------------------------------------------------------------------------

    @property
    def state(self) -> ChatState:
        """The state now."""
        with self._lock:
            streaming = None
            if self._streaming is not None:
                calls = self._streaming["calls"]
                streaming = ChatMessage(role="assistant", content=self._streaming["text"],
                                        reasoning_content=self._streaming["thinking"] or None,
                                        tool_calls=list(calls) or None)
            inputs = [request for request, _, _ in self._inputs.values()]
            return ChatState(messages=list(self._messages) + self._asked, status=self._status,
                             streaming_message=streaming, queue=list(self._queue),
                             pending_approvals=list(self._approvals), input_requests=inputs, error=self._error,
                             waiting=self._waiting)

    @property
    def session(self) -> ChatSession:
        """The session the conversation lives in (it changes when the model does)."""
        return self._session

    def subscribe(self, callback: Callable[[ChatState], object]) -> Callable[[], None]:
        """Call ``callback`` with every published state (first with the current one); returns a function
        that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)
            current = self.state
        callback(current)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    async def states(self) -> AsyncIterator[ChatState]:
        """Every published state, for ``async for`` (the current one first)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[ChatState] = asyncio.Queue()
        unsubscribe = self.subscribe(lambda state: loop.call_soon_threadsafe(items.put_nowait, state))
        try:
            while True:
                yield await items.get()
        finally:
            unsubscribe()

    # -- conversation ------------------------------------------------------------------------------------

    def send(self, text: str, images: Sequence[ImageSource] = ()) -> bool:
        """Send a user message (with ``images`` for a model that reads them): now when no turn runs, else
        queued and sent when the turn finishes (the queue also resumes after a pause). Returns False only
        when there is nothing to send."""
        if not isinstance(text, str) or (not text.strip() and not images):
            return False
        prompt = QueuedPrompt(id=self._new_id(), text=text, images=[as_data_url(image) for image in images])
        with self._lock:
            queues = self._turn_running or self._status == "awaiting_approval" or self._owed is not None
            if queues and len(self._queue) >= MAX_QUEUED:
                raise SessionStateError(f"{MAX_QUEUED} prompts already wait in this conversation's queue; send "
                                        "this one when they have gone")
            self._paused = False
            if self._turn_running or self._status == "awaiting_approval":
                self._queue.append(prompt)
                self._publish_now()
            elif self._owed is not None:  # the reply owed to decided calls goes first
                self._queue.append(prompt)
                self._status, self._error = "idle", None
                self._next_from_queue()
            else:
                self._send(prompt)
        return True

    def remove_queued(self, prompt_id: str) -> bool:
        """Drop a queued prompt; False when no such prompt waits."""
        with self._lock:
            kept = [p for p in self._queue if p.id != prompt_id]
            if len(kept) == len(self._queue):
                return False
            self._queue = kept
            self._publish_now()
            return True

    def send_queued_now(self, prompt_id: str) -> bool:
        """Send a queued prompt now (when no turn runs; otherwise it goes first in the queue), resuming a
        queue that stop() or an error paused."""
        with self._lock:
            prompt = next((p for p in self._queue if p.id == prompt_id), None)
            if prompt is None:
                return False
            self._queue = [prompt] + [p for p in self._queue if p.id != prompt_id]
            self._paused = False
            self._next_from_queue()
            self._publish_now()
            return True

    def stop(self) -> None:
        """Cancel the turn in flight, keeping what streamed; the queue pauses until :meth:`send_queued_now`
        or the next :meth:`send`. A turn that has not begun (waiting at its gate) puts its prompt back first in
        the queue (a reply owed to decided tool calls runs before the next prompt). A tool waiting for input
        gets no answer (it sees an error)."""
        with self._lock:
            self._paused = True
            self._stopped = self._turn_running
            if self._gating is not None:
                self._gating.cancel()
            if self._stream is not None:
                self._stream.cancel()
            for _, answered, answer in list(self._inputs.values()):
                answer.append("")
                answered.set()

    def dismiss_error(self) -> None:
        """Clear the error; the queue stays paused until the next send."""
        with self._lock:
            if self._status == "error":
                self._status, self._error = "idle", None
                self._publish_now()

    def regenerate(self) -> None:
        """Ask again; the previous reply becomes another version of the answer."""
        with self._lock:
            self._check_idle()
            self._start(lambda session: session.regenerate_stream())

    def select_version(self, message_id: str, index: int) -> None:
        """Show another version of an assistant reply (later messages are dropped unless it is the last)."""
        self._edit(lambda session: session.select_version(message_id, index))

    def restore_checkpoint(self, message_id: str) -> None:
        """Keep the conversation up to and including ``message_id``."""
        self._edit(lambda session: session.restore_checkpoint(message_id))

    def load(self, messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
        """Replace the conversation (say, when the user switches threads)."""

        def replace(session: ChatSession) -> None:
            session.reset(keep_system=False)
            session.prime_history(messages)

        self._edit(replace)

    def respond_to_approval(self, call_id: str, approved: bool, reason: str | None = None,
                            arguments: dict[str, Any] | None = None) -> None:
        """Decide a call waiting for approval; once every waiting call is decided, the turn goes on by
        itself (the tools run, then the model answers)."""
        with self._lock:
            self._session.respond_to_approval(call_id, approved, reason, arguments)
            self._approvals = self._session.pending_approvals
            self._messages = self._session.messages
            if self._approvals:
                self._publish_now()
                return
            self._status = "idle"
            self._start(lambda session: session.respond_stream(), owed=True)

    def respond_to_input(self, request_id: str, text: str) -> None:
        """Answer a tool's input request; the tool resumes with ``text``."""
        with self._lock:
            if request_id not in self._inputs:
                raise SessionStateError(f"no input request {request_id!r} is waiting")
            _, answered, answer = self._inputs[request_id]
            answer.append(text)
            answered.set()

    def release_cache(self) -> bool:
        """Free the conversation's prompt cache while no turn runs (an app keeping many conversations bounds
        their memory this way); the next turn prefills the whole conversation once. False while a turn runs; a
        turn waiting at its gate (for memory) has not begun: its cache is freed."""
        with self._lock:
            if self._turn_running and not self._waiting:
                return False
            self._session.cache.clear()
            return True

    def close(self) -> None:
        """Stop the controller's threads (the model stays open)."""
        self.stop()
        self._jobs.put(None)
        self._publisher.close()

    # -- turns (on the controller's thread) ---------------------------------------------------------------

    def _new_session(self, model: SessionCapableModel, messages: Sequence[ChatMessage | dict[str, Any]]) -> ChatSession:
        session = ChatSession(model, system=self._system, tools=self._tools or None, auto_tools=True,
                              new_id=self._new_id, clock=self._clock, input_handler=self._ask)
        if messages:
            session.prime_history(messages)
        return session

    def _check_idle(self) -> None:
        if self._turn_running:
            raise SessionStateError("a turn is running; stop() it first")

    def _edit(self, change: Callable[[ChatSession], None]) -> None:
        with self._lock:
            self._check_idle()
            change(self._session)
            if not self._session.pending_tool_calls or self._session.pending_approvals:
                self._owed = None  # its calls are no longer the conversation's last, decided ones
            self._messages = self._session.messages
            self._approvals = self._session.pending_approvals
            self._status = "awaiting_approval" if self._approvals else "idle"
            self._publish_now()

    def _start(self, make: Callable[[ChatSession], ChatStream], asking: QueuedPrompt | None = None,
               owed: bool = False) -> None:
        """Run a turn on the controller's thread (the caller holds the lock). The prompt it answers
        (``asking``) is in the state's messages at once, as a UI shows it; ``owed``: it answers tools' results
        (kept to run first when it is stopped before it began). Any other turn replaces an owed one."""
        self._asking, self._stopped, self._owed = asking, False, None
        self._asked = [ChatMessage(role="user", content=asking.text)] if asking is not None else []
        self._turn_running = True
        self._status, self._error = "streaming", None
        self._streaming = {"text": "", "thinking": "", "calls": []}
        self._publish_now()
        self._jobs.put(lambda: self._turn(make, owed))

    def _send(self, prompt: QueuedPrompt) -> None:
        self._start(lambda session: session.send_stream(prompt.text, images=prompt.images), asking=prompt)

    def _next_from_queue(self) -> None:
        if self._turn_running or self._paused or self._status != "idle":
            return
        if self._owed is not None:
            make, self._owed = self._owed, None
            self._start(make, owed=True)
        elif self._queue:
            self._send(self._queue.pop(0))

    def _drive(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _turn(self, make: Callable[[ChatSession], ChatStream], owed: bool) -> None:
        stream: ChatStream | None = None
        events: Generator[Any, None, None] | None = None
        gate: TurnGate | None = None
        entered = making = False
        try:
            gate = self._gate() if self._gate is not None else None
            model = self._provider()
            with self._lock:
                if model is not self._session.model:
                    self._session = self._new_session(model, self._session.messages)
                self._gating = gate if not self._stopped else None
            if gate is not None:
                try:
                    entered = not self._stopped and gate.enter(self._session, self._asked, self._held_back)
                finally:
                    with self._lock:
                        self._gating, self._waiting = None, False
            with self._lock:
                if self._stopped or (gate is not None and not entered):  # stopped or refused before it began
                    return self._put_back(make, owed)
                making = True
                stream = self._stream = make(self._session)
            events = iter(stream)  # the turn begins: the prompt it answers is in the history, with its id
            with self._lock:
                self._messages, self._asking, self._asked = self._session.messages, None, []
                self._publish_now()
            for event in events:
                self._on_event(event)
        except Exception as exc:  # noqa: BLE001 - a UI gets the error as state, never a dead thread
            with self._lock:
                self._status, self._paused = "error", True
                self._error = str(exc) if isinstance(exc, MlxchatError) else f"{type(exc).__name__}: {exc}"
                if not making:  # it failed before it began (a gate, the provider)
                    self._put_back(make, owed)
        finally:
            try:
                if events is not None:
                    events.close()  # a turn left by an error above ends (its reply stops) before it counts as ended
            finally:
                if entered:
                    assert gate is not None
                    gate.exit()
            with self._lock:
                result = stream.result if stream is not None else None
                self._stream, self._streaming, self._turn_running = None, None, False
                self._asking, self._asked = None, []
                self._messages = self._session.messages
                self._approvals = self._session.pending_approvals
                if self._status != "error":
                    self._status = "awaiting_approval" if self._approvals else "idle"
                    if result is not None and result.finish_reason == "cancelled":
                        self._paused = True
                self._next_from_queue()
                self._publish_now()

    def _put_back(self, make: Callable[[ChatSession], ChatStream], owed: bool) -> None:
        """A turn stopped or refused before it began waits again, first, the queue paused (the caller holds
        the lock)."""
        if self._asking is not None:
            self._queue.insert(0, self._asking)
        elif owed:
            self._owed = make
        self._asking, self._asked, self._paused = None, [], True

    def _held_back(self) -> None:
        """The turn's gate makes it wait (called from the gate, on the controller's thread)."""
        with self._lock:
            self._waiting = True
            self._publish_now()

    def _on_event(self, event: Any) -> None:
        with self._lock:
            streaming = self._streaming
            assert streaming is not None
            if isinstance(event, TextDelta):
                streaming["text"] += event.text
                self._publisher.changed()
            elif isinstance(event, ThinkingDelta):
                streaming["thinking"] += event.text
                self._publisher.changed()
            elif isinstance(event, ToolCallEvent):
                if event.call.status == "ok":
                    streaming["calls"].append(event.call)
                self._publish_now()
            elif isinstance(event, ToolResultEvent):  # the reply before it is in the session now
                self._messages = self._session.messages
                self._streaming = {"text": "", "thinking": "", "calls": []}
                self._publish_now()
            elif isinstance(event, Done):
                self._messages = self._session.messages

    def _ask(self, prompt: str, call: ToolCall) -> str:
        """A tool's question: surfaced as state, answered by :meth:`respond_to_input` (blocks the tool)."""
        request = InputRequest(id=self._new_id(), prompt=prompt, call_id=call.id, name=call.name)
        answered, answer = threading.Event(), list[str]()
        with self._lock:
            self._inputs[request.id] = (request, answered, answer)
            self._status = "awaiting_input"
            self._publish_now()
        answered.wait(self._input_timeout)
        with self._lock:
            del self._inputs[request.id]
            self._status = "streaming" if not self._inputs else "awaiting_input"
            self._publish_now()
        if not answered.is_set():
            raise SessionStateError(f"no answer to {prompt!r} came within {self._input_timeout:g} s")
        if not answer or (self._stream is not None and self._stream._cancel):
            raise SessionStateError("the input request was cancelled")
        return answer[0]

    # -- publishing ---------------------------------------------------------------------------------------

    def _publish_now(self) -> None:
        self._publisher.now()

    def _deliver(self) -> None:
        """Publish the current state to every subscriber (called by the publisher, holding the lock, so
        callbacks should return quickly)."""
        state = self.state
        for callback in list(self._subscribers):
            callback(state)


class _Publisher:
    """Calls ``deliver`` now for structural changes, and at most every ``interval`` seconds for streamed
    deltas (a background thread flushes the last delta when no further change comes). Deliveries hold
    ``order`` (the controller's lock, so states go out in order and lock order is never inverted)."""

    def __init__(self, interval: float, deliver: Callable[[], None], order: threading.RLock):
        self.interval = interval
        self._deliver = deliver
        self._cond = threading.Condition()
        self._order = order
        self._dirty = False
        self._closed = False
        self._last = 0.0
        if interval > 0:
            threading.Thread(target=self._loop, name="mlxchat-publisher", daemon=True).start()

    def changed(self) -> None:
        if self.interval == 0:
            self.now()
            return
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def now(self) -> None:
        with self._order:
            with self._cond:
                self._dirty = False
                self._last = time.monotonic()
            self._deliver()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._dirty:
                    self._cond.wait()
                    continue
                delay = self._last + self.interval - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                self._cond.release()
                try:
                    self.now()
                finally:
                    self._cond.acquire()
