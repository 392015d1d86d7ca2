"""The ASGI application and ``serve``: routes, the guard in front of them, and JSON for every error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import MlxchatError
from ..model import GenerativeModel
from ..session import Done, StreamEvent
from .chat_completions import Completion, parse_request, request_error
from .errors import ApiError, RateLimitedFilter, RefusalLog, log
from .guard import Guard, ServerSettings, guarded_protocol, is_loopback, read_json
from .images import inline_images
from .pool import CachePool


class ServerState:
    """What the routes share: the model, its settings, the cache pool and the generation queue's length."""

    def __init__(self, model: GenerativeModel, settings: ServerSettings):
        self.model = model
        self.settings = settings
        self.name = settings.model_name or (model.path.name if model.path else model.architecture.name)
        self.pool = CachePool(model, settings.caches, settings.max_cache_bytes)
        self.refusals = RefusalLog()
        self.queued = 0

    def admit(self) -> None:
        """Count a generation request in, or refuse it (429) when the queue is full."""
        if self.queued >= self.settings.max_queue:
            raise ApiError(429, f"{self.queued} requests are already running or waiting for the model (the limit); "
                                "retry later", "rate_limit_error", code="queue_full")
        self.queued += 1


def create_app(model: GenerativeModel, settings: ServerSettings | None = None, **overrides: Any) -> Any:
    """The ASGI application serving ``model``; ``overrides`` set :class:`ServerSettings` fields."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    settings = (settings or ServerSettings()).model_copy(update=overrides)
    ServerSettings.model_validate(settings.model_dump())
    state = ServerState(model, settings)

    def json_error(error: ApiError) -> Response:
        if error.status >= 500 or error.status == 429:
            state.refusals.refused(error.code or error.kind, error.message)
        return JSONResponse(error.body(), status_code=error.status)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.name, "object": "model", "created": 0, "owned_by": "mlxchat"}]})

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, settings)
        parsed = parse_request(body)
        config = parsed.generation_config()
        messages = [m.model_dump() for m in parsed.messages]
        await inline_images(messages, allow_remote=settings.allow_remote_images, max_bytes=settings.max_body_bytes,
                            reads_images=model.supports_images)
        state.admit()
        cache = state.pool.take(messages)
        try:
            session = model.chat_session(tools=parsed.tool_list(), cache=cache)
            session.prime_history(messages)
            stream = session.start_from_history_stream(config=config)
        except (MlxchatError, ValueError) as exc:
            state.queued -= 1
            state.pool.give_back([], cache)
            raise ApiError(400, str(exc)) from None

        def release() -> None:
            """Return the cache to the pool, remembering the conversation it now holds."""
            state.queued -= 1
            state.pool.give_back(messages + [m.template_dict() for m in session.messages[len(messages):]], cache)

        completion = Completion(state.name, bool(parsed.stream_options and parsed.stream_options.include_usage))
        events = aiter(stream)
        watcher = asyncio.ensure_future(_watch_disconnect(request, stream.cancel))
        try:
            first: StreamEvent = await anext(events)
            if not parsed.stream:
                while not isinstance(first, Done):
                    first = await anext(events)
        except MlxchatError as exc:
            release()
            return json_error(request_error(exc))
        except BaseException:
            release()
            raise
        finally:
            watcher.cancel()  # from here on the streaming response watches the client itself
        if isinstance(first, Done) and not parsed.stream:
            release()
            return JSONResponse(completion.response(first.result))

        async def lines() -> AsyncIterator[str]:
            try:
                async for line in completion.lines(first, events):
                    yield line
            finally:
                try:
                    await _close(events)
                finally:
                    release()

        return StreamingResponse(lines(), media_type="text/event-stream")

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_error(exc)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_error(ApiError(exc.status_code, str(exc.detail), kind))

    async def server_error(_: Request, exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc)
        return json_error(ApiError(500, "internal server error; see the server log", "server_error"))

    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"])],
        middleware=[*([Middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_headers=["*"],
                                  allow_methods=["GET", "POST", "DELETE", "OPTIONS"])]
                      if settings.cors_origins else []),
                    Middleware(Guard, settings=settings, refusals=state.refusals)],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
    )
    app.state.mlxchat = state
    return app


async def _watch_disconnect(request: Any, on_gone: Callable[[], None]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    on_gone()


async def _close(events: Any) -> None:
    """Close a turn's event iterator even when the response task is being cancelled (the client left), so
    that the turn ends (the worker stops at the next token) before the cache goes back to the pool."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await asyncio.shield(close())


def serve(model: GenerativeModel, host: str = "127.0.0.1", port: int = 8000,
          settings: ServerSettings | None = None, **overrides: Any) -> None:
    """Run the API with uvicorn until interrupted. Bound to a loopback address, only loopback host names
    are accepted (unless ``allowed_hosts`` says otherwise)."""
    import uvicorn

    settings = (settings or ServerSettings()).model_copy(update=overrides)
    if settings.allowed_hosts is None and is_loopback(host):
        settings = settings.model_copy(update={"allowed_hosts": ["localhost", "127.0.0.1", "::1"]})
    for name in ("uvicorn.error", "mlxchat.server"):
        logging.getLogger(name).addFilter(RateLimitedFilter())
    config = uvicorn.Config(
        create_app(model, settings), host=host, port=port, log_level="info", access_log=False,
        http=guarded_protocol(settings.header_timeout), limit_concurrency=settings.max_connections + 16,
        timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024,
    )
    uvicorn.Server(config).run()
