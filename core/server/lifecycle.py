"""One generating request's life, the same on every endpoint (as vLLM's serving base owns it): the endpoint
translates the request into a :class:`~mlxchat.server.turns.Turn` (an :class:`Exchange`), and here it is
admitted, answered (JSON, or a stream), watched for its client leaving, its failures turned into the
endpoint's error shape -- and, in one ``finally``, its queue slot and pooled cache given back, its metrics
counted and its fields added to its access-log line (:data:`~mlxchat.server.guard.ACCESS`). Nothing an
endpoint raises can keep a slot or a cache. (That end comes before the answer's last bytes are sent, so a
client's next request never finds the slot taken; the ``finally`` ends what an interrupted request left.)
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from ..errors import MlxchatError
from ..session import StreamEvent
from .errors import ApiError, log, request_error
from .guard import ACCESS
from .images import fetch_images
from .store import StoreError, StoreUnavailableError
from .turns import Messages, Turn, watching

if TYPE_CHECKING:
    from .state import ServerState

CLIENT_GONE = 499  # nginx's status for a client that left before its answer was sent


class Exchange:
    """An endpoint's translation of one request: the turn to run (not started yet) and how its events
    become the endpoint's wire format. The lifecycle calls :meth:`complete` (no stream) or :meth:`lines`,
    then at most one of :meth:`failed` and :meth:`left`, then gives :meth:`remembered` to the pool."""

    def __init__(self, turn: Turn, stream: bool, remote_images: list[dict[str, Any]] | None = None):
        self.turn, self.stream = turn, stream
        self.remote_images = remote_images or []
        """The ``image_url`` parts of the turn's messages to fetch once the request is admitted."""

    async def complete(self) -> dict[str, Any]:
        """Run the turn to its end: the JSON body of the answer."""
        raise NotImplementedError

    def lines(self, first: StreamEvent | None) -> AsyncGenerator[str, None]:
        """The stream's lines, from the turn's first event on."""
        raise NotImplementedError

    def error_lines(self, error: ApiError) -> list[str]:
        """What a stream that fails after it started sends last."""
        raise NotImplementedError

    async def failed(self, error: ApiError) -> None:
        """The request failed with ``error`` (before or after its answer started)."""

    async def left(self) -> None:
        """The client left before its stream ended."""

    def remembered(self) -> Messages | None:
        """The conversation the turn's cache holds now (``None``: the request's own)."""
        return None


Prepare = Callable[["ServerState", Any], Awaitable[Exchange]]


def api_error(exc: BaseException) -> ApiError:
    """What the client is told of a failure: ours (``ApiError``), the model's (:func:`request_error`), a
    store that cannot be written (503), anything else 500 with the details in the server log."""
    from starlette.requests import ClientDisconnect

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientDisconnect):
        return ApiError(499, "the client left before its request was read")
    if isinstance(exc, StoreUnavailableError):
        log.warning("%s", exc)
        return ApiError(503, str(exc), "server_busy", code="store_unavailable")
    if isinstance(exc, StoreError):  # a row damaged in the store
        log.error("%s", exc)
        return ApiError(500, str(exc), "server_error")
    if isinstance(exc, sqlite3.Error):
        log.error("the response store failed", exc_info=exc)
        return ApiError(503, "the response store failed; see the server log", "server_busy",
                        code="store_unavailable")
    if isinstance(exc, MlxchatError):
        return request_error(exc)
    log.error("unexpected error", exc_info=exc)
    return ApiError(500, "internal server error; see the server log", "server_error")


class Lifecycle:
    """The ASGI answer to one generating request (a route returns it; Starlette calls it)."""

    def __init__(self, state: ServerState, request: Any, endpoint: str, prepare: Prepare):
        self.state, self.request, self.endpoint, self.prepare = state, request, endpoint, prepare
        self.status = 500
        self.error: ApiError | None = None
        self._completed = self._ended = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from starlette.responses import JSONResponse, StreamingResponse

        exchange: Exchange | None = None
        sent = False
        try:
            exchange = await self.prepare(self.state, self.request)
            turn = exchange.turn
            turn.admit()
            await fetch_images(exchange.remote_images, self.state.settings.max_body_bytes)
            await turn.start()
            if exchange.stream:
                async with watching(self.request, turn.cancel):
                    first = await turn.next()
                self.status, sent = 200, True
                await StreamingResponse(self._body(exchange, first), media_type="text/event-stream")(
                    scope, receive, send)
                if not self._completed:
                    self.status = CLIENT_GONE
                    await _quietly(exchange.left())
            else:
                async with watching(self.request, turn.cancel):
                    body = await exchange.complete()
                self.status, sent = 200, True
                await self._end(exchange)
                await JSONResponse(body)(scope, receive, send)
        except Exception as exc:
            self.error = api_error(exc)
            if exchange is not None:
                await _quietly(exchange.failed(self.error))
            if sent:
                raise
            self.status = self.error.status
            if self.error.status >= 500 or self.error.status == 429:
                self.state.refusals.refused(self.error.code or self.error.kind, self.error.message)
            await self._end(exchange)
            await JSONResponse(self.error.body(scope["path"]), status_code=self.error.status)(scope, receive, send)
        except BaseException:  # cancelled: the connection or the server went
            self.status = CLIENT_GONE
            if exchange is not None:
                await _quietly(exchange.left())
            raise
        finally:
            await self._end(exchange)

    async def _end(self, exchange: Exchange | None) -> None:
        """Give the turn's slot and cache back, count the request and note it for the access log (once:
        later calls do nothing). Called before the answer's last bytes, so that a client that sends its next request as
        soon as it has read this one finds the slot free and the counts done."""
        if self._ended:
            return
        self._ended = True
        try:
            if exchange is not None:
                await exchange.turn.finish(exchange.remembered())
        finally:
            self._note(exchange)

    async def _body(self, exchange: Exchange, first: StreamEvent | None) -> AsyncIterator[str]:
        """The stream, ended by the endpoint's error lines when it fails after it started. The lines that
        follow the turn's end are held back until :meth:`_end` has run."""
        held: list[str] = []
        try:
            async with aclosing(exchange.lines(first)) as lines:
                async for line in lines:
                    held.append(line)
                    if not exchange.turn.over:
                        for ready in held:
                            yield ready
                        held = []
        except Exception as exc:  # noqa: BLE001 - told to the client in the stream's own shape
            self.error = api_error(exc)
            await _quietly(exchange.failed(self.error))
            held += exchange.error_lines(self.error)
        self._completed = True
        await self._end(exchange)
        for line in held:
            yield line

    def _note(self, exchange: Exchange | None) -> None:
        """Count the request and add what it did to its access-log line."""
        turn = exchange.turn if exchange is not None else None
        reports = turn.reports if turn is not None else []
        record = self.request.scope.setdefault(ACCESS, {})
        record.update({
            "endpoint": self.endpoint, "status": self.status,
            "stream": exchange.stream if exchange is not None else None,
            "prompt_tokens": reports[0].prompt_tokens if reports else 0,
            "cached_tokens": reports[0].cached_prompt_tokens if reports else 0,
            "generated_tokens": sum(r.generated_tokens for r in reports),
            "finish_reason": reports[-1].finish_reason if reports else None,
            "error": (self.error.code or self.error.kind) if self.error is not None else None,
        })
        if turn is not None and turn.first_token_seconds is not None:
            record["first_token_seconds"] = round(turn.first_token_seconds, 4)
        self.state.metrics.count(self.endpoint, self.status, turn)


async def _quietly(work: Awaitable[None]) -> None:
    """Run an endpoint's bookkeeping of a request that ends anyway (a failure here is only logged)."""
    try:
        await work
    except Exception as exc:  # noqa: BLE001 - the request's answer is already decided
        log.warning("could not record how a request ended (%s)", exc)


def turn_route(state: ServerState, endpoint: str, prepare: Prepare) -> Callable[[Any], Awaitable[Lifecycle]]:
    """The Starlette endpoint of a generating route: each request's life is a :class:`Lifecycle`."""

    async def handle(request: Any) -> Lifecycle:
        return Lifecycle(state, request, endpoint, prepare)

    return handle
