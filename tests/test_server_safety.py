"""No request can crash, hang or exhaust the server: malformed requests get OpenAI-style 4xx JSON and the
server answers afterwards; prompts that cannot fit are refused before any work; a client that leaves
stops its work; the cache pool stays within its bounds; authentication, the Host check, JSON-only bodies,
size, queue and connection limits, the header timeout and CORS do what the README says."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import mlxchat  # noqa: E402

from conftest import fixture_path, loaded  # noqa: E402
from server_support import Served, serving  # noqa: E402

USER = [{"role": "user", "content": "Hello"}]
OK = {"model": "tiny", "messages": USER, "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
JSON = {"content-type": "application/json"}


def body(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


# (case, method, path, body: dict | bytes | None, extra headers, expected status)
CASES: list[tuple[str, str, str, Any, dict[str, str], int]] = [
    ("not json", "POST", "/v1/chat/completions", b"{", {}, 400),
    ("json array", "POST", "/v1/chat/completions", b"[]", {}, 400),
    ("json string", "POST", "/v1/chat/completions", b'"hello"', {}, 400),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400),
    ("nested 100k deep", "POST", "/v1/chat/completions", deep(100_000).encode(), {}, 400),
    ("nested 100 deep in a field", "POST", "/v1/chat/completions",
     ('{"messages": [{"role": "user", "content": "x"}], "metadata": ' + deep(100) + "}").encode(), {}, 400),
    ("invalid utf-8", "POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', {}, 400),
    ("NaN penalty", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": NaN}', {}, 400),
    ("Infinity temperature", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', {}, 400),
    ("text/plain body", "POST", "/v1/chat/completions", json.dumps(OK).encode(), {"content-type": "text/plain"}, 415),
    ("form body", "POST", "/v1/chat/completions", b"a=b", {"content-type": "application/x-www-form-urlencoded"},
     415),
    ("no content type", "POST", "/v1/chat/completions", json.dumps(OK).encode(), {"content-type": ""}, 415),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny"}, {}, 400),
    ("no messages", "POST", "/v1/chat/completions", body(messages=[]), {}, 400),
    ("messages a number", "POST", "/v1/chat/completions", body(messages=42), {}, 400),
    ("message without role", "POST", "/v1/chat/completions", body(messages=[{"content": "x"}]), {}, 400),
    ("unknown role", "POST", "/v1/chat/completions", body(messages=[{"role": "wizard", "content": "x"}]), {}, 400),
    ("content a number", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": 42}]), {}, 400),
    ("image part for a text model", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), {}, 400),
    ("unknown part type", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": [
        {"type": "hologram"}]}]), {}, 400),
    ("lone surrogate in content", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', {}, 400),
    ("lone surrogate in a name", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi", "name": "\\udc00"}]}', {}, 400),
    ("tool message without call id", "POST", "/v1/chat/completions",
     body(messages=[*USER, {"role": "tool", "content": "x"}]), {}, 400),
    ("tool call without function", "POST", "/v1/chat/completions", body(messages=[
        *USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]), {}, 400),
    ("tool call arguments a number", "POST", "/v1/chat/completions", body(messages=[
        *USER, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": 42}}]}]),
     {}, 400),
    ("conversation ending with a reply", "POST", "/v1/chat/completions",
     body(messages=[*USER, {"role": "assistant", "content": "hi"}]), {}, 400),
    ("10k messages", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": "hi"}] * 10_000),
     {}, 400),
    ("1 MB message", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": "ab " * 350_000}]),
     {}, 400),
    ("negative temperature", "POST", "/v1/chat/completions", body(temperature=-1), {}, 400),
    ("temperature a word", "POST", "/v1/chat/completions", body(temperature="hot"), {}, 400),
    ("temperature 3", "POST", "/v1/chat/completions", body(temperature=3), {}, 400),
    ("top_p 0", "POST", "/v1/chat/completions", body(top_p=0), {}, 400),
    ("top_p 1.5", "POST", "/v1/chat/completions", body(top_p=1.5), {}, 400),
    ("max_tokens 0", "POST", "/v1/chat/completions", body(max_tokens=0), {}, 400),
    ("max_tokens -5", "POST", "/v1/chat/completions", body(max_tokens=-5), {}, 400),
    ("max_tokens a word", "POST", "/v1/chat/completions", body(max_tokens="x"), {}, 400),
    ("max_completion_tokens 0", "POST", "/v1/chat/completions", body(max_completion_tokens=0), {}, 400),
    ("n 0", "POST", "/v1/chat/completions", body(n=0), {}, 400),
    ("n 17", "POST", "/v1/chat/completions", body(n=17), {}, 400),
    ("another model", "POST", "/v1/chat/completions", body(model="gpt-4o"), {}, 404),
    ("response_format of an unknown type", "POST", "/v1/chat/completions", body(response_format={"type": "yaml"}),
     {}, 400),
    ("response_format json_schema that cannot compile", "POST", "/v1/chat/completions", body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), {}, 400),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", body(top_logprobs=2), {}, 400),
    ("top_logprobs 21", "POST", "/v1/chat/completions", body(logprobs=True, top_logprobs=21), {}, 400),
    ("tool_choice naming a function not offered", "POST", "/v1/chat/completions", body(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), {}, 400),
    ("tool_choice required without tools", "POST", "/v1/chat/completions", body(tool_choice="required"), {}, 400),
    ("seed 2**64", "POST", "/v1/chat/completions", body(seed=2**64), {}, 400),
    ("seed -2", "POST", "/v1/chat/completions", body(seed=-2), {}, 400),
    ("seed a word", "POST", "/v1/chat/completions", body(seed="x"), {}, 400),
    ("presence_penalty 5", "POST", "/v1/chat/completions", body(presence_penalty=5), {}, 400),
    ("frequency_penalty -3", "POST", "/v1/chat/completions", body(frequency_penalty=-3), {}, 400),
    ("logit_bias id past 2**32", "POST", "/v1/chat/completions", body(logit_bias={"99999999999": 5}), {}, 400),
    ("logit_bias id past the vocabulary", "POST", "/v1/chat/completions", body(logit_bias={"5000": 1}), {}, 400),
    ("logit_bias id just past the vocabulary", "POST", "/v1/chat/completions", body(logit_bias={"512": 1}), {},
     400),
    ("logit_bias key a word", "POST", "/v1/chat/completions", body(logit_bias={"abc": 1}), {}, 400),
    ("logit_bias key negative", "POST", "/v1/chat/completions", body(logit_bias={"-1": 1}), {}, 400),
    ("logit_bias value 500", "POST", "/v1/chat/completions", body(logit_bias={"1": 500}), {}, 400),
    ("logit_bias key a superscript digit", "POST", "/v1/chat/completions", body(logit_bias={"\u00b2": 1}), {}, 400),
    ("logit_bias key an Arabic-Indic digit", "POST", "/v1/chat/completions", body(logit_bias={"\u0663": 1}), {},
     400),
    ("a number of 5,000 digits", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"1" * 5000 + b"}", {}, 400),
    ("response_format requiring a property that is false", "POST", "/v1/chat/completions", body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"b": False}, "required": ["b"]}}}), {}, 400),
    ("response_format with a false property beside one that cannot compile", "POST", "/v1/chat/completions",
     body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"b": False, "a": {"type": "string", "pattern": "("}}}}}), {}, 400),
    ("response_format referring to itself without end", "POST", "/v1/chat/completions", body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}), {}, 400),
    ("logit_bias a list", "POST", "/v1/chat/completions", body(logit_bias=[1]), {}, 400),
    ("stop a number", "POST", "/v1/chat/completions", body(stop=42), {}, 400),
    ("17 stop strings", "POST", "/v1/chat/completions", body(stop=[str(i) for i in range(17)]), {}, 400),
    ("stop with a lone surrogate", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}', {}, 400),
    ("top_k -5", "POST", "/v1/chat/completions", body(top_k=-5), {}, 400),
    ("min_p 2", "POST", "/v1/chat/completions", body(min_p=2), {}, 400),
    ("repetition_penalty 0", "POST", "/v1/chat/completions", body(repetition_penalty=0), {}, 400),
    ("tools 42", "POST", "/v1/chat/completions", body(tools=42), {}, 400),
    ("tools true", "POST", "/v1/chat/completions", body(tools=True), {}, 400),
    ("tools with a string function", "POST", "/v1/chat/completions", body(tools=[{"function": "x"}]), {}, 400),
    ("tools with an empty function", "POST", "/v1/chat/completions", body(tools=[{"function": {}}]), {}, 400),
    ("tool name with spaces", "POST", "/v1/chat/completions",
     body(tools=[{"type": "function", "function": {"name": "bad name!"}}]), {}, 400),
    ("tool of another type", "POST", "/v1/chat/completions", body(tools=[{"type": "retrieval"}]), {}, 400),
    ("tool parameters a list", "POST", "/v1/chat/completions",
     body(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), {}, 400),
    ("tool_choice unknown", "POST", "/v1/chat/completions", body(tools=[TOOL], tool_choice="sometimes"), {}, 400),
    ("template kwargs with messages", "POST", "/v1/chat/completions",
     body(chat_template_kwargs={"messages": []}), {}, 400),
    ("template kwargs with add_generation_prompt", "POST", "/v1/chat/completions",
     body(chat_template_kwargs={"add_generation_prompt": False}), {}, 400),
    ("template kwargs a string", "POST", "/v1/chat/completions", body(chat_template_kwargs="x"), {}, 400),
    ("stream_options malformed", "POST", "/v1/chat/completions", body(stream=True, stream_options={
        "include_usage": "maybe"}), {}, 400),
    ("responses: no input", "POST", "/v1/responses", {"model": "tiny"}, {}, 400),
    ("responses: input a number", "POST", "/v1/responses", {"input": 42}, {}, 400),
    ("responses: an item reference", "POST", "/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]},
     {}, 400),
    ("responses: an image part", "POST", "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, {}, 400),
    ("responses: a message without role", "POST", "/v1/responses", {"input": [{"content": "hi"}]}, {}, 400),
    ("responses: a call without call_id", "POST", "/v1/responses", {"input": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]}, {}, 400),
    ("responses: a web search tool", "POST", "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]},
     {}, 400),
    ("responses: a function tool without name", "POST", "/v1/responses", {"input": "hi", "tools": [
        {"type": "function"}]}, {}, 400),
    ("responses: json_schema format without a schema", "POST", "/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x"}}}, {}, 400),
    ("responses: an xml format", "POST", "/v1/responses", {"input": "hi", "text": {"format": {"type": "xml"}}},
     {}, 400),
    ("responses: background", "POST", "/v1/responses", {"input": "hi", "background": True}, {}, 400),
    ("responses: top_logprobs", "POST", "/v1/responses", {"input": "hi", "top_logprobs": 2}, {}, 400),
    ("responses: include logprobs", "POST", "/v1/responses", {"input": "hi", "include": [
        "message.output_text.logprobs"]}, {}, 400),
    ("responses: include an unknown part", "POST", "/v1/responses", {"input": "hi", "include": ["everything"]},
     {}, 400),
    ("responses: temperature 3", "POST", "/v1/responses", {"input": "hi", "temperature": 3}, {}, 400),
    ("responses: max_output_tokens 0", "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 0}, {}, 400),
    ("responses: reasoning effort a word", "POST", "/v1/responses", {"input": "hi", "reasoning": {
        "effort": "lots"}}, {}, 400),
    ("responses: 17 metadata pairs", "POST", "/v1/responses", {"input": "hi", "metadata": {
        str(i): "x" for i in range(17)}}, {}, 400),
    ("responses: tool_choice naming a function not offered", "POST", "/v1/responses", {"input": "hi", "tools": [
        {"type": "function", "name": "get_weather"}], "tool_choice": {"type": "function", "name": "nope"}}, {}, 400),
    ("responses: ending with the assistant", "POST", "/v1/responses", {"input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, {}, 400),
    ("responses: another model", "POST", "/v1/responses", {"model": "gpt-4o", "input": "hi"}, {}, 404),
    ("responses: an unknown previous response", "POST", "/v1/responses", {"input": "hi",
                                                                          "previous_response_id": "resp_x"}, {}, 404),
    ("responses: get an unknown response", "GET", "/v1/responses/resp_x", None, {}, 404),
    ("responses: delete an unknown response", "DELETE", "/v1/responses/resp_x", None, {}, 404),
    ("responses: input items of an unknown response", "GET", "/v1/responses/resp_x/input_items", None, {}, 404),
    ("responses: input items limit 0", "GET", "/v1/responses/resp_x/input_items?limit=0", None, {}, 400),
    ("a tool result answering no call", "POST", "/v1/chat/completions", body(messages=[
        *USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c2", "content": "x"}]),
     {}, 400),
    ("a tool result given twice", "POST", "/v1/chat/completions", body(messages=[
        *USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "tool", "tool_call_id": "c1", "content": "y"}]), {}, 400),
    ("responses: a function_call_output answering no call", "POST", "/v1/responses", {"input": [
        {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]}, {},
     400),
    ("responses: an image in a function_call_output", "POST", "/v1/responses", {"input": [
        {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, {}, 400),
    ("responses: input items limit a superscript digit", "GET", "/v1/responses/resp_x/input_items?limit=%C2%B2",
     None, {}, 400),
    ("responses: input items limit of 5,000 digits", "GET", "/v1/responses/resp_x/input_items?limit=" + "9" * 5000,
     None, {}, 400),
    ("GET on a POST route", "GET", "/v1/chat/completions", None, {}, 405),
    ("PUT on a POST route", "PUT", "/v1/chat/completions", OK, {}, 405),
    ("DELETE models", "DELETE", "/v1/models", None, {}, 405),
    ("unknown route", "POST", "/v1/nothing", OK, {}, 404),
    ("POST to the chat page", "POST", "/", OK, {}, 405),
    ("unknown page file", "GET", "/page/nothing.js", None, {}, 404),
]


@pytest.fixture(scope="module")
def server():
    with serving("qwen3_chat") as served:
        yield served


def send(server: Served, method: str, path: str, payload: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else None if payload is None else json.dumps(payload).encode()
    sent = {**(JSON if content is not None else {}), **(headers or {})}
    return httpx.request(method, server.url + path, content=content, headers={k: v for k, v in sent.items() if v},
                         timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert "Traceback" not in error["message"]
    return error


def test_the_malformed_request_table_has_enough_cases() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case", "method", "path", "payload", "headers", "status"), CASES, ids=[c[0] for c in CASES])
def test_malformed_requests_get_openai_errors_and_the_server_still_answers(server, case, method, path, payload,
                                                                          headers, status) -> None:
    assert_openai_error(send(server, method, path, payload, headers), status)
    assert send(server, "GET", "/health").json()["status"] == "ok"
    assert server.state.queued == 0


def test_after_every_malformed_request_a_real_completion_still_works(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "You are a test assistant."}
    reply = client.chat.completions.create(model="tiny", messages=[system, *USER], max_tokens=60, temperature=0)
    assert reply.choices[0].message.content == "Hi! How can I help?"


def test_a_prompt_that_cannot_fit_is_context_length_exceeded(server) -> None:
    started = time.monotonic()
    error = assert_openai_error(send(server, "POST", "/v1/chat/completions", body(messages=[
        {"role": "user", "content": "hi"}] * 10_000)), 400)
    assert error["code"] == "context_length_exceeded" and "4096" in error["message"]
    assert time.monotonic() - started < 30
    streamed = send(server, "POST", "/v1/chat/completions", body(stream=True, messages=[
        {"role": "user", "content": "ab " * 5000}]))
    assert assert_openai_error(streamed, 400)["code"] == "context_length_exceeded"


def test_values_that_are_accepted_and_adjusted(server) -> None:
    for fields in ({"max_tokens": 10**30}, {"seed": -1}, {"top_k": -1},
                   {"messages": [{"role": "developer", "content": "Be terse."}, *USER]},
                   {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}):
        response = send(server, "POST", "/v1/chat/completions", body(**fields))
        assert response.status_code == 200, (fields, response.text)


def test_a_stream_that_fails_after_it_started_ends_with_an_error_event_and_done() -> None:
    model = mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32")
    real = model.module.last_logits
    steps = {"n": 0}

    def failing(tokens, cache):
        steps["n"] += 1
        if steps["n"] == 8:
            raise RuntimeError("secret internal detail")
        return real(tokens, cache)

    model.module.last_logits = failing  # type: ignore[method-assign]
    with serving("qwen3_chat", model=model) as served:
        system = {"role": "system", "content": "You are a test assistant."}
        response = send(served, "POST", "/v1/chat/completions", body(messages=[system, *USER], stream=True,
                                                                     max_tokens=30, temperature=0))
        lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["type"] == "server_error" and "secret" not in error["message"]
        assert json.loads(lines[0])["choices"][0]["delta"]["role"] == "assistant"
    model.close()


def test_a_malformed_tool_call_comes_back_as_its_raw_text(server, scripted) -> None:
    model = loaded("qwen3_chat")
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    end = model.tokenizer.token_id("<|im_end|>")
    for stream in (False, True):
        scripted.append(model.tokenizer.encode(raw) + [end])
        response = send(server, "POST", "/v1/chat/completions", body(tools=[TOOL], stream=stream, max_tokens=60))
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"])
        else:
            message = response.json()["choices"][0]["message"]
            content = message["content"]
            assert "tool_calls" not in message and response.json()["choices"][0]["finish_reason"] == "stop"
        assert raw in content


UNCARRIABLE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>')
"""Calls whose arguments JSON cannot carry: NaN (which json.loads reads) and a lone surrogate (which UTF-8
cannot encode)."""
WIRE_TOOLS = {
    "/v1/chat/completions": {"model": "tiny", "messages": USER, "tools": [TOOL]},
    "/v1/responses": {"model": "tiny", "input": "Hello", "tools": [{"type": "function", **TOOL["function"]}]},
    "/v1/messages": {"model": "tiny", "messages": USER, "tools": [
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(WIRE_TOOLS))
def test_calls_whose_arguments_json_cannot_carry_come_back_as_raw_text_in_valid_json(server, scripted, path,
                                                                                      stream) -> None:
    model = loaded("qwen3_chat")
    scripted.append(model.tokenizer.encode(UNCARRIABLE) + [model.tokenizer.token_id("<|im_end|>")])
    response = send(server, "POST", path, {**WIRE_TOOLS[path], "stream": stream, "max_tokens": 80})
    assert response.status_code == 200, response.text[:300]

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
    items = [json.loads(data, parse_constant=refuse) for data in (lines if stream else [response.text])]
    while items:
        item = items.pop()
        if isinstance(item, dict):
            assert not item.get("tool_calls") and item.get("type") not in ("function_call", "tool_use"), item
            items += item.values()
        elif isinstance(item, list):
            items += item
    assert "NaN" in response.text and "\\\\ud800" in response.text  # the calls' raw text


def shown_text(response: httpx.Response, stream: bool) -> str:
    """The reply's text as a client of any of the three APIs shows it."""
    if not stream:
        reply = response.json()
        if "choices" in reply:
            return reply["choices"][0]["message"]["content"]
        parts = [p for item in reply["output"] if item["type"] == "message" for p in item["content"]] \
            if "output" in reply else reply["content"]
        return "".join(part.get("text", "") for part in parts)
    text = ""
    for line in response.text.splitlines():
        event = json.loads(line[6:]) if line.startswith("data: {") else {}
        if event.get("choices"):
            text += event["choices"][0]["delta"].get("content") or ""
        elif event.get("type") == "response.output_text.delta":
            text += event["delta"]
        elif event.get("type") == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text += event["delta"]["text"]
    return text


def test_a_malformed_block_of_several_calls_is_shown_once_where_the_model_wrote_it(scripted) -> None:
    model = loaded("gemma4")
    raw = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}call:get_weather{city:}<tool_call|>'
    reply = model.tokenizer.encode(f"Let me check. {raw} Sorry.") + [model.tokenizer.token_id("<turn|>")]
    with serving("gemma4") as served:
        for path, stream in [(path, stream) for path in WIRE_TOOLS for stream in (False, True)]:
            scripted.append(reply)
            response = send(served, "POST", path, {**WIRE_TOOLS[path], "stream": stream, "max_tokens": 80})
            assert shown_text(response, stream) == f"Let me check.{raw}Sorry.", (path, stream)


# -- leaving clients -------------------------------------------------------------------------------------

def no_eos(model: mlxchat.GenerativeModel) -> dict[str, float]:
    return {str(e): -100.0 for e in model.eos_ids}


def post_and_leave(server: Served, payload: dict[str, Any], after: float, *, once_started: bool = False) -> float:
    """Send a request on a raw socket and close it ``after`` seconds later (``once_started``: after its turn
    has started, past admission); return when it closed."""
    data = json.dumps(payload).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 30
        while once_started and not server.state.turns and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(after)
    return time.monotonic()


def wait_for_release(server: Served, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while server.state.queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.state.queued == 0, "the request never ended"
    return time.monotonic()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_decoding_stops_its_work(stream) -> None:
    model = loaded("qwen3_chat")
    with serving("qwen3_chat", caches=1) as served:
        payload = body(max_tokens=3500, temperature=1.0, seed=1, logit_bias=no_eos(model), stream=stream)
        left = post_and_leave(served, payload, 0.4)
        ended = wait_for_release(served)
        cache, = served.state.pool.caches
        assert len(cache) < 1500  # the reply stopped well short of its 3500 tokens
        assert ended - left < 5


def test_a_client_that_leaves_during_prefill_stops_it() -> None:
    model = loaded("qwen3_chat")
    content = "tell me about the weather in paris " * 300
    prompt = len(model.apply_chat_template([{"role": "user", "content": content}]))
    assert 2000 < prompt < 4000
    with serving("qwen3_chat", caches=1) as served:
        post_and_leave(served, body(messages=[{"role": "user", "content": content}], max_tokens=5), 0.05,
                       once_started=True)
        wait_for_release(served)
        cache, = served.state.pool.caches
        assert len(cache) < prompt


# -- bounds ----------------------------------------------------------------------------------------------

def test_the_cache_pool_stays_within_its_count_and_bytes() -> None:
    """Eight conversations of ~430 tokens each, different from their first words (how a cache grows its buffers,
    or copies a shared prefix, depends on which request comes first: only the tokens held are certain)."""
    def conversations(served: Served) -> None:
        contents = [f"Conversation {i}: " + " ".join(f"item {i}-{j}" for j in range(60)) for i in range(8)]
        threads = [threading.Thread(target=send, args=(served, "POST", "/v1/chat/completions",
                                                       body(messages=[{"role": "user", "content": content}])))
                   for content in contents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_for_release(served)

    with serving("qwen3_chat", caches=3) as served:
        conversations(served)
        assert len(served.state.pool) == 3
    with serving("qwen3_chat", caches=8, max_cache_gb=2.5e-3) as served:  # 2.5 MB: eight hold >= 7 MB
        conversations(served)
        held = [len(cache) for cache in served.state.pool.caches]
        assert held and min(held) >= 430  # each holds its prompt (at 2 KB a token, >= 0.88 MB)
        assert len(held) < 8 and served.state.pool.nbytes <= 2.5e6


@contextmanager
def one_long_request(served: Served) -> Iterator[None]:
    """A long generation in flight (on a raw socket, closed on exit, which cancels it)."""
    model = loaded("qwen3_chat")
    data = json.dumps(body(max_tokens=3000, logit_bias=no_eos(model))).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        while served.state.queued == 0:
            time.sleep(0.01)
        yield
    wait_for_release(served)


def test_the_queue_refuses_with_429() -> None:
    with serving("qwen3_chat", max_queue=1) as served:
        with one_long_request(served):
            error = assert_openai_error(send(served, "POST", "/v1/chat/completions", OK), 429)
            assert error["code"] == "queue_full"
        assert send(served, "POST", "/v1/chat/completions", OK).status_code == 200


def test_requests_in_flight_beyond_the_connection_limit_get_503_but_health_answers() -> None:
    with serving("qwen3_chat", max_connections=1) as served:
        with one_long_request(served):
            assert assert_openai_error(send(served, "GET", "/v1/models"), 503)["code"] == "too_many_connections"
            assert send(served, "GET", "/health").status_code == 200
        assert send(served, "GET", "/v1/models").status_code == 200


def test_a_body_that_stalls_gets_408_and_gives_its_place_back(caplog) -> None:
    """A client that sends its headers and part of its body, then nothing, is answered 408 at --body-timeout (it
    does not hold a place among --max-connections for good); one that leaves mid-body is a 499, not an error."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"mes")
    with serving("qwen3_chat", max_connections=1, body_timeout=0.5) as served:
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            sock.sendall(head)
            sock.settimeout(10)
            assert b" 408 " in sock.recv(200).split(b"\r\n", 1)[0]
        assert send(served, "POST", "/v1/chat/completions", OK).status_code == 200
        with caplog.at_level(logging.ERROR):
            with socket.create_connection(("127.0.0.1", served.port)) as sock:
                sock.sendall(head)
            time.sleep(0.3)
            assert send(served, "GET", "/health").status_code == 200
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(server) -> None:
    """More characters than the context's tokens could ever cover: 400 at once, without tokenizing them."""
    most = server.state.model.context_length * server.state.longest_token * 2
    error = assert_openai_error(send(server, "POST", "/v1/chat/completions", body(messages=[
        {"role": "user", "content": "x" * (most + 1)}])), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]


def test_a_prompt_that_cannot_fit_is_a_400_even_where_memory_is_short() -> None:
    """The context is checked before memory is reserved: a prompt too long is never a retryable 503."""
    with serving("qwen3_chat", max_kv_gb=0.00001) as served:
        error = assert_openai_error(send(served, "POST", "/v1/chat/completions", body(messages=[
            {"role": "user", "content": "hi"}] * 10_000)), 400)
        assert error["code"] == "context_length_exceeded"


def test_each_failure_has_its_own_log_allowance() -> None:
    """The log's rate limit is per message and per place an exception was raised: a flood of one failure does not
    hide another's traceback."""
    from mlxchat.server.errors import RateLimitedFilter

    def record(exc: BaseException | None) -> logging.LogRecord:
        return logging.LogRecord("mlxchat.server", logging.ERROR, __file__, 1, "unexpected error", None,
                                 (type(exc), exc, exc.__traceback__) if exc is not None else None)

    def raised(kind: type[BaseException]) -> BaseException:
        try:
            raise kind("x")
        except BaseException as exc:  # noqa: BLE001
            return exc

    limit = RateLimitedFilter()
    first, again, other = raised(ValueError), raised(ValueError), raised(KeyError)
    assert limit.filter(record(first)) and not limit.filter(record(again)) and limit.filter(record(other))


def test_bodies_over_the_size_limit_get_413_with_or_without_a_length() -> None:
    with serving("qwen3_chat", max_body_mb=0.001) as served:
        big = json.dumps(body(messages=[{"role": "user", "content": "x" * 2000}])).encode()
        assert_openai_error(send(served, "POST", "/v1/chat/completions", big), 413)
        chunked = httpx.post(served.url + "/v1/chat/completions", content=iter([big[:1000], big[1000:]]),
                             headers=JSON, timeout=30)
        assert_openai_error(chunked, 413)
        assert send(served, "POST", "/v1/chat/completions", OK).status_code == 200


def test_a_connection_that_sends_no_headers_is_closed() -> None:
    with serving("qwen3_chat", header_timeout=0.5) as served:
        with socket.create_connection(("127.0.0.1", served.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            sock.settimeout(5)
            started = time.monotonic()
            assert sock.recv(100) == b""
            assert time.monotonic() - started < 4


# -- exposure --------------------------------------------------------------------------------------------

def test_an_api_key_guards_every_route_but_health() -> None:
    with serving("qwen3_chat", api_key="s3cret") as served:
        assert send(served, "GET", "/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            error = assert_openai_error(send(served, "GET", "/v1/models", headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert send(served, "GET", "/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert send(served, "GET", "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()


def test_only_loopback_host_names_reach_a_loopback_server() -> None:
    with serving("qwen3_chat", allowed_hosts=["localhost", "127.0.0.1", "::1"]) as served:
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            assert assert_openai_error(send(served, "GET", "/v1/models", headers={"host": host}),
                                       400)["code"] == "invalid_host"
        for host in ("localhost", f"localhost:{served.port}", f"127.0.0.1:{served.port}", "[::1]:80"):
            assert send(served, "GET", "/v1/models", headers={"host": host}).status_code == 200


def test_cors_headers_only_for_the_origins_given() -> None:
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}
    with serving("qwen3_chat") as served:
        response = send(served, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        assert "access-control-allow-origin" not in send(served, "GET", "/v1/models",
                                                         headers={"origin": "http://app.example"}).headers
    with serving("qwen3_chat", cors_origins=["http://app.example"]) as served:
        response = send(served, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "http://app.example"


def test_refusals_are_logged_once_per_burst(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mlxchat.server"), serving("qwen3_chat") as served:
        for _ in range(40):
            send(served, "POST", "/v1/chat/completions", json.dumps(OK).encode(), {"content-type": "text/plain"})
    lines = [r for r in caplog.records if r.name == "mlxchat.server"]
    assert 1 <= len(lines) <= 2
