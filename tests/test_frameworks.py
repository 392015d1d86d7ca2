"""Agent frameworks as clients of ``mlxchat serve`` on the demo model, each running a function tool for real:
the OpenAI Agents SDK with its default (Responses) model, LangChain's ``ChatOpenAI(use_responses_api=True)``
and pydantic-ai's Responses model. Each ends with the demo's answer quoting the tool's result, and its
second request is served from the warm cache (the frameworks resend their whole item list). Their
structured-output paths (instructor's JSON-schema and tools modes, pydantic-ai's ``output_type``, LangChain's
``with_structured_output``) each get their object; instructor's JSON mode gets a JSON object."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from mlxchat.demo.world import get_weather as demo_weather
from mlxchat.demo.world import weather_report

from server_support import DEMO, Served, serving

QUESTION = "What's the weather in Paris?"
REPORT = weather_report("Paris")
ANSWER = f"It is {REPORT['condition']} and {REPORT['temperature_c']}°C in Paris right now."


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving("demo") as server:
        yield server


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: Name of the city.
    """
    return demo_weather(city)


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(served) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to OpenAI
    model = agents.OpenAIResponsesModel(model=DEMO, openai_client=AsyncOpenAI(base_url=f"{served.url}/v1",
                                                                               api_key="unused", max_retries=0))
    agent = agents.Agent(name="demo", model=model, tools=[agents.function_tool(get_weather)],
                         model_settings=agents.ModelSettings(temperature=0))
    result = agents.Runner.run_sync(agent, QUESTION)
    assert result.final_output == ANSWER
    assert [type(item).__name__ for item in result.new_items] == [
        "ReasoningItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    first, second = (response.usage for response in result.raw_responses)
    assert second.input_tokens_details.cached_tokens >= first.input_tokens


def test_langchain_chat_openai_on_the_responses_api(served) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=DEMO, base_url=f"{served.url}/v1", api_key="unused", use_responses_api=True, temperature=0,
                     max_retries=0)
    assert llm.invoke("What is the capital of France?").text == "The capital of France is Paris."
    with_tools = llm.bind_tools([tool(get_weather)])
    messages = [HumanMessage(QUESTION)]
    asked = with_tools.invoke(messages)
    (call,) = asked.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    messages += [asked, ToolMessage(content=get_weather("Paris"), tool_call_id=call["id"])]
    answered = with_tools.invoke(messages)
    assert answered.text == ANSWER
    assert answered.usage_metadata["input_token_details"]["cache_read"] >= asked.usage_metadata["input_tokens"]


def test_pydantic_ai_runs_an_agent_with_a_tool(served) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIResponsesModel(DEMO, provider=OpenAIProvider(base_url=f"{served.url}/v1", api_key="unused"))
    agent = Agent(model, model_settings=ModelSettings(temperature=0), tools=[get_weather])
    result = agent.run_sync(QUESTION)
    assert result.output == ANSWER
    assert result.usage.requests == 2 and result.usage.tool_calls == 1 and result.usage.cache_read_tokens > 0


class Forecast(BaseModel):
    """Structured output the frameworks ask for (bounded, so that the tiny demo model finishes it)."""

    city: Literal["Paris", "Rome", "Tokyo"]
    celsius: int = Field(ge=-30, le=50)


def instructor_client(served: Served, mode: str):
    """(instructor is not in the ``frameworks`` extra: 1.17 pins jiter<0.15, which holds openai at 3.3, older
    than pydantic-ai needs; CI runs these tests in a venv of their own, see .ci/run.)"""
    instructor = pytest.importorskip("instructor")
    import openai

    return instructor.from_openai(openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0),
                                  mode=getattr(instructor.Mode, mode))


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_its_object(served, mode: str) -> None:
    forecast = instructor_client(served, mode).chat.completions.create(
        model=DEMO, response_model=Forecast, max_tokens=200, max_retries=0,
        messages=[{"role": "user", "content": QUESTION}])
    assert isinstance(forecast, Forecast)


def test_instructor_json_mode_gets_a_json_object(served) -> None:
    """instructor's JSON mode sends ``response_format: json_object`` and its schema only as text in the
    prompt, so the reply is held to a JSON object, not to the schema (as on OpenAI): the tiny demo model
    writes an object of keys of its own until ``max_tokens``, which instructor refuses as incomplete. The
    reply it refuses is JSON all the same."""
    client = instructor_client(served, "JSON")
    from instructor.core import InstructorError

    try:
        _, completion = client.chat.completions.create_with_completion(
            model=DEMO, response_model=Forecast, max_tokens=60, max_retries=0,
            messages=[{"role": "user", "content": QUESTION}])
    except InstructorError as refused:
        completion = refused.last_completion  # type: ignore[attr-defined]
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_pydantic_ai_output_type(served) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(DEMO, provider=OpenAIProvider(base_url=f"{served.url}/v1", api_key="unused"))
    result = Agent(model, output_type=Forecast).run_sync(QUESTION, model_settings={"max_tokens": 200})
    assert isinstance(result.output, Forecast)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served, method: str) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=DEMO, base_url=f"{served.url}/v1", api_key="unused", max_tokens=200, max_retries=0)
    assert isinstance(llm.with_structured_output(Forecast, method=method).invoke(QUESTION), Forecast)
