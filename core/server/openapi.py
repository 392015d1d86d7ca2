"""``GET /openapi.json``: the server's API as an OpenAPI 3.1 document, its request bodies the JSON Schemas
of the pydantic models the endpoints validate with (so the document cannot drift from what is accepted),
and every error the JSON body of its API's shape (OpenAI's, or Anthropic's on ``/v1/messages``).

Clients and fuzzers read it (CI runs schemathesis against it: no 5xx, every refusal a documented error).
Replies are documented as JSON objects or event streams without their fields: the endpoints build them
field by field after the official APIs, which publish them. The chat page's conversation API is in it (one
path per action, each with its body's model, linked from the conversation a ``POST`` creates so that a
fuzzer reaches a real one), and so is ``/metrics``; the page's own files are not.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .anthropic import MessagesRequest
from .chat_completions import ChatCompletionRequest
from .conversations import ACTIONS, CONVERSATION_ID, Send
from .responses import ResponsesRequest

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": {"type": "string"},
                                                                        "message": {"type": "string"}}}},
}
_OBJECT = {"type": "object"}
_EVENTS = {"schema": {"type": "object"}}  # each event: its event and data


def _errors(schema: str) -> dict[str, Any]:
    """Every refusal (4xx) and overload (503): a JSON error body; nothing else fails."""
    body = {"description": "refused",
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    return {"4XX": body, "503": {**body, "description": "busy: try again"}}


def _operation(summary: str, errors: str, body: type[BaseModel] | dict[str, Any] | None = None, stream: bool = False,
               parameters: list[dict[str, Any]] | None = None, status: str = "200",
               content: dict[str, Any] | None = None) -> dict[str, Any]:
    """An operation taking a JSON ``body`` (its model, or a schema), answering ``status`` with a JSON object (and
    an event stream when ``stream``) or with ``content``."""
    if content is None:
        content = {"application/json": {"schema": _OBJECT}}
        if stream:
            content["text/event-stream"] = _EVENTS
    operation: dict[str, Any] = {"summary": summary,
                                 "responses": {status: {"description": "done", "content": content}, **_errors(errors)}}
    if body is not None:
        schema = body if isinstance(body, dict) else {"$ref": f"#/components/schemas/{body.__name__}"}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if parameters:
        operation["parameters"] = parameters
    return operation


def _path_id() -> dict[str, Any]:
    return {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _conversation_paths() -> dict[str, Any]:
    """The chat page's conversation API (see :mod:`.conversations`): the conversation a ``POST`` creates links
    to what can be done with it (not to its never-ending event stream)."""
    conversation = [{"name": "id", "in": "path", "required": True,
                     "schema": {"type": "string", "pattern": f"^{CONVERSATION_ID.pattern}$"}}]
    actions: dict[str, type[BaseModel]] = {"send": Send, **{name: kind for name, (kind, _) in ACTIONS.items()}}
    paths: dict[str, Any] = {
        "/api/conversations": {
            "get": _operation("The stored conversations, latest first", "OpenAIError"),
            "post": {**_operation("A new conversation: its state (the body is not read, but every POST is JSON)",
                                  "OpenAIError", _OBJECT, status="201"),
                     "operationId": "createConversation"}},
        "/api/conversations/{id}": {
            "get": {**_operation("A conversation's state", "OpenAIError", parameters=conversation),
                    "operationId": "showConversation"},
            "delete": {**_operation("Delete a conversation", "OpenAIError", parameters=conversation),
                       "operationId": "deleteConversation"}},
        "/api/conversations/{id}/events": {
            "get": _operation("A conversation's states as they change (server-sent events)", "OpenAIError",
                              parameters=conversation, content={"text/event-stream": _EVENTS})},
    }
    for name, kind in actions.items():
        paths[f"/api/conversations/{{id}}/{name}"] = {"post": {
            **_operation(f"The {name} action: the state after it", "OpenAIError", kind, parameters=conversation),
            "operationId": f"{name}Conversation"}}
    _link(paths["/api/conversations"]["post"], "201", "id",
          ["showConversation", "deleteConversation", *(f"{name}Conversation" for name in actions)])
    return paths


def _link(operation: dict[str, Any], status: str, parameter: str, operations: list[str]) -> None:
    """Link ``operation``'s answer to ``operations``, whose path ``parameter`` is the answer's id (a fuzzer
    then calls them on what it created)."""
    operation["responses"][status]["links"] = {
        linked: {"operationId": linked, "parameters": {parameter: "$response.body#/id"}} for linked in operations}


@cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the server's routes (built once; callers must not change it)."""
    requests: list[type[BaseModel]] = [ChatCompletionRequest, ResponsesRequest, MessagesRequest, Send,
                                       *dict.fromkeys(kind for kind, _ in ACTIONS.values())]
    _, defs = models_json_schema([(model, "validation") for model in requests],
                                 ref_template="#/components/schemas/{model}")
    schemas = {**defs.get("$defs", {}), "OpenAIError": _OPENAI_ERROR, "AnthropicError": _ANTHROPIC_ERROR}
    listing = [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
               {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
               {"name": "after", "in": "query", "schema": {"type": "string"}}]
    paths = {
        "/health": {"get": _operation("Whether the server is up", "OpenAIError")},
        "/v1/models": {"get": _operation("The served model", "OpenAIError")},
        "/v1/chat/completions": {"post": _operation("A chat completion (OpenAI)", "OpenAIError",
                                                    ChatCompletionRequest, stream=True)},
        "/v1/responses": {"post": _operation("A response (OpenAI Responses API)", "OpenAIError",
                                             ResponsesRequest, stream=True)},
        "/v1/responses/{response_id}": {
            "get": {**_operation("A stored response", "OpenAIError", parameters=[_path_id()]),
                    "operationId": "getResponse"},
            "delete": {**_operation("Delete a stored response", "OpenAIError", parameters=[_path_id()]),
                       "operationId": "deleteResponse"}},
        "/v1/responses/{response_id}/input_items": {
            "get": {**_operation("A stored response's input items", "OpenAIError", parameters=[_path_id(), *listing]),
                    "operationId": "listInputItems"}},
        "/v1/messages": {"post": _operation("A message (Anthropic Messages API)", "AnthropicError", MessagesRequest,
                                            stream=True)},
        "/metrics": {"get": _operation("The server's counters (Prometheus' text format)", "OpenAIError",
                                       content={"text/plain": {"schema": {"type": "string"}}})},
        **_conversation_paths(),
    }
    _link(paths["/v1/responses"]["post"], "200", "response_id", ["getResponse", "deleteResponse", "listInputItems"])
    return {"openapi": "3.1.0", "info": {"title": "mlxchat", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}
