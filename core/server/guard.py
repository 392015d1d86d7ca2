"""What stands between the network and the model: settings and their limits, authentication, the Host
check that stops DNS rebinding, JSON-only bodies (no simple cross-site POST), body size, nesting and text
checks, a cap on requests in flight, and a header-read timeout for idle connections.

Every refusal is an OpenAI-style JSON error, counted in the metrics by status and reason, and logged as a
warning one line per burst. Every request, refused or not, on every route, gets one JSON line in the
access log (logger ``mlxchat.server.access``), written here when its answer has been sent; a route adds
its own fields to it (:data:`ACCESS`: the generating routes' lifecycle adds the endpoint, tokens and time
to first token).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidInputError
from ..limits import check_depth, check_strings
from .errors import ApiError, RefusalLog
from .metrics import Metrics

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ACCESS = "mlxchat.access"
"""The ASGI scope key of a request's access-log record (a dict a route may add fields to; its ``status``,
when a route sets one, is what the line says: 499 for a client that left mid-stream)."""
access_log = logging.getLogger("mlxchat.server.access")


class ServerSettings(BaseModel):
    """The server's limits and switches (``mlxchat serve --help`` shows each with its default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_name: str | None = None
    """The model id clients use (default: the checkpoint's Hub repo id or folder name); a request that names
    another model gets 404 ``model_not_found``."""
    store: str = ":memory:"
    """The SQLite file that keeps stored responses (``:memory:``: kept only while the server runs). One
    server per file: a second one on it stops at start with an error naming the first."""
    store_max_age_days: float = Field(30.0, ge=0)
    """Days a stored response is kept (0: for ever); an older one is answered as missing (404), as a
    deleted one is, and so is every response that continues it."""
    store_max_rows: int = Field(10_000, ge=0)
    """Most stored responses kept (0: no bound); the oldest go first."""
    max_spill_gb: float = Field(8.0, ge=0)
    """Disk that prompt caches evicted from memory may take, in a folder next to a file store (0: none)."""
    api_key: str | None = None
    """Clients must send it as ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``); every route but
    ``GET /health`` and the chat page's static files checks it (``GET /metrics`` too, unless
    ``metrics_open``)."""
    caches: int = Field(4, ge=1)
    """Idle prompt caches kept between requests (least recently used evicted first)."""
    max_cache_gb: float = Field(4.0, gt=0)
    """Most memory the idle prompt caches may hold together."""
    max_body_mb: float = Field(16.0, gt=0)
    """Largest request body accepted (413 beyond)."""
    max_kv_gb: float | None = Field(None, gt=0)
    """Most memory the caches of the admitted requests hold together, each reserved as its reply grows up to its
    prompt and ``max_tokens`` (:mod:`mlxchat.server.admission`); a request waits while the ones before it hold
    too much, a reply that cannot grow waits, and one that could never fit gets 503 (``None``: half the
    machine's memory)."""
    metrics_open: bool = False
    """Serve ``GET /metrics`` without the API key to clients on a loopback address (a local scraper)."""
    max_queue: int = Field(64, ge=1)
    """Most generation requests running or waiting for the model at once (429 beyond)."""
    max_connections: int = Field(128, ge=1)
    """Most requests in flight on all routes at once (503 beyond)."""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds a connection may take to send a request's headers (idle connections are closed)."""
    body_timeout: float = Field(30.0, gt=0)
    """Seconds a request may take to send its body (408 beyond): a client that stops mid-body does not keep its
    place among ``max_connections``."""
    input_timeout: float = Field(600.0, gt=0)
    """Seconds a chat page tool's question waits for the user's answer; past it the tool sees an error and the
    turn goes on (a turn holds its reserved memory while its tool waits)."""
    allow_remote_images: bool = False
    """Fetch ``http(s)`` image URLs (off: only ``data:`` URLs; a local file is never read)."""
    cors_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API (none by default: no CORS headers at all)."""
    allowed_hosts: list[str] | None = None
    """Host header names accepted (``None``: any). Bound to a loopback address, the server accepts only
    loopback names, so that a web page cannot reach it through DNS rebinding."""

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_cache_bytes(self) -> int:
        return int(self.max_cache_gb * 1e9)

    @property
    def spill_dir(self) -> Path | None:
        """Where evicted prompt caches go: ``<store>.spill`` beside a file store."""
        if self.store == ":memory:" or not self.max_spill_gb:
            return None
        store = Path(self.store).expanduser()
        return store.with_name(store.name + ".spill")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                    Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


class Guard:
    """ASGI middleware checking every HTTP request before it reaches a route."""

    OPEN_PATHS = frozenset({"/health", "/"})
    OPEN_PREFIX = "/page/"
    """The chat page's static files: no secret in them, and a browser cannot send a key when it loads them
    (the page sends the key on every API call it makes)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, refusals: RefusalLog, metrics: Metrics):
        self.app, self.settings, self.refusals, self.metrics = app, settings, refusals, metrics
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        client = scope.get("client")
        record: dict[str, Any] = {"method": scope["method"], "path": scope["path"][:512],  # (a line stays short)
                                  "client": f"{client[0]}:{client[1]}" if client else None}
        scope[ACCESS] = record
        sent: list[int] = []

        async def noting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            try:
                self._check(scope)
            except ApiError as exc:
                reason = exc.code or exc.kind
                self.refusals.refused(reason, exc.message)
                self.metrics.refused.labels(str(exc.status), reason).inc()
                record["error"] = reason
                await _send_json(noting, exc.status, exc.body(scope["path"]))
                return
            self.in_flight += 1
            try:
                await self.app(scope, receive, noting)
            finally:
                self.in_flight -= 1
        finally:
            record.setdefault("status", sent[0] if sent else 500)
            record["seconds"] = round(time.monotonic() - started, 4)
            access_log.info(json.dumps(record))

    def _check(self, scope: dict[str, Any]) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allowed = self.settings.allowed_hosts
        if allowed is not None and host_name(headers.get("host", "")) not in allowed:
            raise ApiError(400, "this server answers only to the host names it is bound to "
                                f"({', '.join(allowed)})", code="invalid_host")
        open_path = scope["path"] in self.OPEN_PATHS or scope["path"].startswith(self.OPEN_PREFIX) or (
            scope["path"] == "/metrics" and self.settings.metrics_open
            and is_loopback((scope.get("client") or ("",))[0]))
        if self.settings.api_key is not None and not open_path and scope["method"] != "OPTIONS":
            sent = headers.get("authorization", "")
            key = sent[len("bearer "):] if sent.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(key.encode(), self.settings.api_key.encode()):
                raise ApiError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: "
                                    "KEY')",
                               "authentication_error", code="invalid_api_key")
        if self.in_flight >= self.settings.max_connections and scope["path"] != "/health":  # (health: always)
            raise ApiError(503, f"the server is handling {self.settings.max_connections} requests, its limit; "
                                "retry later", "server_busy", code="too_many_connections")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                raise ApiError(415, "request bodies must be JSON (Content-Type: application/json)",
                               code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not ascii_digits(length) or int(length) > self.settings.max_body_bytes):
                raise ApiError(413, f"the request body is larger than {self.settings.max_body_mb:g} MB",
                               code="body_too_large")


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is a non-negative integer of at most 18 ASCII digits (``str.isdigit`` also takes ``"²"`` and
    ``"٣"``, which ``int`` refuses or reads as another number; ``int`` refuses more than 4,300 digits)."""
    return len(text) <= 18 and text.isascii() and text.isdigit()


async def read_json(request: Any, settings: ServerSettings) -> dict[str, Any]:
    """The request's JSON object, read within the size and time limits and checked (nesting, valid Unicode)."""
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise ApiError(413, f"the request body is larger than {settings.max_body_mb:g} MB",
                               code="body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), settings.body_timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {settings.body_timeout:g} s",
                       code="body_timeout") from None
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") \
            from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise ApiError(400, "the request body holds a number too long to read") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_depth(body, what="the request body")
        check_strings(body, "the request body")
    except InvalidInputError as exc:
        raise ApiError(400, str(exc)) from None
    return body


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def guarded_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol, closing connections that take longer than ``header_timeout`` seconds to send
    a request's headers (uvicorn itself waits forever for the first request)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete and self._header_timer is not None:
                self._header_timer.cancel()  # a request's headers arrived
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return GuardedH11Protocol
