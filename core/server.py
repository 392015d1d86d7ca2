"""An OpenAI-compatible HTTP API over one model: ``POST /v1/chat/completions`` (streaming, tools, reasoning)
and ``GET /v1/models``, on Starlette (``pip install mlxchat[server]``; ``mlxchat serve`` runs it).

Each request carries the whole conversation, as the API has it. The server keeps a few prompt caches and
serves each request with the one whose last conversation shares the longest prefix with it, through a
:class:`~mlxchat.session.ChatSession`, so a follow-up request prefills only what changed
(``usage.prompt_tokens_details.cached_tokens`` says how much was reused). Requests take turns on the
model's worker; the event loop never blocks, and a client that disconnects mid-stream cancels its reply.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .errors import MlxchatError, SessionStateError, TemplateError
from .generation import GenerationConfig, GenerationReport
from .messages import ChatMessage, ToolCall
from .model import GenerativeModel
from .prompt_cache import PromptCache
from .reply import TextDelta, ThinkingDelta, ToolCallEvent
from .session import ChatResult, Done

# OpenAI request fields and the GenerationConfig fields they set.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty"}


class CachePool:
    """A few prompt caches, each remembering the conversation it last served."""

    def __init__(self, model: GenerativeModel, size: int = 4):
        self.model = model
        self.size = size
        self._entries: list[tuple[list[dict[str, Any]], PromptCache]] = []

    def take(self, messages: list[dict[str, Any]]) -> PromptCache:
        """The cache whose last conversation shares the most leading messages with ``messages`` (a fresh one
        when none shares any and there is room; else the least recently used)."""
        best, best_shared = None, 0
        for index, (seen, _) in enumerate(self._entries):
            shared = next((i for i, (a, b) in enumerate(zip(seen, messages, strict=False)) if a != b),
                          min(len(seen), len(messages)))
            if shared > best_shared:
                best, best_shared = index, shared
        if best is None:
            if len(self._entries) < self.size:
                return self.model.make_prompt_cache()
            best = 0
        return self._entries.pop(best)[1]

    def give_back(self, messages: list[dict[str, Any]], cache: PromptCache) -> None:
        self._entries.append((messages, cache))


def _config(body: dict[str, Any]) -> GenerationConfig:
    values = {field: body[key] for key, field in _SAMPLING.items() if body.get(key) is not None}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        values["max_tokens"] = limit
    if body.get("stop") is not None:
        values["stop"] = [body["stop"]] if isinstance(body["stop"], str) else list(body["stop"])
    if body.get("logit_bias"):
        values["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if "enable_thinking" in kwargs:
        values["enable_thinking"] = kwargs.pop("enable_thinking")
    if kwargs:
        values["chat_template_kwargs"] = kwargs
    return GenerationConfig.model_validate(values)


def _message(result: ChatResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text or None}
    if result.thinking is not None:
        message["reasoning_content"] = result.thinking
    calls = [c for c in result.tool_calls if c.status == "ok"]
    if calls:
        message["tool_calls"] = [c.model_dump() for c in calls]
    return message


def _usage(report: GenerationReport) -> dict[str, Any]:
    return {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.generated_tokens,
            "total_tokens": report.prompt_tokens + report.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": report.cached_prompt_tokens}}


def _finish(reason: str) -> str:
    return "stop" if reason == "cancelled" else reason


def _call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.function.arguments}}


def create_app(model: GenerativeModel, *, model_name: str | None = None, caches: int = 4) -> Any:
    """The ASGI application serving ``model`` under ``model_name`` (its folder name by default)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    name = model_name or (model.path.name if model.path else model.architecture.name)
    pool = CachePool(model, caches)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "mlxchat"}]})

    async def chat_completions(request: Request) -> Response:
        try:
            body = await request.json()
            messages = [ChatMessage.coerce(m).model_dump() for m in body["messages"]]
            config = _config(body)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return error(400, f"bad request: {exc}")
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        cache = pool.take(messages)
        try:
            session = model.chat_session(tools=tools, cache=cache)
            session.prime_history(messages)
            stream = session.start_from_history_stream(config=config)
        except (SessionStateError, ValueError) as exc:
            pool.give_back([], cache)
            return error(400, str(exc))

        def release() -> None:
            """Return the cache to the pool, remembering the conversation it now holds."""
            pool.give_back(messages + [m.model_dump() for m in session.messages[len(messages):]], cache)

        completion = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def envelope(obj: str, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
            return {"id": completion, "object": obj, "created": created, "model": name, "choices": [choice],
                    **extra}

        if not body.get("stream"):
            try:
                result = await stream.acollect()
            except TemplateError as exc:  # the template rejects these messages: the request is at fault
                return error(400, str(exc))
            except MlxchatError as exc:
                return error(500, str(exc), "server_error")
            finally:
                release()
            choice = {"index": 0, "message": _message(result), "finish_reason": _finish(result.finish_reason)}
            return JSONResponse(envelope("chat.completion", choice, usage=_usage(result.report)))

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[str]:
            def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return f"data: {json.dumps(envelope('chat.completion.chunk', choice, **extra))}\n\n"

            calls = 0
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for event in stream:
                    if isinstance(event, TextDelta):
                        yield chunk({"content": event.text})
                    elif isinstance(event, ThinkingDelta):
                        yield chunk({"reasoning_content": event.text})
                    elif isinstance(event, ToolCallEvent) and event.call.status == "ok":
                        yield chunk({"tool_calls": [_call_delta(calls, event.call)]})
                        calls += 1
                    elif isinstance(event, Done):
                        yield chunk({}, _finish(event.result.finish_reason))
                        if include_usage:
                            done = envelope("chat.completion.chunk", {}, usage=_usage(event.result.report))
                            done["choices"] = []
                            yield f"data: {json.dumps(done)}\n\n"
                yield "data: [DONE]\n\n"
            except MlxchatError as exc:
                yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
            finally:
                release()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def serve(model: GenerativeModel, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Run the API with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(model, **kwargs), host=host, port=port, log_level="info")
