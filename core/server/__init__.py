"""An HTTP API over one model, on Starlette and uvicorn (``pip install mlxchat[server]``; ``mlxchat serve``
runs it): OpenAI's ``POST /v1/chat/completions`` and Responses API (``/v1/responses``, stored responses
continued by ``previous_response_id``), Anthropic's ``POST /v1/messages``, ``GET /v1/models``,
``GET /health``, and a chat page at ``GET /`` over its conversation API (``/api/conversations``).

Modules: :mod:`.app` (routes and ``serve``), :mod:`.chat_completions`, :mod:`.responses` and
:mod:`.anthropic` (the three APIs, each only translating), :mod:`.lifecycle` (one request's life on all
three: admission, disconnects, errors, release, metrics), :mod:`.conversations` (the chat page's API:
one ChatController per conversation, its state as server-sent events; the page itself is in ``static/``),
:mod:`.turns` (one request's turn over a pooled cache, tool choice), :mod:`.store` (stored responses and the
page's conversations in SQLite),
:mod:`.guard` (settings, limits, authentication, host and body checks, the access log), :mod:`.metrics`
(``GET /metrics``), :mod:`.admission` (cache memory reserved per request), :mod:`.pool` (prompt caches kept
between requests, spilled to disk when evicted), :mod:`.errors` (OpenAI- and Anthropic-style error bodies,
a refusal log that cannot be flooded).
"""

from .app import create_app, serve
from .guard import ServerSettings
from .pool import CachePool

__all__ = ["CachePool", "ServerSettings", "create_app", "serve"]
