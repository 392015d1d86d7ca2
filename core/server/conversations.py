"""The chat page's conversation API: one :class:`~mlxchat.controller.ChatController` per conversation, its
state streamed as server-sent events, its actions as JSON POSTs, its messages kept in the server's store.

Routes (under the same guard as every other route: API key, Host check, JSON bodies within the size limit)::

    GET    /                                   the page (static files under /page/, strict CSP)
    GET    /api/conversations                  the stored conversations, latest first
    POST   /api/conversations                  a new conversation -> its state
    GET    /api/conversations/{id}             its state now
    DELETE /api/conversations/{id}
    GET    /api/conversations/{id}/events      text/event-stream: "state" events (everything) and
                                               "progress" events (all but the messages, while they stay)
    POST   /api/conversations/{id}/{action}    send, stop, remove_queued, send_queued_now, regenerate,
                                               select_version, restore_checkpoint, approval, input,
                                               dismiss_error -> the state after it

The page is a client of this API and has no other privilege. Tools given to ``serve --tools`` run here,
on the server, for these conversations only (API clients run their own tools). A conversation is written
to the store whenever its messages change, so a reload or a restarted server finds it; at most
``settings.caches`` conversations stay live with their prompt caches (the least recently used idle one is
closed, and primed again from the store when it is next opened: one prefill of its history); beyond
``settings.max_queue`` busy or watched ones, opening another is refused (429). Each turn holds what its cache
may grow to against ``--max-kv-gb`` while it runs, in the same queue as the API's requests
(:class:`~mlxchat.server.admission.ThreadHold`): while the memory is held by others it waits (its state says
``waiting``), and a stopped turn that had not begun puts its prompt back first in the queue. Between turns (and
while a turn waits there) a conversation's cache is idle, bounded by ``--max-cache-gb`` together with the API's
pool (the least recently used first: :meth:`~mlxchat.server.pool.CachePool.trim`); one freed there is prefilled
again by the next turn.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from ..controller import ChatController, ChatState
from ..errors import ImageError, MlxchatError
from ..images import image_url_source
from ..messages import ChatMessage
from ..multimodal import images_kept
from .admission import ThreadHold, on_loop
from .errors import ApiError, log, validated
from .guard import read_json
from .pool import IdleCache

if TYPE_CHECKING:
    from .state import ServerState

STATIC = Path(__file__).resolve().parent / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache"}
CONVERSATION_ID = re.compile(r"[0-9a-f]{32}")
MAX_IMAGES = 8
MAX_LISTED = 200
PING_S = 15.0


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Send(_Action):
    text: str = ""
    images: list[str] = Field(default_factory=list, max_length=MAX_IMAGES)
    """``data:`` URLs (never a path or a remote URL)."""


class Nothing(_Action):
    pass


class Queued(_Action):
    id: str = Field(max_length=128)


class SelectVersion(_Action):
    message_id: str = Field(max_length=128)
    index: int = Field(ge=0)


class Checkpoint(_Action):
    message_id: str = Field(max_length=128)


class Approval(_Action):
    call_id: str = Field(max_length=128)
    approved: bool
    reason: str | None = None
    arguments: dict[str, Any] | None = None


class Answer(_Action):
    request_id: str = Field(max_length=128)
    text: str


def _send(c: ChatController, a: Send, images: list[bytes]) -> None:
    if not c.send(a.text, images):
        raise ApiError(400, "nothing to send: the message is empty", param="text")


def _found(done: bool, what: str) -> None:
    if not done:
        raise ApiError(404, f"no such {what} waits in the queue", "not_found_error")


ACTIONS: dict[str, tuple[type[_Action], Callable[[ChatController, Any], object]]] = {
    "stop": (Nothing, lambda c, a: c.stop()),
    "remove_queued": (Queued, lambda c, a: _found(c.remove_queued(a.id), "prompt")),
    "send_queued_now": (Queued, lambda c, a: _found(c.send_queued_now(a.id), "prompt")),
    "regenerate": (Nothing, lambda c, a: c.regenerate()),
    "select_version": (SelectVersion, lambda c, a: c.select_version(a.message_id, a.index)),
    "restore_checkpoint": (Checkpoint, lambda c, a: c.restore_checkpoint(a.message_id)),
    "approval": (Approval, lambda c, a: c.respond_to_approval(a.call_id, a.approved, a.reason, a.arguments)),
    "input": (Answer, lambda c, a: c.respond_to_input(a.request_id, a.text)),
    "dismiss_error": (Nothing, lambda c, a: c.dismiss_error()),
}
"""What each action's body is and which controller method it calls (``send`` is apart: it reads images)."""


def _title(messages: Sequence[ChatMessage]) -> str:
    for message in messages:
        if message.role == "user":
            text = message.content if isinstance(message.content, str) else " ".join(
                p.get("text", "") for p in message.content or [] if p.get("type") == "text")
            return " ".join(text.split())[:80] or "(image)"
    return "New conversation"


class Conversation:
    """One live conversation: its controller, and what it last wrote to the store and sent to pages."""

    def __init__(self, conversation_id: str, controller: ChatController, owner: Conversations):
        self.id, self.controller, self.owner = conversation_id, controller, owner
        self.watchers = 0
        self.busy = False
        """Whether a turn runs (its cache is in use; a turn waiting at its gate for memory has not begun)."""
        self.used = time.monotonic()
        """When its cache was last used (it opened, or a turn ended)."""
        self._saved: list[ChatMessage] | None = None
        self._dumped: tuple[list[ChatMessage], list[dict[str, Any]]] | None = None
        controller.subscribe(self._changed)

    def _changed(self, state: ChatState) -> None:
        """On the thread that publishes the state (under the controller's lock, in order): write the messages when
        they changed (they are new objects then); a turn that ended, or waits at its gate for memory, leaves its
        cache idle, under ``--max-cache-gb`` with the pool's."""
        ended, self.busy = self.busy, state.status in ("streaming", "awaiting_input") and not state.waiting
        if ended and not self.busy:
            self.used = time.monotonic()
            self.owner.on_loop(self.owner.trim(), f"conversation {self.id}: its idle cache was not bounded")
        if self._saved is None or _same(self._saved, state.messages):
            self._saved = state.messages
            return
        self._saved = state.messages
        self.owner.save(self.id, state.messages)

    def messages(self, state: ChatState) -> list[dict[str, Any]]:
        """The messages as JSON, dumped again only when they changed."""
        if self._dumped is None or not _same(self._dumped[0], state.messages):
            self._dumped = (state.messages, [m.model_dump(mode="json") for m in state.messages])
        return self._dumped[1]

    def snapshot(self, state: ChatState, messages: bool = True) -> dict[str, Any]:
        """The state as the page reads it (``messages`` left out of a progress event)."""
        body = state.model_dump(mode="json", exclude={"messages"})
        body["id"] = self.id
        body.update(self.owner.info)
        if messages:
            body["messages"] = self.messages(state)
        return body


def _same(a: list[ChatMessage], b: list[ChatMessage]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class Conversations:
    """The live conversations of a server, over its model, store and page tools."""

    def __init__(self, state: ServerState, tools: Sequence[Any]):
        self.state = state
        self.tools = list(tools)
        self.live: OrderedDict[str, Conversation] = OrderedDict()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        model = state.model
        tool_info = [{"name": t.name, "needs_approval": bool(getattr(t, "needs_approval", False))}
                     for t in self.tools]
        self.info = {"model": state.name, "supports_images": bool(model.supports_images), "tools": tool_info}
        state.pool.outside = self.idle

    def save(self, conversation_id: str, messages: list[ChatMessage]) -> None:
        """Write a conversation (from any thread; the store's own thread does the writing, in order)."""
        dumped = [m.model_dump(mode="json") for m in messages]
        write = self.state.store.save_conversation(conversation_id, _title(messages), dumped, time.time())
        self.on_loop(write, f"conversation {conversation_id}: its last change was not saved")

    def on_loop(self, work: Coroutine[Any, Any, object], lost: str) -> None:
        """Run ``work`` on the server's loop (from any thread); logs ``lost`` when the server has stopped (a turn
        cancelled at shutdown ended after it)."""
        assert self.loop is not None
        if on_loop(self.loop, work) is None:
            log.warning("%s (the server had stopped)", lost)

    async def trim(self) -> None:
        """Bound the idle caches, the pool's and the conversations' (:meth:`~mlxchat.server.pool.CachePool.trim`),
        unless the server is closing (turns stopped at shutdown end after the pool has closed)."""
        if not self.closed:
            self.state.pool.trim()

    def idle(self) -> list[IdleCache]:
        """The live conversations' caches between turns."""
        return [IdleCache(c.used, c.controller.session.cache, c.controller.release_cache)
                for c in list(self.live.values()) if not c.busy and len(c.controller.session.cache)]

    def _open(self, conversation_id: str, messages: list[dict[str, Any]]) -> Conversation:
        self._evict(self.state.settings.caches - 1)
        if len(self.live) >= self.state.settings.max_queue:
            raise ApiError(429, f"{len(self.live)} conversations are busy or watched (the limit); retry later",
                           "rate_limit_error", code="too_many_conversations")
        loop, kv, model = self.loop, self.state.kv, self.state.model
        assert loop is not None
        controller = ChatController(model, tools=self.tools,
                                    gate=lambda: ThreadHold(kv, loop, model.defaults, self.state.turns),
                                    input_timeout=self.state.settings.input_timeout)
        try:
            if not images_kept(messages):  # stored as data: URLs: a row naming a file must not make us read it
                raise ImageError("an image of it is not kept in the store (not a data: URL)")
            if messages:
                controller.load(messages)
        except (MlxchatError, ValueError) as exc:
            controller.close()
            raise ApiError(500, f"the stored conversation cannot be loaded ({exc})", "server_error") from None
        conversation = self.live[conversation_id] = Conversation(conversation_id, controller, self)
        return conversation

    def _evict(self, keep: int) -> None:
        """Close the least recently used conversations that nobody watches and no turn holds, down to
        ``keep`` live ones (their prompt caches go with them; the store keeps their messages)."""
        for key in list(self.live):
            if len(self.live) <= keep:
                return
            conversation = self.live[key]
            if conversation.watchers == 0 and conversation.controller.state.status in ("idle", "error"):
                del self.live[key]
                conversation.controller.close()

    async def create(self) -> Conversation:
        self.loop = asyncio.get_running_loop()
        conversation_id = uuid.uuid4().hex
        await self.state.store.save_conversation(conversation_id, "New conversation", [], time.time())
        return self._open(conversation_id, [])

    async def get(self, conversation_id: str) -> Conversation:
        self.loop = asyncio.get_running_loop()
        if conversation_id in self.live:
            self.live.move_to_end(conversation_id)
            return self.live[conversation_id]
        stored = (await self.state.store.conversation(conversation_id)
                  if CONVERSATION_ID.fullmatch(conversation_id) else None)
        if stored is None:
            raise ApiError(404, f"no conversation {conversation_id[:128]!r}", "not_found_error")
        if conversation_id in self.live:  # opened by another request meanwhile
            return self.live[conversation_id]
        return self._open(conversation_id, stored)

    async def delete(self, conversation_id: str) -> bool:
        conversation = self.live.pop(conversation_id, None)
        if conversation is not None:
            conversation.controller.close()
        return await self.state.store.delete_conversation(conversation_id)

    def close(self) -> None:
        self.closed = True
        for conversation in self.live.values():
            conversation.controller.close()
        self.live.clear()


def routes(state: ServerState, tools: Sequence[Any]) -> tuple[list[Any], Conversations]:
    """The page's routes and the conversations they serve (close them when the server stops)."""
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
    from starlette.types import Scope

    conversations = Conversations(state, tools)

    class PageFiles(StaticFiles):
        async def get_response(self, path: str, scope: Scope) -> Response:
            response = await super().get_response(path, scope)
            response.headers.update(PAGE_HEADERS)
            return response

    async def page(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    async def listing(_: Request) -> Response:
        stored = await state.store.conversations(MAX_LISTED)
        return JSONResponse({"object": "list", "data": stored, **conversations.info})

    async def create(_: Request) -> Response:
        conversation = await conversations.create()
        return JSONResponse(conversation.snapshot(conversation.controller.state), status_code=201)

    async def show(request: Request) -> Response:
        conversation = await conversations.get(request.path_params["id"])
        return JSONResponse(conversation.snapshot(conversation.controller.state))

    async def delete(request: Request) -> Response:
        if not await conversations.delete(request.path_params["id"]):
            raise ApiError(404, f"no conversation {request.path_params['id'][:128]!r}", "not_found_error")
        return JSONResponse({"id": request.path_params["id"], "deleted": True})

    async def act(request: Request) -> Response:
        name = request.path_params["action"]
        if name != "send" and name not in ACTIONS:
            raise ApiError(404, f"no action {name[:64]!r}; the actions are send, {', '.join(ACTIONS)}",
                           "not_found_error")
        body = await read_json(request, state.settings)
        conversation = await conversations.get(request.path_params["id"])
        controller = conversation.controller
        try:
            if name == "send":
                action = validated(Send, body)
                if action.images and not state.model.supports_images:
                    raise ApiError(400, f"{state.name} reads no images", param="images")
                _send(controller, action, [_image(url) for url in action.images])
            else:
                kind, run = ACTIONS[name]
                run(controller, validated(kind, body))
        except (MlxchatError, ValueError, IndexError) as exc:
            raise ApiError(400, str(exc)) from None
        return JSONResponse(conversation.snapshot(controller.state))

    async def events(request: Request) -> Response:
        conversation = await conversations.get(request.path_params["id"])
        return StreamingResponse(_events(conversation), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return [Route("/", page, methods=["GET"]),
            Mount("/page", PageFiles(directory=STATIC)),
            Route("/api/conversations", listing, methods=["GET"]),
            Route("/api/conversations", create, methods=["POST"]),
            Route("/api/conversations/{id}", show, methods=["GET"]),
            Route("/api/conversations/{id}", delete, methods=["DELETE"]),
            Route("/api/conversations/{id}/events", events, methods=["GET"]),
            Route("/api/conversations/{id}/{action}", act, methods=["POST"])], conversations


def _image(url: str) -> bytes:
    try:
        source = image_url_source(url)
    except ImageError as exc:
        raise ApiError(400, str(exc), param="images") from None
    assert isinstance(source, bytes)
    return source


async def _events(conversation: Conversation) -> AsyncIterator[str]:
    """The conversation's states as server-sent events: only the latest of those published meanwhile, the
    messages only when they changed, and a comment now and then so that proxies keep the stream open."""
    loop = asyncio.get_running_loop()
    states: asyncio.Queue[ChatState] = asyncio.Queue()
    unsubscribe = conversation.controller.subscribe(lambda s: loop.call_soon_threadsafe(states.put_nowait, s))
    conversation.watchers += 1
    sent: list[ChatMessage] | None = None
    try:
        while True:
            try:
                state = await asyncio.wait_for(states.get(), PING_S)
            except TimeoutError:
                yield ": ping\n\n"
                continue
            while not states.empty():
                state = states.get_nowait()
            full = sent is None or not _same(sent, state.messages)
            sent = state.messages
            data = json.dumps(conversation.snapshot(state, messages=full), ensure_ascii=False)
            yield f"event: {'state' if full else 'progress'}\ndata: {data}\n\n"
    finally:
        conversation.watchers -= 1
        unsubscribe()
