"""Agent frameworks as clients of ``mlxchat serve`` on the demo model, each running a function tool for real:
the OpenAI Agents SDK with its default (Responses) model, LangChain's ``ChatOpenAI(use_responses_api=True)``
and pydantic-ai's Responses model. Each ends with the demo's answer quoting the tool's result, and its
second request is served from the warm cache (the frameworks resend their whole item list)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
