"""The ASGI application and ``serve``: routes (the chat page's among them), the guard in front of them, and
JSON for every error."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ..model import GenerativeModel
from . import anthropic, chat_completions, conversations, responses
from .errors import ApiError, RateLimitedFilter
from .guard import Guard, ServerSettings, access_log, guarded_protocol, is_loopback
from .lifecycle import api_error as lifecycle_error
from .lifecycle import turn_route
from .openapi import openapi_document
from .state import ServerState
from .store import StoreError


def create_app(model: GenerativeModel, settings: ServerSettings | None = None, *, tools: Sequence[Any] = (),
               **overrides: Any) -> Any:
    """The ASGI application serving ``model``; ``overrides`` set :class:`ServerSettings` fields, ``tools``
    run on the server for the chat page's conversations. Its shutdown closes the page's conversations, the
    response store and removes spilled caches."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    settings = (settings or ServerSettings()).model_copy(update=overrides)
    ServerSettings.model_validate(settings.model_dump())
    state = ServerState(model, settings)
    page_routes, page = conversations.routes(state, tools)

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        page.close()
        state.close()

    def json_error(request: Request, error: ApiError) -> Response:
        if error.status >= 500 or error.status == 429:
            state.refusals.refused(error.code or error.kind, error.message)
        return JSONResponse(error.body(request.url.path), status_code=error.status)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", **state.held()})

    async def metrics(_: Request) -> Response:
        page, media = state.metrics.page()
        return Response(page, headers={"Content-Type": media})

    async def openapi(_: Request) -> Response:
        return JSONResponse(openapi_document())

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.name, "object": "model", "created": 0, "owned_by": "mlxchat"}]})

    def route(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            response: Response = await handler(state, request)
            return response

        return endpoint

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_error(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_error(request, ApiError(exc.status_code, str(exc.detail), kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        # (Starlette raises the exception again after this answer, and the server logs it with its traceback)
        return json_error(request, ApiError(500, "internal server error; see the server log", "server_error"))

    async def store_error(request: Request, exc: Exception) -> Response:  # a damaged row, a store held elsewhere
        return json_error(request, lifecycle_error(exc))

    async def client_left(request: Request, exc: Exception) -> Response:
        return json_error(request, ApiError(499, "the client left before its request was read"))

    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]),
                Route("/metrics", metrics, methods=["GET"]),
                Route("/openapi.json", openapi, methods=["GET"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/v1/chat/completions", turn_route(state, "chat.completions", chat_completions.prepare),
                      methods=["POST"]),
                Route("/v1/responses", turn_route(state, "responses", responses.prepare), methods=["POST"]),
                Route("/v1/responses/{response_id}", route(responses.retrieve), methods=["GET"]),
                Route("/v1/responses/{response_id}", route(responses.delete), methods=["DELETE"]),
                Route("/v1/responses/{response_id}/input_items", route(responses.input_items), methods=["GET"]),
                Route("/v1/messages", turn_route(state, "messages", anthropic.prepare), methods=["POST"]),
                *page_routes],
        middleware=[*([Middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_headers=["*"],
                                  allow_methods=["GET", "POST", "DELETE", "OPTIONS"])]
                      if settings.cors_origins else []),
                    Middleware(Guard, settings=settings, refusals=state.refusals, metrics=state.metrics)],
        exception_handlers={ApiError: api_error, HTTPException: http_error, ClientDisconnect: client_left,
                            StoreError: store_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.mlxchat = state
    return app


def serve(model: GenerativeModel, host: str = "127.0.0.1", port: int = 8000,
          settings: ServerSettings | None = None, *, tools: Sequence[Any] = (), **overrides: Any) -> None:
    """Run the API with uvicorn until interrupted. Bound to a loopback address, only loopback host names
    are accepted (unless ``allowed_hosts`` says otherwise)."""
    import uvicorn

    settings = (settings or ServerSettings()).model_copy(update=overrides)
    if settings.allowed_hosts is None and is_loopback(host):
        settings = settings.model_copy(update={"allowed_hosts": ["localhost", "127.0.0.1", "::1"]})
    for name in ("uvicorn.error", "mlxchat.server"):
        logging.getLogger(name).addFilter(RateLimitedFilter())
    access = logging.getLogger(access_log.name)
    if not access.hasHandlers():  # the access log goes to stderr unless the application routes it
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    config = uvicorn.Config(
        create_app(model, settings, tools=tools), host=host, port=port, log_level="info", access_log=False,
        http=guarded_protocol(settings.header_timeout), limit_concurrency=settings.max_connections + 16,
        timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024,
        timeout_graceful_shutdown=5,  # an open chat page's event stream never ends by itself
    )
    uvicorn.Server(config).run()
