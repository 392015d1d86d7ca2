"""Structured output through the server, with the official clients on the demo model: the openai SDK's
``chat.completions.parse`` and ``responses.parse``, streamed ``json_schema`` replies (both APIs), ``json_object``
(both APIs), a non-strict ``json_schema``, ``tool_choice`` required and named, the anthropic client with a
forced tool, and schemas the engine cannot compile, in a format or a tool, on every API (a 400 naming where
it fails)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_support import DEMO, Served, serving

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Tokyo"]
    celsius: int = Field(ge=-30, le=50)
    rain: bool


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving("demo") as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_chat_completions_parse_gives_the_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=DEMO, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                               response_format=Forecast, max_tokens=200, seed=1)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Forecast)


def test_streamed_json_schema_reply_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    stream = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Paris?"}],
                                            response_format=fmt, max_tokens=200, stream=True, seed=2)  # type: ignore[arg-type]
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_object_reply_is_an_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "JSON please"}],
                                                response_format={"type": "json_object"}, max_tokens=300, seed=3)
    text = completion.choices[0].message.content or ""
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an open object may run long; what came is JSON so far
        assert text.startswith("{")


def test_required_and_named_tool_choice_give_valid_calls(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        completion = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Hello!"}],
                                                    tools=TOOLS, tool_choice=choice, max_tokens=200)  # type: ignore[arg-type]
        calls = completion.choices[0].message.tool_calls or []
        assert completion.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]


def test_responses_parse_gives_the_object(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=DEMO, input="Weather in Tokyo?", text_format=Forecast,
                                      max_output_tokens=200)
    assert isinstance(response.output_parsed, Forecast)


def test_anthropic_forced_tool_gives_a_valid_tool_use(served: Served) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": WEATHER}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(model=DEMO, max_tokens=200, tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                         messages=[{"role": "user", "content": "Hello!"}])
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses
        for use in uses:
            jsonschema.validate(use.input, WEATHER)  # type: ignore[union-attr]


def test_a_schema_that_cannot_compile_is_a_400_naming_where(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"when": {"type": "object", "properties": {"t": {"type": "tiem"}}}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}}
    with pytest.raises(openai.BadRequestError, match=r"\$\.properties\.when\.properties\.t"):
        client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Hi"}],
                                       response_format=fmt)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "yaml"})  # type: ignore[arg-type]


BAD = {"type": "object", "properties": {"when": {"type": "object", "properties": {"t": {"type": "tiem"}}}}}
"""A schema llguidance refuses at ``$.properties.when.properties.t``."""
BAD_PATH = r"\$\.properties\.when\.properties\.t"


def test_non_strict_json_schema_reply_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    completion = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Rome?"}],
                                                response_format=fmt, max_tokens=200, seed=4)  # type: ignore[arg-type]
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), WEATHER)


def test_responses_json_object_reply_is_an_object(client: openai.OpenAI) -> None:
    response = client.responses.create(model=DEMO, input="JSON please", text={"format": {"type": "json_object"}},
                                       max_output_tokens=300)
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # an open object may run long; what came is JSON so far
        assert response.status == "incomplete" and response.output_text.startswith("{")


def test_responses_streamed_json_schema_reply_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    events = list(client.responses.create(model=DEMO, input="Tokyo?", text={"format": fmt},  # type: ignore[call-overload]
                                          max_output_tokens=200, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == text
    jsonschema.validate(json.loads(text), WEATHER)


def test_schemas_that_cannot_compile_are_400s_naming_where_on_every_api(client: openai.OpenAI, served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match=BAD_PATH):
        client.responses.create(model=DEMO, input="Hi", text={"format": {  # type: ignore[call-overload]
            "type": "json_schema", "name": "bad", "schema": BAD}})
    tools = [{"type": "function", "function": {"name": "plan", "parameters": BAD}}]
    with pytest.raises(openai.BadRequestError, match=rf"tool 'plan'.*{BAD_PATH}"):
        client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Hi"}], tools=tools,  # type: ignore[arg-type]
                                       tool_choice="required")
    with pytest.raises(openai.BadRequestError, match=rf"tool 'plan'.*{BAD_PATH}"):
        client.responses.create(model=DEMO, input="Hi", tool_choice="required",  # type: ignore[call-overload]
                                tools=[{"type": "function", "name": "plan", "parameters": BAD, "strict": True}])
    anthropic_client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=rf"tool 'plan'.*{BAD_PATH}"):
        anthropic_client.messages.create(model=DEMO, max_tokens=50, tool_choice={"type": "any"},  # type: ignore[arg-type]
                                         tools=[{"name": "plan", "input_schema": BAD}],  # type: ignore[list-item]
                                         messages=[{"role": "user", "content": "Hi"}])
