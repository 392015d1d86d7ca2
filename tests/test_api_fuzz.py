"""The server fuzzed from its own OpenAPI document (``GET /openapi.json``, built from the pydantic request
models): schemathesis sends bounded numbers of valid and invalid requests to every operation of a live
server on the demo model (the chat page's conversation API through the conversations it creates, following
the document's links), but a conversation's event stream, which never ends by design. No 5xx, no request
left hanging, every status and error body the documented one (OpenAI's error shape, Anthropic's on
/v1/messages). Marked slow (about a minute)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from starlette.routing import Route

import mlxchat
from mlxchat.demo import default_model_path
from mlxchat.server.conversations import ACTIONS
from mlxchat.server.openapi import openapi_document

from server_support import serving

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_the_document_names_every_operation_with_its_request_model() -> None:
    document = openapi_document()
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    bodies = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"].get("$ref")
              for path, ops in paths.items() if "post" in ops}
    actions = {f"/api/conversations/{{id}}/{name}": f"#/components/schemas/{kind.__name__}"
               for name, (kind, _) in ACTIONS.items()}
    assert bodies == {"/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
                      "/v1/responses": "#/components/schemas/ResponsesRequest",
                      "/v1/messages": "#/components/schemas/MessagesRequest",
                      "/api/conversations": None,  # a new conversation: any JSON object, not read
                      "/api/conversations/{id}/send": "#/components/schemas/Send", **actions}
    schemas = document["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert paths["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"] \
        == "#/components/schemas/AnthropicError"


def test_the_server_publishes_the_document_with_every_route_but_the_pages_files(tmp_path) -> None:
    with serving("demo", store=str(tmp_path / "store.sqlite3")) as served:
        reply = httpx.get(f"{served.url}/openapi.json")
        routes = {(route.path.replace("{action}", name), method.lower())
                  for route in served.app.routes if isinstance(route, Route)
                  for method in route.methods or () if method != "HEAD"
                  for name in ([*ACTIONS, "send"] if "{action}" in route.path else [""])}
    assert reply.status_code == 200 and reply.json() == openapi_document()
    documented = {(path, method) for path, operations in openapi_document()["paths"].items() for method in operations}
    assert documented == routes - {("/", "get"), ("/openapi.json", "get")}  # the page and the document itself


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_no_hang_and_documented_errors(tmp_path) -> None:
    model = mlxchat.load_model(default_model_path(), dtype="float32")
    model.defaults = model.defaults.merged({"max_tokens": 16})  # the page's turns take no max_tokens
    with model, serving("demo", model, store=str(tmp_path / "store.sqlite3"), max_queue=64) as served:
        done = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{served.url}/openapi.json", "--checks", CHECKS,
             "--mode", "all", "--max-examples", "5", "--seed", "1", "--request-timeout", "60",
             "--generation-database", "none", "--workers", "1", "--no-color", "--max-failures", "5",
             "--exclude-path", "/api/conversations/{id}/events"],
            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
