"""What an application puts around a turn, on a real model (the demo's weather and time tools) and the
tiny fixtures: message ids and times, automatic tool calls with approval (approved, denied, edited), tools
that fail or ask the user, the round limit, async tools, the bugs a new user found (an async stream left
by ``break``, a malformed call's text), and a session's state moved to another session. Checkpoints and
reply versions on every architecture are in the session contract (mlxchat.testing)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

import pytest
from pydantic import ValidationError

import mlxchat
from mlxchat import SessionStateError, ToolContext, ToolResultEvent, tool
from mlxchat.demo.world import DEMO_TOOLS, get_time, get_weather, weather_report
from mlxchat.testing import GREEDY, assert_matches_stateless

from conftest import loaded

DEMO = {"temperature": 0.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def demo() -> mlxchat.GenerativeModel:
    return mlxchat.load_model()


def counter(prefix: str):
    numbers = itertools.count(1)
    return lambda: f"{prefix}{next(numbers)}"


# -- ids and times ---------------------------------------------------------------------------------------

def test_every_message_gets_an_injected_id_and_time_that_copies_keep() -> None:
    session = loaded("qwen3").chat_session(system="s", new_id=counter("m"), clock=lambda: 1700.0)
    session.send("Hello", config=GREEDY)
    messages = session.messages
    assert [(m.id, m.created_at) for m in messages] == [("m1", 1700.0), ("m2", 1700.0), ("m3", 1700.0)]
    assert [m.id for m in session.messages] == ["m1", "m2", "m3"]  # stable across copies
    assert messages[1].model_dump()["id"] == "m2"
    primed = loaded("qwen3").chat_session(new_id=counter("p"))
    primed.prime_history([{"role": "user", "content": "a", "id": "mine"}, {"role": "assistant", "content": "b"}])
    assert [m.id for m in primed.messages] == ["mine", "p1"]
    with pytest.raises(mlxchat.InvalidInputError, match="repeats"):
        loaded("qwen3").chat_session().prime_history([{"role": "user", "content": "a", "id": "x"},
                                                       {"role": "user", "content": "b", "id": "x"}])


def test_turns_and_pending_tool_calls(demo) -> None:
    session = demo.chat_session(tools=DEMO_TOOLS)
    assert session.turns == 0 and session.pending_tool_calls == [] and not session.has_images
    asked = session.send("What's the weather in London?", config=DEMO)
    assert asked.finish_reason == "tool_calls" and session.turns == 1
    assert [c.id for c in session.pending_tool_calls] == [c.id for c in asked.tool_calls]
    with pytest.raises(SessionStateError, match="unanswered"):
        session.send("hi")


# -- automatic tool calls --------------------------------------------------------------------------------

def test_auto_tools_answer_one_call_and_the_model_answers_from_the_result(demo) -> None:
    session = demo.chat_session(tools=DEMO_TOOLS, auto_tools=True)
    events = list(session.send_stream("What's the weather in London?", config=DEMO))
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("ToolCallEvent") < kinds.index("ToolResultEvent") < kinds.index("TextDelta")
    assert kinds[-1] == "Done" and kinds.count("Done") == 1
    (result_event,) = [e for e in events if isinstance(e, ToolResultEvent)]
    report = weather_report("London")
    assert json.loads(result_event.content) == report
    assert [m.role for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    answer = events[-1].result
    assert answer.finish_reason == "stop" and str(report["temperature_c"]) in answer.text and "London" in answer.text


def test_auto_tools_answer_two_calls_in_order(demo) -> None:
    session = demo.chat_session(tools=DEMO_TOOLS, auto_tools=True)
    result = session.send("What's the weather in Paris and Rome?", config=DEMO)
    tools = [m for m in session.messages if m.role == "tool"]
    assert [json.loads(m.content)["city"] for m in tools] == ["Paris", "Rome"]
    assert "Paris" in result.text and "Rome" in result.text


def test_auto_tools_per_call_and_the_round_limit(demo) -> None:
    session = demo.chat_session(tools=DEMO_TOOLS)
    stopped = session.send("What's the weather in Oslo?", config=DEMO, auto_tools=True, max_tool_rounds=0)
    assert stopped.finish_reason == "max_tool_rounds" and session.pending_tool_calls
    for call in session.pending_tool_calls:
        session.add_tool_result(call.id, get_weather(**call.arguments))
    assert session.respond(config=DEMO).finish_reason == "stop"


def test_a_tool_that_raises_becomes_an_error_result_the_model_sees(demo) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        raise ConnectionError(f"weather service down for {city}")

    session = demo.chat_session(tools=[get_weather, get_time], auto_tools=True)
    result = session.send("What's the weather in Paris?", config=DEMO)
    (answer,) = [m for m in session.messages if m.role == "tool"]
    assert answer.content == "Error: ConnectionError: weather service down for Paris"
    assert result.finish_reason in ("stop", "length")


def approval_tools(received: list[dict]) -> list:
    @tool(needs_approval=True)
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        received.append({"city": city})
        return json.dumps(weather_report(city))

    return [get_weather, get_time]


def test_an_approval_approved_runs_the_tool_and_continues(demo) -> None:
    received: list[dict] = []
    session = demo.chat_session(tools=approval_tools(received), auto_tools=True)
    paused = session.send("What's the weather in Paris?", config=DEMO)
    assert paused.finish_reason == "approval_required" and received == []
    (call,) = session.pending_approvals
    with pytest.raises(SessionStateError):
        session.send("never mind")
    session.respond_to_approval(call.id, approved=True)
    assert session.pending_approvals == []
    answer = session.respond(config=DEMO)
    assert received == [{"city": "Paris"}] and answer.finish_reason == "stop" and "Paris" in answer.text


def test_an_approval_denied_with_a_reason_is_the_result_the_model_sees(demo) -> None:
    received: list[dict] = []
    session = demo.chat_session(tools=approval_tools(received), auto_tools=True)
    session.send("What's the weather in Paris?", config=DEMO)
    (call,) = session.pending_approvals
    session.respond_to_approval(call.id, approved=False, reason="The user does not share locations.")
    events = list(session.respond_stream(config=DEMO))
    assert received == []
    (denied,) = [e for e in events if isinstance(e, ToolResultEvent)]
    assert denied.content == "The user does not share locations."
    assert [m.content for m in session.messages if m.role == "tool"] == ["The user does not share locations."]


def test_an_approval_with_edited_arguments_is_what_history_records_and_the_tool_receives(demo) -> None:
    received: list[dict] = []
    session = demo.chat_session(tools=approval_tools(received), auto_tools=True)
    session.send("What's the weather in Paris?", config=DEMO)
    (call,) = session.pending_approvals
    session.respond_to_approval(call.id, approved=True, arguments={"city": "Oslo"})
    reply = next(m for m in session.messages if m.role == "assistant")
    assert reply.tool_calls[0].arguments == {"city": "Oslo"}
    assert reply.versions[0].tool_calls[0].arguments == {"city": "Oslo"}
    answer = session.respond(config=DEMO)
    assert received == [{"city": "Oslo"}] and "Oslo" in answer.text
    with pytest.raises(SessionStateError, match="waits for approval"):
        session.respond_to_approval(call.id, approved=True)


def test_a_tool_can_ask_the_user_through_its_context(demo) -> None:
    asked: list[str] = []

    @tool
    def get_weather(city: str, ctx: ToolContext) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        unit = ctx.request_input(f"Celsius or Fahrenheit for {city}?")
        return json.dumps({**weather_report(city), "unit": unit})

    assert "ctx" not in json.dumps(get_weather.schema)

    def answer(prompt: str, call: mlxchat.ToolCall) -> str:
        asked.append(f"{call.name}: {prompt}")
        return "Celsius"

    session = demo.chat_session(tools=[get_weather], auto_tools=True, input_handler=answer)
    session.send("What's the weather in Paris?", config=DEMO)
    assert asked == ["get_weather: Celsius or Fahrenheit for Paris?"]
    assert json.loads([m for m in session.messages if m.role == "tool"][0].content)["unit"] == "Celsius"
    unasked = demo.chat_session(tools=[get_weather], auto_tools=True)
    unasked.send("What's the weather in Paris?", config=DEMO)
    assert "no one can answer" in [m for m in unasked.messages if m.role == "tool"][0].content


def test_async_tools_are_awaited_in_astream(demo) -> None:
    @tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        await asyncio.sleep(0)
        return json.dumps(weather_report(city))

    async def run() -> list:
        session = demo.chat_session(tools=[get_weather], auto_tools=True)
        return [event async for event in session.astream("What's the weather in Rome?", config=DEMO)]

    events = asyncio.run(run())
    (result,) = [e for e in events if isinstance(e, ToolResultEvent)]
    assert json.loads(result.content) == weather_report("Rome")
    assert "Rome" in events[-1].result.text
    sync = demo.chat_session(tools=[get_weather], auto_tools=True)  # outside a loop too
    assert "Rome" in sync.send("What's the weather in Rome?", config=DEMO).text


# -- the bugs a new user found ---------------------------------------------------------------------------

def test_breaking_out_of_an_async_stream_ends_the_turn_before_the_next_one() -> None:
    model = loaded("qwen3")

    async def run() -> tuple[mlxchat.ChatResult, list[mlxchat.ChatMessage]]:
        session = model.chat_session()
        async for _ in session.astream("Hello", config={**GREEDY, "max_tokens": 30}):
            break
        return await session.asend("Again", config=GREEDY), session.messages

    result, messages = asyncio.run(run())
    assert result.finish_reason in ("stop", "length")
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1].versions is not None and messages[1].versions[0].report.finish_reason == "cancelled"


@pytest.mark.parametrize("leave", ["aclose", "break"])
def test_a_reader_leaving_mid_stream_never_waits_on_the_event_loop_for_a_busy_worker(leave: str) -> None:
    """The worker is held busy on an event the test controls: while it is, the loop must go on running
    (the stream's end waits for the worker off the loop), a change to the session says what to await (it
    said "finish or cancel it first" to a reader who had), and the turn ends, cancelled, once it is free."""
    model = loaded("qwen3")
    entered, release = threading.Event(), threading.Event()
    valve = threading.Timer(60.0, release.set)  # only a loop blocked by the stop lets this fire
    valve.start()

    def busy() -> None:
        entered.set()
        release.wait()

    async def run() -> tuple[bool, list[mlxchat.ChatMessage], mlxchat.ChatResult]:
        session = model.chat_session()
        stream = session.astream("Hello", config={**GREEDY, "max_tokens": 60})
        events = aiter(stream)
        await anext(events)
        held = model.worker.submit(busy)
        await asyncio.to_thread(entered.wait)
        if leave == "aclose":
            closing = asyncio.ensure_future(events.aclose())
        else:
            del events  # what ``break`` does: the iterator is dropped
            closing = asyncio.ensure_future(stream.aended())
        for _ in range(5):
            await asyncio.sleep(0)
        loop_ran_while_busy = not release.is_set() and not closing.done()
        with pytest.raises(SessionStateError, match=r"still stopping.*aended\(\)"):
            session.rewind(0)
        release.set()
        await closing
        await asyncio.wrap_future(held)
        messages = session.messages
        return loop_ran_while_busy, messages, await session.asend("Again", config=GREEDY)

    try:
        loop_ran_while_busy, messages, again = asyncio.run(run())
    finally:
        valve.cancel()
        release.set()
    assert loop_ran_while_busy
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].versions is not None and messages[1].versions[0].report.finish_reason == "cancelled"
    assert again.finish_reason in ("stop", "length")


def test_a_malformed_call_stays_in_the_conversation_as_the_text_the_model_wrote(scripted) -> None:
    model = loaded("qwen3_chat")
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    scripted.append(model.tokenizer.encode("Let me check. " + raw) + [model.tokenizer.token_id("<|im_end|>")])
    session = model.chat_session(tools=[get_weather])
    result = session.send("Weather in Paris?", config={"max_tokens": 80, "temperature": 0.0})
    assert [c.status for c in result.tool_calls] == ["invalid"] and result.tool_calls[0].raw == raw
    assert raw in session.messages[-1].content and session.messages[-1].tool_calls is None
    follow = session.send("Try again", config=GREEDY)
    assert_matches_stateless(model, session, follow, GREEDY, [get_weather.schema])


def approved_for_lima(demo, tools) -> mlxchat.ChatSession:
    """A session whose call to the weather tool was approved, its city edited to Lima, and not run yet."""
    session = demo.chat_session(tools=tools, auto_tools=True, max_tool_rounds=3)
    session.send("What's the weather in Paris?", config=DEMO)
    (call,) = session.pending_approvals
    session.respond_to_approval(call.id, approved=True, arguments={"city": "Lima"})
    return session


def test_a_session_waiting_for_an_approval_saves_and_resumes_with_its_decisions(demo, tmp_path) -> None:
    received: list[dict] = []
    tools = approval_tools(received)
    session = approved_for_lima(demo, tools)
    session.save(tmp_path / "waiting.session")
    resumed = mlxchat.ChatSession.load(demo, tmp_path / "waiting.session", tools=tools)
    assert [m.model_dump() for m in resumed.messages] == [m.model_dump() for m in session.messages]
    assert resumed.pending_approvals == []
    answer = resumed.respond(config=DEMO)
    assert received == [{"city": "Lima"}] and "Lima" in answer.text


def test_a_state_imported_into_another_session_goes_on_as_the_original_would(demo) -> None:
    received: list[dict] = []
    tools = approval_tools(received)
    session = approved_for_lima(demo, tools)
    state = session.export_state()
    other = demo.chat_session(tools=tools)  # settings, transcript and decisions all come with the state
    other.import_state(state)
    state.messages.clear()  # the session holds its own copy
    assert other.export_state() == session.export_state()
    answer = other.respond(config=DEMO)
    assert received == [{"city": "Lima"}] and "Lima" in answer.text
    assert session.respond(config=DEMO).text == answer.text


def test_a_state_is_checked_when_made_and_moves_only_between_turns() -> None:
    session = loaded("qwen3").chat_session(system="Be terse.")
    session.send("Hello", config=GREEDY)
    saved = session.export_state().model_dump()
    with pytest.raises(ValidationError, match="hidden 3 is more than the 2 messages"):
        mlxchat.SessionState.model_validate({**saved, "hidden": 3})
    saved["messages"][2]["id"] = saved["messages"][1]["id"]
    with pytest.raises(ValidationError, match="repeats a message id"):
        mlxchat.SessionState.model_validate(saved)
    state = session.export_state()
    for _ in session.send_stream("Again", config=GREEDY):
        for move in (session.export_state, lambda: session.import_state(state)):
            with pytest.raises(SessionStateError, match="in progress"):
                move()
        break
