"""ChatController: queue order, stop pausing the queue, coalesced publishing, errors, approvals and input
requests surfaced as state, a model switch mid-conversation, and asyncio."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import mlxchat
from mlxchat import ChatController, ChatState, SessionStateError, ToolContext, tool
from mlxchat.demo.world import get_time, weather_report

from conftest import fixture_path, loaded


def wait_for(controller: ChatController, check, timeout: float = 60.0) -> ChatState:
    """The first state (now or published later) that passes ``check``."""
    seen = threading.Event()
    found: list[ChatState] = []

    def look(state: ChatState) -> None:
        if not found and check(state):
            found.append(state)
            seen.set()

    unsubscribe = controller.subscribe(look)
    try:
        assert seen.wait(timeout), f"no such state; the last was {controller.state!r}"
    finally:
        unsubscribe()
    return found[0]


def idle(state: ChatState) -> bool:
    return state.status == "idle" and not state.queue


def long_replies(model: mlxchat.GenerativeModel, tokens: int = 200) -> mlxchat.GenerativeModel:
    """The model, with replies that run to ``tokens`` (no end of turn)."""
    model.defaults = model.defaults.merged({"max_tokens": tokens, "temperature": 0.0,
                                            "logit_bias": {e: -100.0 for e in model.eos_ids}})
    return model


def short_replies(session: mlxchat.ChatSession, tokens: int) -> None:
    """Greedy replies of at most ``tokens`` in this session (the shared model's defaults stay as they are)."""
    state = session.export_state()
    state.default_config = state.default_config.merged({"max_tokens": tokens, "temperature": 0.0})
    session.import_state(state)


@pytest.fixture
def long_model():
    model = long_replies(mlxchat.load_model(fixture_path("qwen3"), dtype="float32"))
    yield model
    model.close()


def test_prompts_sent_while_streaming_queue_and_go_in_order(long_model) -> None:
    controller = ChatController(long_model, publish_interval=0)
    assert controller.send("first") and controller.send("second") and controller.send("third")
    assert [p.text for p in controller.state.queue][-2:] == ["second", "third"]
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 6)
    assert [m.content for m in done.messages if m.role == "user"] == ["first", "second", "third"]
    assert not controller.send("   ")
    controller.close()


def test_the_prompt_being_answered_is_in_the_messages_while_its_reply_streams(long_model) -> None:
    controller = ChatController(long_model, publish_interval=0)
    states: list[ChatState] = []
    controller.subscribe(states.append)
    controller.send("first")
    assert [(m.role, m.content) for m in controller.state.messages] == [("user", "first")]  # at once
    controller.send("second")  # queued: shown in the queue, not yet in the messages
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 4)
    for state in states:
        if state.streaming_message is not None and state.streaming_message.content:
            asked = [m.content for m in state.messages if m.role == "user"]
            answered = [m for m in state.messages if m.role == "assistant"]
            assert state.messages[-1].role == "user" and len(asked) == len(answered) + 1, state
    # the prompt shown while streaming is the one the session keeps, id and all
    first_ids = {m.id for s in states for m in s.messages if m.content == "first" and m.id is not None}
    assert first_ids == {done.messages[0].id}
    controller.close()


def test_stop_keeps_what_streamed_and_pauses_the_queue(long_model) -> None:
    long_model.defaults = long_model.defaults.merged({"max_tokens": 3000})
    controller = ChatController(long_model, publish_interval=0)
    controller.send("first")
    controller.send("second")
    wait_for(controller, lambda s: s.streaming_message is not None and len(s.streaming_message.content or "") > 5)
    controller.stop()
    stopped = wait_for(controller, lambda s: s.status == "idle")
    assert [p.text for p in stopped.queue] == ["second"]  # paused, not sent
    assert stopped.messages[-1].role == "assistant" and stopped.messages[-1].content
    assert controller.session.report.finish_reason == "cancelled"
    time.sleep(0.2)
    assert [p.text for p in controller.state.queue] == ["second"]
    short_replies(controller.session, 20)  # (the session took the model's defaults when it was made)
    assert controller.send_queued_now(stopped.queue[0].id)
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 4)
    assert [m.content for m in done.messages if m.role == "user"] == ["first", "second"]
    controller.close()


class Gate:
    """A turn gate that lets turns through only when told (``open``), or refuses them (``refuse``)."""

    def __init__(self) -> None:
        self.open, self.refuse = threading.Event(), False
        self.entered: list[list[str]] = []  # the messages each turn that ran was let through with
        self.exited = 0
        self.cancelled = threading.Event()

    def __call__(self) -> Gate:
        return self  # (one turn at a time: the same gate serves each)

    def enter(self, session: mlxchat.ChatSession, prompt, waiting) -> bool:
        if self.refuse:
            raise mlxchat.GenerationError("it could never fit")
        if not self.open.is_set():
            waiting()
            while not self.open.wait(0.01):
                if self.cancelled.is_set():
                    self.cancelled.clear()
                    return False
        self.entered.append([m.content for m in [*session.messages, *prompt]])
        return True

    def cancel(self) -> None:
        self.cancelled.set()

    def exit(self) -> None:
        self.exited += 1


def test_a_turn_waits_at_its_gate_and_a_prompt_stopped_there_goes_back_first_in_the_queue() -> None:
    """What a server holds turns back for (its memory): the state says the turn waits; a stop there puts the
    prompt back at the head of the queue, paused, with nothing in the history; a refusal is an error with the
    prompt kept; the gate is let go once after each turn that ran."""
    model = loaded("qwen3")
    gate = Gate()
    controller = ChatController(model, publish_interval=0, gate=gate)
    controller.send("first")
    controller.send("second")
    waiting = wait_for(controller, lambda s: s.waiting)
    assert waiting.status == "streaming" and waiting.messages[-1].content == "first"
    controller.stop()
    stopped = wait_for(controller, lambda s: s.status == "idle" and not s.waiting)
    assert [p.text for p in stopped.queue] == ["first", "second"] and stopped.messages == []
    assert controller.session.messages == [] and gate.exited == 0
    gate.open.set()
    assert controller.send_queued_now(stopped.queue[0].id)
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 4)
    assert [m.content for m in done.messages if m.role == "user"] == ["first", "second"]
    assert gate.entered[0] == ["first"] and gate.entered[1][-1] == "second" and gate.exited == 2
    gate.refuse = True
    controller.send("third")
    refused = wait_for(controller, lambda s: s.status == "error")
    assert refused.error == "it could never fit" and [p.text for p in refused.queue] == ["third"]
    assert len(refused.messages) == 4 and gate.exited == 2
    controller.close()


def test_deltas_are_coalesced_and_the_last_state_holds_the_whole_reply(long_model) -> None:
    controller = ChatController(long_model, publish_interval=0.05)
    states: list[ChatState] = []
    controller.subscribe(states.append)
    started = time.monotonic()
    controller.send("Tell me a long story")
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 2)
    elapsed = time.monotonic() - started
    streaming = [s for s in states if s.status == "streaming"]
    assert controller.session.report.generated_tokens == 200
    assert len(streaming) < 100 and len(streaming) <= elapsed / 0.05 + 10  # far fewer states than tokens
    assert done.messages[-1].content == controller.session.messages[-1].content and done.streaming_message is None
    controller.close()


def test_publish_interval_zero_publishes_every_delta(long_model) -> None:
    long_model.defaults = long_model.defaults.merged({"max_tokens": 30})
    controller = ChatController(long_model, publish_interval=0)
    states: list[ChatState] = []
    controller.subscribe(states.append)
    controller.send("hi")
    wait_for(controller, lambda s: idle(s) and len(s.messages) == 2)
    texts = [s.streaming_message.content for s in states if s.streaming_message is not None]
    assert len(set(texts)) > 10
    controller.close()


def test_a_failing_turn_is_an_error_state_that_pauses_the_queue_until_dismissed(monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    original = type(model.module.model).__call__
    fail = {"on": True}

    def failing(self, *args, **kwargs):
        if fail["on"]:
            raise RuntimeError("the model fell over")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model.module.model), "__call__", failing)
    controller = ChatController(model, publish_interval=0)
    controller.send("hi")
    errored = wait_for(controller, lambda s: s.status == "error")
    assert "the model fell over" in errored.error
    fail["on"] = False
    controller.dismiss_error()
    assert controller.state.status == "idle" and controller.state.error is None
    controller.send("again")
    done = wait_for(controller, lambda s: idle(s) and s.messages[-1].role == "assistant")
    assert [m.role for m in done.messages] == ["user", "user", "assistant"]  # the failed turn's question stays
    controller.close()
    model.close()


def weather_needing_approval(received: list[str]) -> mlxchat.Tool:
    """The weather tool, asking for approval; the cities it ran for go into ``received``."""

    @tool(needs_approval=True)
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        received.append(city)
        return json.dumps(weather_report(city))

    return get_weather


def test_approvals_surface_as_state_and_the_turn_goes_on_by_itself() -> None:
    received: list[str] = []
    get_weather = weather_needing_approval(received)
    controller = ChatController(mlxchat.load_model(), tools=[get_weather, get_time], publish_interval=0)
    controller.send("What's the weather in Paris?")
    waiting = wait_for(controller, lambda s: s.status == "awaiting_approval")
    (call,) = waiting.pending_approvals
    controller.respond_to_approval(call.id, approved=True, arguments={"city": "Lima"})
    done = wait_for(controller, lambda s: s.status == "idle" and s.messages[-1].role == "assistant"
                    and not s.messages[-1].tool_calls)
    assert received == ["Lima"] and "Lima" in done.messages[-1].content
    controller.close()


def test_a_reply_to_approved_calls_stopped_at_its_gate_runs_before_the_next_prompt() -> None:
    """The model owes an answer to the calls once they are decided: stopped before it began, that reply is kept
    and runs (the tool, then the answer) before the next prompt is sent."""
    received: list[str] = []
    get_weather = weather_needing_approval(received)
    gate = Gate()
    gate.open.set()
    controller = ChatController(mlxchat.load_model(), tools=[get_weather], publish_interval=0, gate=gate)

    def approved_then_stopped_at_the_gate(question: str) -> ChatState:
        controller.send(question)
        (call,) = wait_for(controller, lambda s: s.status == "awaiting_approval").pending_approvals
        gate.open.clear()
        controller.respond_to_approval(call.id, approved=True)
        wait_for(controller, lambda s: s.waiting)
        controller.stop()
        return wait_for(controller, lambda s: s.status == "idle" and not s.waiting)

    approved_then_stopped_at_the_gate("What's the weather in Paris?")
    assert received == [] and gate.exited == 1
    gate.open.set()
    controller.send("Thanks!")
    done = wait_for(controller, lambda s: idle(s) and s.messages[-1].role == "assistant"
                    and [m.content for m in s.messages if m.role == "user"][-1:] == ["Thanks!"])
    assert received == ["Paris"]
    roles = [m.role for m in done.messages]
    assert roles[:4] == ["user", "assistant", "tool", "assistant"] and roles[4] == "user"
    # an edit that takes the decided calls away takes the owed reply with them
    asked = approved_then_stopped_at_the_gate("What's the weather in Rome?").messages[-2]
    assert asked.content == "What's the weather in Rome?"
    controller.restore_checkpoint(asked.id)
    gate.open.set()
    controller.send("Never mind")
    done = wait_for(controller, lambda s: idle(s) and s.messages[-1].role == "assistant"
                    and s.messages[-2].content == "Never mind")
    assert received == ["Paris"]
    controller.close()


def test_a_conversations_queue_holds_a_bounded_number_of_prompts() -> None:
    """Every prompt queued is in each state a UI is sent: past MAX_QUEUED the next send is refused (and the queue
    takes prompts again as it drains)."""
    from mlxchat.controller import MAX_QUEUED

    gate = Gate()
    controller = ChatController(loaded("qwen3"), publish_interval=0, gate=gate)
    controller.send("first")  # its turn waits at the gate: the others queue
    for i in range(MAX_QUEUED):
        controller.send(f"queued {i}")
    with pytest.raises(SessionStateError, match="already wait"):
        controller.send("one too many")
    assert len(controller.state.queue) == MAX_QUEUED
    controller.remove_queued(controller.state.queue[-1].id)
    assert controller.send("now it fits")
    gate.cancel()
    controller.close()


def test_a_gate_that_lets_a_turn_not_through_pauses_the_queue_with_the_prompt_first() -> None:
    class Closed(Gate):
        def enter(self, session: mlxchat.ChatSession, prompt, waiting) -> bool:
            self.entered.append([m.content for m in prompt])
            return False

    gate = Closed()
    controller = ChatController(loaded("qwen3"), publish_interval=0, gate=gate)
    controller.send("first")
    stopped = wait_for(controller, lambda s: s.status == "idle" and s.queue)
    time.sleep(0.2)
    assert gate.entered == [["first"]] and [p.text for p in stopped.queue] == ["first"] and not stopped.messages
    controller.close()


def test_a_tool_asks_the_user_and_respond_to_input_resumes_it() -> None:
    @tool
    def get_weather(city: str, ctx: ToolContext) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        unit = ctx.request_input("Celsius or Fahrenheit?")
        return json.dumps({**weather_report(city), "unit": unit})

    controller = ChatController(mlxchat.load_model(), tools=[get_weather], publish_interval=0)
    controller.send("What's the weather in Rome?")
    asking = wait_for(controller, lambda s: s.status == "awaiting_input")
    (request,) = asking.input_requests
    assert request.prompt == "Celsius or Fahrenheit?" and request.name == "get_weather"
    controller.respond_to_input(request.id, "Fahrenheit")
    done = wait_for(controller, lambda s: s.status == "idle" and s.messages[-1].role == "assistant"
                    and not s.messages[-1].tool_calls)
    assert json.loads([m for m in done.messages if m.role == "tool"][0].content)["unit"] == "Fahrenheit"
    controller.close()


def test_a_question_nobody_answers_ends_at_the_input_timeout_and_the_turn_goes_on() -> None:
    """A server bounds how long a turn waits for its user (it holds its memory meanwhile): past
    ``input_timeout`` the tool sees an error, the model answers from it, and the conversation is idle again."""
    @tool
    def get_weather(city: str, ctx: ToolContext) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        return ctx.request_input("Celsius or Fahrenheit?")

    with pytest.raises(ValueError, match="input_timeout"):
        ChatController(mlxchat.load_model(), input_timeout=0)
    controller = ChatController(mlxchat.load_model(), tools=[get_weather], publish_interval=0, input_timeout=0.2)
    controller.send("What's the weather in Rome?")
    done = wait_for(controller, lambda s: s.status == "idle" and s.messages[-1].role == "assistant"
                    and not s.messages[-1].tool_calls)
    (result,) = [m for m in done.messages if m.role == "tool"]
    assert "no answer to 'Celsius or Fahrenheit?' came within 0.2 s" in result.content and not done.input_requests
    with pytest.raises(SessionStateError):
        controller.respond_to_input("late", "Celsius")
    controller.close()


def test_the_model_is_resolved_at_every_turn_and_a_switch_keeps_the_conversation() -> None:
    first, second = loaded("qwen3"), mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    current = [first]
    controller = ChatController(lambda: current[0], system="Be brief.", publish_interval=0)
    controller.send("Hello")
    before = wait_for(controller, lambda s: idle(s) and len(s.messages) == 3)
    current[0] = second
    controller.send("And again")
    after = wait_for(controller, lambda s: idle(s) and len(s.messages) == 5)
    assert [m.id for m in after.messages[:3]] == [m.id for m in before.messages]
    assert controller.session.model is second
    assert controller.session.report.cached_prompt_tokens == 0  # the new model prefilled it all once
    controller.close()
    second.close()


def test_checkpoints_versions_and_load_delegate_to_the_session() -> None:
    controller = ChatController(loaded("qwen3"), publish_interval=0)
    short_replies(controller.session, 6)
    controller.send("Hello")
    wait_for(controller, lambda s: idle(s) and len(s.messages) == 2)
    controller.regenerate()
    regenerated = wait_for(controller, lambda s: idle(s) and s.messages[-1].selected_version == 1)
    reply = regenerated.messages[-1]
    controller.select_version(reply.id, 0)
    assert controller.state.messages[-1].selected_version == 0
    controller.restore_checkpoint(regenerated.messages[0].id)
    assert [m.role for m in controller.state.messages] == ["user"]
    controller.load([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert [m.content for m in controller.state.messages] == ["a", "b"]
    controller.close()


def test_a_released_cache_is_prefilled_again_by_the_next_turn_with_the_same_reply(long_model) -> None:
    replies = []
    for release in (False, True):
        controller = ChatController(loaded("qwen3"), publish_interval=0)
        short_replies(controller.session, 6)
        controller.send("Hello")
        wait_for(controller, lambda s: idle(s) and len(s.messages) == 2)
        if release:
            assert controller.release_cache() and len(controller.session.cache) == 0
        controller.send("And again")
        replies.append(wait_for(controller, lambda s: idle(s) and len(s.messages) == 4).messages[-1].content)
        assert (controller.session.report.cached_prompt_tokens == 0) is release
        controller.close()
    assert replies[0] == replies[1]
    busy = ChatController(long_model, publish_interval=0)
    busy.send("first")
    assert not busy.release_cache()  # its turn runs
    busy.close()


def test_a_turn_waiting_at_its_gate_has_not_begun_and_its_cache_may_be_released() -> None:
    """A server counts such a cache as idle (under ``--max-cache-gb``): freed there, the turn prefills the whole
    conversation once it is let through."""
    gate = Gate()
    gate.open.set()
    controller = ChatController(loaded("qwen3"), publish_interval=0, gate=gate)
    short_replies(controller.session, 6)
    controller.send("Hello")
    wait_for(controller, lambda s: idle(s) and len(s.messages) == 2)
    gate.open.clear()
    controller.send("And again")
    wait_for(controller, lambda s: s.waiting)
    assert len(controller.session.cache) and controller.release_cache() and len(controller.session.cache) == 0
    gate.open.set()
    done = wait_for(controller, lambda s: idle(s) and len(s.messages) == 4)
    assert done.messages[-1].content and controller.session.report.cached_prompt_tokens == 0
    assert not controller.state.waiting and gate.exited == 2
    controller.close()


def test_a_turn_failed_by_a_subscriber_has_ended_when_its_error_is_published(long_model) -> None:
    """Its reply stops and what streamed is kept before the error state says no turn runs (so its cache can be
    released then, and nothing writes to it after)."""
    controller = ChatController(long_model, publish_interval=0)

    def failing(state: ChatState) -> None:
        if state.streaming_message is not None and len(state.streaming_message.content or "") > 20:
            raise RuntimeError("a subscriber's bug")

    unsubscribe = controller.subscribe(failing)
    controller.send("first")
    error = wait_for(controller, lambda s: s.status == "error")
    unsubscribe()
    assert "a subscriber's bug" in (error.error or "")
    assert [m.role for m in error.messages] == ["user", "assistant"] and len(error.messages[-1].content) > 20
    assert controller.release_cache() and len(controller.session.cache) == 0
    controller.close()


def test_a_subscriber_failing_as_a_turn_begins_leaves_the_conversation_able_to_go_on() -> None:
    """The first state the controller's thread publishes for a turn comes after the turn has begun and before
    its events are read: a subscriber failing there ended the turn in the session, not only in the controller
    (every later turn was refused as "in progress")."""
    controller = ChatController(loaded("qwen3"), publish_interval=0)
    short_replies(controller.session, 8)
    failed: list[ChatState] = []

    def failing(state: ChatState) -> None:
        if not failed and threading.current_thread() is not threading.main_thread():
            failed.append(state)
            raise RuntimeError("a subscriber's bug")

    unsubscribe = controller.subscribe(failing)
    controller.send("first")
    error = wait_for(controller, lambda s: s.status == "error")
    unsubscribe()
    assert "a subscriber's bug" in (error.error or "") and failed[0].status == "streaming"
    controller.dismiss_error()
    controller.send("second")
    done = wait_for(controller, lambda s: s.status == "error" or (idle(s) and bool(s.messages)))
    assert done.error is None and [m.role for m in done.messages] == ["user", "assistant"]
    controller.close()


def test_states_for_asyncio() -> None:
    controller = ChatController(loaded("qwen3"), publish_interval=0.01)
    short_replies(controller.session, 8)

    async def run() -> list[ChatState]:
        seen = []
        async for state in controller.states():
            seen.append(state)
            if len(seen) == 1:
                assert controller.send("Hello")
            elif idle(state) and len(state.messages) == 2:
                return seen
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 60))
    assert seen[0].messages == [] and seen[-1].messages[-1].role == "assistant"
    controller.close()
