"""ChatSession's API contract: lazy single-use streams, cancel, close, tool offers and answers, asyncio,
sessions taking turns on one model."""

from __future__ import annotations

import asyncio
import importlib
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlxchat
from mlxchat import SessionClosedError, SessionStateError, StreamConsumedError, tool
from mlxchat.testing import GREEDY

from conftest import fixture_path, loaded

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
]


@pytest.fixture
def model() -> mlxchat.GenerativeModel:
    return loaded("qwen3")


def test_a_stream_sends_nothing_until_iterated_and_is_iterated_once(model) -> None:
    session = model.chat_session()
    stream = session.send_stream("Hello", config=GREEDY)
    assert session.messages == []
    events = list(stream)
    assert isinstance(events[-1], mlxchat.Done)
    assert [m.role for m in session.messages] == ["user", "assistant"]
    assert stream.result is not None and stream.result.text == session.messages[-1].content
    with pytest.raises(StreamConsumedError):
        list(stream)


def test_cancel_handle_stops_at_the_next_token_and_the_loop_gets_done(model) -> None:
    session = model.chat_session()
    stream = session.send_stream("Hello", config={**GREEDY, "max_tokens": 40})
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 1:
            stream.cancel()
    done = events[-1]
    assert isinstance(done, mlxchat.Done) and done.result.finish_reason == "cancelled"
    assert done.result.report.generated_tokens < 40
    streamed = "".join(e.text for e in events if isinstance(e, mlxchat.TextDelta))
    assert session.messages[-1].content == streamed == done.result.text


def test_breaking_out_of_a_model_stream_stops_decoding(model) -> None:
    chunks = 0
    for _chunk in model.stream([1, 2, 3], {"max_tokens": 200, "temperature": 0.0}):
        chunks += 1
        if chunks == 3:
            break
    result = model.generate([1, 2, 3], {"max_tokens": 5, "temperature": 0.0})  # the worker is free again
    assert len(result.tokens) == 5


def test_a_closed_session_refuses_and_the_model_stays_open(model) -> None:
    session = model.chat_session()
    session.send("Hello", config=GREEDY)
    session.close()
    with pytest.raises(SessionClosedError):
        session.send("Again", config=GREEDY)
    with pytest.raises(SessionClosedError):
        session.respond(config=GREEDY)
    assert len(model.generate([1, 2], {"max_tokens": 2}).tokens) == 2


@pytest.fixture
def no_tools_model(tmp_path: Path) -> mlxchat.GenerativeModel:
    folder = tmp_path / "chatml"
    shutil.copytree(fixture_path("qwen3"), folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return mlxchat.load_model(folder)


def test_a_model_without_tools_refuses_an_offer_before_appending(no_tools_model) -> None:
    assert not no_tools_model.supports_tools
    with pytest.raises(ValueError, match="takes no tools"):
        no_tools_model.chat_session(tools=TOOLS)
    session = no_tools_model.chat_session(system="s")
    with pytest.raises(ValueError, match="takes no tools"):
        session.send("Weather?", tools=TOOLS)
    assert [m.role for m in session.messages] == ["system"]
    with pytest.raises(ValueError, match="reads no images"):
        session.send("Look", images=[b"\x89PNG"])
    assert [m.role for m in session.messages] == ["system"]


def test_unanswered_calls_must_be_answered_in_any_order(model) -> None:
    session = model.chat_session(tools=TOOLS)
    session.prime_history(TWO_CALLS)
    with pytest.raises(SessionStateError, match="call_1, call_2"):
        session.send("Never mind", config=GREEDY)
    with pytest.raises(SessionStateError, match="unanswered"):
        session.respond(config=GREEDY)
    with pytest.raises(SessionStateError, match="no unanswered tool call"):
        session.add_tool_result("call_9", "x")
    session.add_tool_result("call_2", {"weather": "rain"})
    with pytest.raises(SessionStateError, match="call_1"):
        session.respond(config=GREEDY)
    session.add_tool_result("call_1", "sunny")
    assert [(m.role, m.tool_call_id, m.content) for m in session.messages[-2:]] == [
        ("tool", "call_1", "sunny"), ("tool", "call_2", '{"weather": "rain"}')]
    assert session.messages[-1].name == "get_weather"
    result = session.respond(config=GREEDY)
    assert result.finish_reason in ("stop", "length")


def test_messages_dump_to_openai_dicts(model) -> None:
    session = model.chat_session(system="s", tools=TOOLS)
    session.prime_history(TWO_CALLS)
    dumped = [m.template_dict() for m in session.messages]
    assert dumped[0] == {"role": "system", "content": "s"}
    assert session.messages[0].model_dump()["id"] == session.messages[0].id  # model_dump keeps the session's
    assert dumped[2]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_decorator_builds_the_schema_from_hints_and_docstring() -> None:
    @tool
    def get_weather(city: str, days: int = 1) -> str:
        """Current weather in a city.

        Args:
            city: The city name.
            days: How many days ahead.
        """
        return f"sunny in {city}"

    assert get_weather("Oslo") == "sunny in Oslo"
    fn = get_weather.schema["function"]
    assert fn["name"] == "get_weather" and fn["description"] == "Current weather in a city."
    assert fn["parameters"]["properties"] == {
        "city": {"type": "string", "description": "The city name."},
        "days": {"type": "integer", "default": 1, "description": "How many days ahead."}}
    assert fn["parameters"]["required"] == ["city"]


def test_default_config_and_per_turn_overrides(model) -> None:
    session = model.chat_session(default_config={"max_tokens": 3, "temperature": 0.0})
    assert len(session.send("Hello").tokens) <= 3
    assert len(session.send("More", config={"max_tokens": 6}).tokens) <= 6


def test_an_unknown_turn_keyword_names_what_a_turn_takes(model) -> None:
    session = model.chat_session()
    with pytest.raises(TypeError, match=r"no keyword 'temperature'.*response_format.*config=\{"):
        session.send("Hello", temperature=0.2)  # type: ignore[call-arg]
    assert session.messages == []


def test_one_session_runs_one_turn_at_a_time(model) -> None:
    session = model.chat_session()
    stream = iter(session.send_stream("Hello", config={**GREEDY, "max_tokens": 30}))
    next(stream)
    with pytest.raises(SessionStateError, match="in progress"):
        session.send("Again", config=GREEDY)
    stream.close()
    assert session.report is not None and session.report.finish_reason == "cancelled"
    session.send("Again", config=GREEDY)


@pytest.mark.parametrize("leave", ["close", "drop"])
def test_events_closed_or_dropped_before_the_first_ends_the_turn_and_takes_it_back(model, leave: str) -> None:
    """iter() begins the turn (the prompt is in the history); a reader who leaves before reading an event ends
    it as one who left before anything was produced (the session stayed in the turn for ever)."""
    session = model.chat_session()
    session.send("Hello", config=GREEDY)
    before = session.messages
    for stream in (session.send_stream("Again", config=GREEDY), session.regenerate_stream(config=GREEDY)):
        events = iter(stream)
        assert len(session.messages) != len(before)
        if leave == "close":
            events.close()
        else:
            del events
        assert session.messages == before
    assert session.send("Again", config=GREEDY).finish_reason in ("stop", "length")


def test_a_reader_interrupted_while_its_first_reply_is_planned_takes_the_turn_back(model, monkeypatch) -> None:
    """Nothing was produced (the prompt stayed, without a reply, and the next turn sent two user turns in a row)."""
    session = model.chat_session()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "render_prompt", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.send("Hello", config=GREEDY)
    monkeypatch.undo()
    assert session.messages == []
    session.send("Again", config=GREEDY)
    assert [(m.role, m.content) for m in session.messages][:1] == [("user", "Again")]


def test_a_task_cancelled_while_its_first_reply_is_planned_takes_the_turn_back(model, monkeypatch) -> None:
    """Planning runs beside the event loop; a task cancelled there left before anything was produced, as one
    cancelled a moment later with its reply queued, whose turn was taken back (this one's prompt stayed)."""
    planning, release = threading.Event(), threading.Event()
    render = model.render_prompt

    def held(*args, **kwargs):
        planning.set()
        release.wait(60.0)
        return render(*args, **kwargs)

    async def run() -> tuple[list[mlxchat.ChatMessage], list[mlxchat.ChatMessage]]:
        session = model.chat_session()
        task = asyncio.ensure_future(session.asend("Hello", config=GREEDY))
        await asyncio.to_thread(planning.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = session.messages
        release.set()
        await session.asend("Again", config=GREEDY)
        return left, session.messages

    monkeypatch.setattr(model, "render_prompt", held)
    left, messages = asyncio.run(run())
    assert left == []
    assert [(m.role, m.content) for m in messages][:1] == [("user", "Again")] and len(messages) == 2


def test_sessions_on_one_model_take_turns(model) -> None:
    questions = ["Hello", "What now?", "And then?"]
    expected = []
    for q in questions:
        s = model.chat_session(system=q)
        expected.append([s.send(q, config=GREEDY).tokens, s.send("More", config=GREEDY).tokens])
    results: dict[int, list] = {}

    def run(i: int) -> None:
        s = model.chat_session(system=questions[i])
        results[i] = [s.send(questions[i], config=GREEDY).tokens, s.send("More", config=GREEDY).tokens]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == expected


def test_asyncio_counterparts_never_block_the_event_loop(model) -> None:
    async def main() -> tuple[int, mlxchat.ChatResult, list]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        session = model.chat_session()
        result = await session.asend("Hello", config={**GREEDY, "max_tokens": 40})
        events = [event async for event in session.astream("More", config=GREEDY)]
        stop.set()
        await task
        return ticks, result, events

    ticks, result, events = asyncio.run(main())
    assert ticks > 10
    assert result.report.generated_tokens > 0
    assert isinstance(events[-1], mlxchat.Done)


def test_load_session_loads_and_opens(tmp_path: Path) -> None:
    session = mlxchat.load_session(fixture_path("qwen3"), system="Be brief.", default_config={"max_tokens": 2})
    assert session.messages[0].content == "Be brief."
    assert len(session.send("Hi").tokens) <= 2


def test_load_session_takes_generation_settings_as_options() -> None:
    """``load_session(path, max_tokens=..., temperature=...)`` as mlx-lm users write it: generation fields are
    the session's defaults, over ``default_config``; loader options still reach the loader."""
    session = mlxchat.load_session(fixture_path("qwen3"), default_config={"max_tokens": 9, "seed": 3},
                                   max_tokens=2, temperature=0.0, dtype="float32")
    assert len(session.send("Hi").tokens) <= 2
    assert session.model.dtype == mx.float32
    with pytest.raises(TypeError, match="no_such_option"):
        mlxchat.load_session(fixture_path("qwen3"), no_such_option=1)


def test_a_turn_or_save_begun_while_another_thread_changes_the_session_is_refused(model, monkeypatch,
                                                                                   tmp_path) -> None:
    # A change checked that the session was idle, then made itself: a turn begun in between was lost (the
    # primed transcript replaced it, its tokens left in the cache), and a save read a cache as it changed.
    history_module = importlib.import_module("mlxchat.history")
    inside, release, real = threading.Event(), threading.Event(), history_module.check_tool_answers

    def held(messages):
        inside.set()
        release.wait()
        return real(messages)

    monkeypatch.setattr(history_module, "check_tool_answers", held)
    session = model.chat_session()
    priming = threading.Thread(target=session.prime_history, args=([{"role": "user", "content": "primed"}],))
    priming.start()
    inside.wait()
    try:
        with pytest.raises(SessionStateError, match="another thread is changing this session"):
            session.send("live question", config=GREEDY)
        with pytest.raises(SessionStateError, match="another thread is changing this session"):
            session.save(tmp_path / "mid-change.session")
    finally:
        release.set()
        priming.join()
    assert [m.content for m in session.messages] == ["primed"]
    assert session.respond(config=GREEDY).finish_reason
