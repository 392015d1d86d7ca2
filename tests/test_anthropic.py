"""Anthropic's Messages API with the official ``anthropic`` client on the demo model: replies with thinking
and text blocks, a follow-up served from the cache (``cache_read_input_tokens``), the stream's events as
Anthropic sends them (each validated by the client's own models), tool use round trip, tool_choice, stop
sequences, and errors in Anthropic's shape (``x-api-key`` authentication included)."""

from __future__ import annotations

import json
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from mlxchat.demo.world import DEMO_TOOLS  # noqa: E402

from server_support import DEMO, Served, serving  # noqa: E402

TOOLS = [{"name": t.name, "description": t.description, "input_schema": t.schema["function"]["parameters"]}
         for t in DEMO_TOOLS]
GREEDY: dict[str, Any] = {"model": DEMO, "max_tokens": 200, "extra_body": {"temperature": 0}}
"""Greedy through the client (whose create() no longer takes temperature: it goes in the body)."""
RAW: dict[str, Any] = {"model": DEMO, "max_tokens": 200, "temperature": 0}
ASKED = [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}]}]
"""A conversation whose last reply called a tool."""
EVENT = TypeAdapter(RawMessageStreamEvent)


def client(served: Served, key: str = "unused") -> Any:
    return anthropic.Anthropic(base_url=served.url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def served():
    with serving("demo") as server:
        yield server


def test_a_reply_has_thinking_and_text_blocks_and_a_follow_up_reads_the_cache(served) -> None:
    api = client(served)
    question = {"role": "user", "content": "What is 12 plus 30?"}
    first = api.messages.create(messages=[question], **GREEDY)
    Message.model_validate(first.model_dump())
    assert [block.type for block in first.content] == ["thinking", "text"]
    assert first.content[1].text == "12 + 30 = 42." and first.stop_reason == "end_turn"
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 0
    history = [question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": "What is the capital of France?"}]
    second = api.messages.create(messages=history, **GREEDY)
    assert second.content[-1].text == "The capital of France is Paris."
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens


def test_thinking_disabled_leaves_the_reply_without_a_thinking_block(served) -> None:
    reply = client(served).messages.create(messages=[{"role": "user", "content": "Hello!"}],
                                           thinking={"type": "disabled"}, **GREEDY)
    assert [block.type for block in reply.content] == ["text"]


def stream_events(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{served.url}/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        lines = iter(response.iter_lines())
        for line in lines:
            if line.startswith("event: "):
                data = json.loads(next(lines).removeprefix("data: "))
                assert data["type"] == line.removeprefix("event: ")
                if data != {"type": "ping"}:  # the client's models leave pings out
                    EVENT.validate_python(data)
                events.append(data)
    return events


def test_the_stream_sends_anthropics_events(served) -> None:
    events = stream_events(served, {**RAW, "messages": [{"role": "user", "content": "What's the weather in Rome?"}],
                                    "tools": TOOLS})
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events
             if not (e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")]
    assert kinds == [("message_start", None), ("ping", None),
                     ("content_block_start", "thinking"), ("content_block_delta", "signature_delta"),
                     ("content_block_stop", None),
                     ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    partial = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Rome"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] > 0


def test_the_clients_stream_helper_gives_the_reply_not_streamed(served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "What is the capital of Kenya?"}]
    with api.messages.stream(messages=messages, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    alone = api.messages.create(messages=messages, **GREEDY)
    assert text == final.content[-1].text == alone.content[-1].text
    assert final.usage.output_tokens == alone.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        alone.usage.input_tokens + alone.usage.cache_read_input_tokens


def test_tool_use_round_trip(served) -> None:
    api = client(served)
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    asked = api.messages.create(messages=messages, tools=TOOLS, **GREEDY)
    assert asked.stop_reason == "tool_use"
    (use,) = [block for block in asked.content if block.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    messages += [{"role": "assistant", "content": [block.model_dump() for block in asked.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny, 21 C"}]}]
    answered = api.messages.create(messages=messages, tools=TOOLS, **GREEDY)
    assert answered.stop_reason == "end_turn" and "21" in answered.content[-1].text
    assert answered.usage.cache_read_input_tokens > asked.usage.cache_read_input_tokens


@pytest.mark.parametrize(("choice", "name"), [({"type": "any"}, "get_weather"),
                                              ({"type": "tool", "name": "get_time"}, "get_time")])
def test_tool_choice_makes_the_reply_use_a_tool(served, choice, name) -> None:
    reply = client(served).messages.create(messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                           tools=TOOLS, tool_choice=choice, **GREEDY)
    assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [(name, {"city": "Paris"})]


def test_a_stop_sequence_is_named(served) -> None:
    reply = client(served).messages.create(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                           stop_sequences=["Paris"], **GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "Paris"
    assert reply.content[-1].text == "The capital of France is "


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"model": DEMO, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
    ({**RAW, "messages": []}, 400, "invalid_request_error"),
    ({**RAW, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({**RAW, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, 400, "invalid_request_error"),
    ({**RAW, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                             "name": "web_search"}]},
     400, "invalid_request_error"),
    ({**RAW, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, 400,
     "invalid_request_error"),
    ({**RAW, "model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error"),
    # each tool_use answered by a tool_result in the next message, and by no other (as Anthropic's API requires)
    ({**RAW, "messages": [*ASKED, {"role": "user", "content": "never mind"}]}, 400, "invalid_request_error"),
    ({**RAW, "messages": [*ASKED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t2", "content": "x"}]}]}, 400, "invalid_request_error"),
    ({**RAW, "messages": [*ASKED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}, *ASKED[1:], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}, 400, "invalid_request_error"),
])
def test_errors_come_in_anthropics_shape(served, body, status, kind) -> None:
    response = httpx.post(f"{served.url}/v1/messages", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]


def test_the_client_raises_its_own_errors_and_x_api_key_authenticates() -> None:
    with serving("demo", api_key="s3cret") as served:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            client(served, "wrong").messages.create(messages=[{"role": "user", "content": "hi"}], **GREEDY)
        assert raised.value.body["error"]["type"] == "authentication_error"
        reply = client(served, "s3cret").messages.create(messages=[{"role": "user", "content": "Hello!"}], **GREEDY)
        assert reply.content
        with pytest.raises(anthropic.NotFoundError):
            client(served, "s3cret").messages.create(messages=[{"role": "user", "content": "hi"}],
                                                     **{**GREEDY, "model": "claude"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_slot(stream) -> None:
    import socket
    import time

    import mlxchat

    from conftest import fixture_path

    with mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32") as model:
        model.defaults = model.defaults.merged({"logit_bias": {e: -100.0 for e in model.eos_ids}})  # never ends
        with serving("qwen3_chat", model=model, caches=1) as served:
            data = json.dumps({"model": "tiny", "max_tokens": 3500, "stream": stream,
                               "messages": [{"role": "user", "content": "Hello!"}]}).encode()
            with socket.create_connection(("127.0.0.1", served.port)) as sock:
                sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                time.sleep(0.4)
            left = time.monotonic()
            while served.state.queued and time.monotonic() - left < 30:
                time.sleep(0.01)
            assert served.state.queued == 0 and time.monotonic() - left < 5
            cache, = served.state.pool.caches
            assert len(cache) < 1500  # the reply stopped well short of its 3500 tokens
