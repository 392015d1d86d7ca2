"""Session invariants on every architecture: a cached turn equals a stateless render of the same visible
history, token for token, and the cache reports exactly the reuse it could offer."""

from __future__ import annotations

import pytest

import mlxchat

from conftest import loaded
from session_support import GREEDY, assert_matches_stateless, expected_reuse, prompt_ids

# Plugins add their fixtures here.
SESSION_FIXTURES = ["qwen3", "qwen3_moe", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma4_moe"]

QUESTIONS = ["Hello there", "What is the capital of France?", "And of Italy?", "Thanks, and Spain?",
             "Tell me a number"]


@pytest.fixture(params=SESSION_FIXTURES)
def model(request: pytest.FixtureRequest) -> mlxchat.GenerativeModel:
    return loaded(request.param)


def send_checked(model: mlxchat.GenerativeModel, session: mlxchat.ChatSession, text: str,
                 config: dict = GREEDY) -> mlxchat.ChatResult:
    history = session.messages + [mlxchat.ChatMessage(role="user", content=text)]
    expected = expected_reuse(session, prompt_ids(model, history, config))
    result = session.send(text, config=config)
    assert result.report.cached_prompt_tokens == expected
    assert_matches_stateless(model, session, result, config)
    return result


@pytest.mark.parametrize("thinking", [True, False])
def test_multi_turn_equals_stateless_and_reuses_the_previous_turns(model, thinking) -> None:
    config = {**GREEDY, "enable_thinking": thinking}
    session = model.chat_session(system="You are terse.")
    previous_reply_start = 0
    for question in QUESTIONS:
        result = send_checked(model, session, question, config)
        # at least the conversation up to where the previous reply started is served from the cache
        assert result.report.cached_prompt_tokens >= previous_reply_start
        history = session.messages[:-1]
        previous_reply_start = len(model.apply_chat_template([m.template_dict() for m in history],
                                                             add_generation_prompt=False, enable_thinking=thinking))
    assert len(session.messages) == 1 + 2 * len(QUESTIONS)


def test_regenerate_prefills_only_the_last_prompt_token(model) -> None:
    session = model.chat_session(system="You are terse.")
    send_checked(model, session, QUESTIONS[0])
    first = send_checked(model, session, QUESTIONS[1])
    result = session.regenerate(config=GREEDY)
    assert result.report.cached_prompt_tokens == first.report.prompt_tokens - 1
    assert result.report.prefilled_tokens == 1
    assert result.tokens == first.tokens  # greedy: the same reply again
    assert_matches_stateless(model, session, result, GREEDY)


def test_rewind_to_an_earlier_turn_reuses_up_to_that_turn(model) -> None:
    session = model.chat_session(system="You are terse.")
    for question in QUESTIONS[:3]:
        send_checked(model, session, question)
    session.rewind(3)  # system, first question, first reply
    result = send_checked(model, session, "Something else entirely")
    first_turn = len(prompt_ids(model, session.messages[:3], GREEDY)) - 1
    assert result.report.cached_prompt_tokens >= min(first_turn, result.report.cached_prompt_tokens + 1) - 1
    assert result.report.cached_prompt_tokens > 0


def test_tool_result_continuation_from_a_primed_transcript(model) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    session = model.chat_session(system="You are terse.", tools=tools)
    session.prime_history([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    session.add_tool_result("call_2", "rain")
    first = session.start_from_history(config=GREEDY)
    assert first.report.cached_prompt_tokens == 0
    assert_matches_stateless(model, session, first, GREEDY, tools)
    second = send_checked_tools(model, session, "And tomorrow?", tools)
    assert second.report.cached_prompt_tokens > 0


def send_checked_tools(model, session, text, tools) -> mlxchat.ChatResult:
    history = session.messages + [mlxchat.ChatMessage(role="user", content=text)]
    expected = expected_reuse(session, prompt_ids(model, history, GREEDY, tools))
    result = session.send(text, config=GREEDY)
    assert result.report.cached_prompt_tokens == expected
    assert_matches_stateless(model, session, result, GREEDY, tools)
    return result


def test_cancel_mid_stream_keeps_what_streamed_and_stays_consistent(model) -> None:
    session = model.chat_session(system="You are terse.")
    send_checked(model, session, QUESTIONS[0])
    stream = session.send_stream(QUESTIONS[1], config={**GREEDY, "max_tokens": 30})
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 3:
            break
    last = session.messages[-1]
    assert last.role == "assistant"
    assert session.report is not None and session.report.finish_reason == "cancelled"
    streamed = "".join(e.text for e in seen if isinstance(e, mlxchat.TextDelta))
    assert (last.content or "") == streamed
    send_checked(model, session, QUESTIONS[2])


def test_failure_keeps_the_user_turn_and_retry_equals_stateless(model, monkeypatch) -> None:
    session = model.chat_session(system="You are terse.")
    send_checked(model, session, QUESTIONS[0])
    decoder = model.module.model
    calls = {"n": 0}
    original = type(decoder).__call__

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(decoder), "__call__", failing)
    with pytest.raises(mlxchat.MlxchatError, match="injected failure"):
        session.send(QUESTIONS[1], config=GREEDY)
    monkeypatch.undo()
    assert session.messages[-1].role == "user" and session.messages[-1].content == QUESTIONS[1]
    result = session.respond(config=GREEDY)
    assert_matches_stateless(model, session, result, GREEDY)


def test_reset_then_send_equals_stateless(model) -> None:
    session = model.chat_session(system="You are terse.")
    send_checked(model, session, QUESTIONS[0])
    send_checked(model, session, QUESTIONS[1])
    session.reset()
    assert [m.role for m in session.messages] == ["system"] and session.report is None
    result = send_checked(model, session, QUESTIONS[2])
    assert result.report.cached_prompt_tokens > 0  # the system prompt is served from the cache


def test_prime_and_start_from_history_then_continue(model) -> None:
    session = model.chat_session(system="You are terse.")
    session.prime_history([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello. What do you need?"},
        {"role": "user", "content": "A fact"},
    ])
    result = session.start_from_history(config=GREEDY)
    assert result.report.cached_prompt_tokens == 0
    assert_matches_stateless(model, session, result, GREEDY)
    send_checked(model, session, "Another one")


def test_two_interleaved_sessions_keep_their_own_reuse(model) -> None:
    first = model.chat_session(system="You are terse.")
    second = model.chat_session(system="You are verbose and kind.")
    for question in QUESTIONS[:3]:
        a = send_checked(model, first, question)
        b = send_checked(model, second, question)
        if len(first.messages) > 3:
            assert a.report.cached_prompt_tokens > 0 and b.report.cached_prompt_tokens > 0
