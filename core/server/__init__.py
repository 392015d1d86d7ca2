"""An OpenAI-compatible HTTP API over one model, on Starlette and uvicorn (``pip install mlxchat[server]``;
``mlxchat serve`` runs it): ``POST /v1/chat/completions`` (streaming, tools, reasoning), ``GET /v1/models``
and ``GET /health``.

Modules: :mod:`.app` (routes and ``serve``), :mod:`.chat_completions` (the chat API), :mod:`.guard`
(settings, limits, authentication, host and body checks), :mod:`.pool` (prompt caches kept between
requests), :mod:`.errors` (OpenAI-style error bodies, a refusal log that cannot be flooded).
"""

from .app import create_app, serve
from .guard import ServerSettings
from .pool import CachePool

__all__ = ["CachePool", "ServerSettings", "create_app", "serve"]
