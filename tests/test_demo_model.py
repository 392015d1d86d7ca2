"""End to end on the shipped demo model: real replies through sessions, tools and the command line.

The cities are ones the model was trained to call the tools for; how it does on unseen ones is its model
card's held-out evaluation, not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mlxchat
from mlxchat.demo import default_model_path
from mlxchat.demo.world import DEMO_TOOLS, get_time, get_weather, weather_report

GREEDY = {"temperature": 0.0, "max_tokens": 160}


@pytest.fixture(scope="module")
def demo() -> mlxchat.GenerativeModel:
    model = mlxchat.load_model(default_model_path())
    yield model
    model.close()


def test_shipped_checkpoint_is_small_and_complete():
    folder = default_model_path()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 20 * 1024 * 1024
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3"


def test_multi_turn_session_separates_reasoning(demo):
    session = demo.chat_session(default_config=GREEDY)
    first = session.send("Hello!")
    assert first.text == "Hello! How can I help you today?"
    sum_ = session.send("What is 47 + 38?")
    assert sum_.text == "47 + 38 = 85."
    assert sum_.thinking is not None and "units: 7 + 8 = 15" in sum_.thinking and "<think>" not in sum_.text
    capital = session.send("What is the capital of Japan?")
    assert "Tokyo" in capital.text
    thanks = session.send("Thanks!")
    assert thanks.text == "You're welcome!"
    assert thanks.report.cached_prompt_tokens > 0
    assert len(session.messages) == 8


def test_weather_tool_round_trip(demo):
    session = demo.chat_session(tools=list(DEMO_TOOLS), default_config=GREEDY)
    asked = session.send("What's the weather in London?")
    assert asked.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in asked.tool_calls] == [("get_weather", {"city": "London"})]
    call = asked.tool_calls[0]
    answer = session.send_tool_result(call.id, get_weather(**call.arguments))
    report = weather_report("London")
    assert not answer.tool_calls
    assert report["condition"] in answer.text and f"{report['temperature_c']}°C" in answer.text
    assert "London" in answer.text


def test_two_calls_in_one_turn_answered_with_add_tool_result(demo):
    session = demo.chat_session(tools=list(DEMO_TOOLS), default_config=GREEDY)
    asked = session.send("What time is it in Berlin and Madrid?")
    assert [(c.name, c.arguments) for c in asked.tool_calls] == [("get_time", {"city": "Berlin"}),
                                                                  ("get_time", {"city": "Madrid"})]
    results = {}
    for call in asked.tool_calls:
        results[call.arguments["city"]] = json.loads(get_time(**call.arguments))["time"]
        session.add_tool_result(call.id, get_time(**call.arguments))
    answer = session.respond()
    assert all(city in answer.text and time in answer.text for city, time in results.items())


def test_cli_generate_uses_the_demo_model():
    done = subprocess.run([sys.executable, "-m", "mlxchat.cli", "generate", "--temperature", "0",
                           "What is the capital of Italy?"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr
    assert "The capital of Italy is Rome." in done.stdout


def test_load_session_without_a_path_opens_the_demo_model():
    session = mlxchat.load_session(default_config=GREEDY)
    try:
        assert session.model.path == default_model_path()
        assert "Paris" in session.send("What is the capital of France?").text
    finally:
        session.close()
        session.model.close()


def test_a_reply_cut_by_a_stop_string_streams_and_returns_one_text_stored_without_its_end_spaces(demo):
    """ChatResult.text is the stream's text, whitespace before the stop kept (as the APIs return it); the
    stored turn differs only by the whitespace at its ends (see ChatResult.text)."""
    session = demo.chat_session(default_config={**GREEDY, "stop": ["Tokyo"]})
    stream = session.send_stream("What is the capital of Japan?")
    streamed = "".join(event.text for event in stream if isinstance(event, mlxchat.TextDelta))
    result = stream.result
    assert result is not None and result.finish_reason == "stop"
    assert streamed == result.text == "The capital of Japan is "
    assert session.messages[-1].content == result.text.strip()
