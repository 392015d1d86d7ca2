"""The OpenAI-compatible API, driven by the official ``openai`` client against a real uvicorn server:
completions with reasoning and tool calls, streaming, and prompts served from the cache across requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from server_support import serving as served  # noqa: E402

SCRIPTS = json.loads((Path(__file__).resolve().parent / "data" / "chat_scripts.json").read_text())
TOOLS = [SCRIPTS["tools"]["get_weather"]]
SYSTEM = {"role": "system", "content": "You are a test assistant."}


@contextmanager
def serving(fixture: str) -> Iterator[openai.OpenAI]:
    """A uvicorn server of the fixture model on a free port, and a client of it."""
    with served(fixture) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with serving("qwen3_chat") as c:
        yield c


def test_lists_the_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_conversation_reuses_the_cache_across_requests(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0)
    message = first.choices[0].message
    assert message.content == "Hi! How can I help?" and first.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "A greeting."
    messages += [{"role": "assistant", "content": message.content},
                 {"role": "user", "content": "What is 2 plus 3?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0)
    assert second.choices[0].message.content == "5."
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1 and second.usage.prompt_tokens > cached


def test_tool_calls_and_their_results(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris, Rome and Oslo?"}]
    asked = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                           temperature=0)
    assert asked.choices[0].finish_reason == "tool_calls"
    calls = asked.choices[0].message.tool_calls
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {"city": "Rome"}),
        ("call_3", "get_weather", {"city": "Oslo"})]
    messages.append(asked.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, ["sunny", "rain", "snow"],
                                                                                          strict=True)]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                            temperature=0)
    assert answer.choices[0].message.content == "Paris is sunny, Rome has rain, Oslo has snow."
    assert answer.usage.prompt_tokens_details.cached_tokens > asked.usage.prompt_tokens


def test_streaming_sends_reasoning_text_and_calls_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        max_tokens=200, temperature=0, stream=True, stream_options={"include_usage": True})
    reasoning, text, calls, finish, usage = "", "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert reasoning == "I need the weather tool." and text == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens > 0


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="respond"):
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "hi"}])


def test_messages_the_template_rejects_are_a_bad_request() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [SYSTEM, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "{}"}]
    with serving("qwen3_5") as client:  # Qwen3.5's template raises when no user message asked anything
        with pytest.raises(openai.BadRequestError, match="No user query") as raised:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        assert raised.value.body["type"] == "invalid_request_error"
        ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3)
        assert ok.choices[0].finish_reason == "length"  # the failed request returned its cache to the pool
