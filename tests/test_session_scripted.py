"""Sessions on real behaviour: qwen3_chat is a tiny Qwen3 trained to replay tests/data/chat_scripts.json
(reasoning, one and three tool calls, answers written from tool results). Every reply must equal a
stateless run, and follow-up turns must prefill only what the template changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlxchat
from mlxchat.testing import assert_matches_stateless, expected_reuse, prompt_ids

from conftest import loaded

SCRIPTS = json.loads((Path(__file__).resolve().parent / "data" / "chat_scripts.json").read_text())
SCRIPT = {s["name"]: s for s in SCRIPTS["scripts"]}
TOOLS = [SCRIPTS["tools"]["get_weather"]]
SYSTEM = "You are a test assistant."


@pytest.fixture(scope="module")
def model() -> mlxchat.GenerativeModel:
    return loaded("qwen3_chat")


def config(script: str) -> dict:
    extra = {"enable_thinking": False} if SCRIPT[script].get("enable_thinking") is False else {}
    return {"max_tokens": 200, "temperature": 0.0, **extra}


def replies(script: str) -> list[dict]:
    return [m for m in SCRIPT[script]["messages"] if m["role"] == "assistant"]


def checked(model, session, result, cfg, tools=None) -> mlxchat.ChatResult:
    assert_matches_stateless(model, session, result, cfg, tools)
    return result


def test_multi_turn_with_reasoning_separated_and_dropped_from_history(model) -> None:
    session = model.chat_session(system=SYSTEM)
    users = [m["content"] for m in SCRIPT["greeting"]["messages"] if m["role"] == "user"]
    for turn, (user, expected) in enumerate(zip(users, replies("greeting"), strict=True)):
        history = session.messages + [mlxchat.ChatMessage(role="user", content=user)]
        reuse = expected_reuse(session, prompt_ids(model, history, config("greeting")))
        events = list(session.send_stream(user, config=config("greeting")))
        result = events[-1].result
        assert (result.thinking, result.text) == (expected["reasoning_content"], expected["content"])
        kinds = [type(e).__name__ for e in events]
        assert kinds.index("ThinkingDelta") < kinds.index("TextDelta") and kinds[-1] == "Done"
        assert result.report.cached_prompt_tokens == reuse
        checked(model, session, result, config("greeting"))
        if turn:
            # the template drops the earlier reply's reasoning: reuse ends where that reply starts
            previous = session.messages[: 2 * turn]
            start = len(prompt_ids(model, previous, config("greeting")))
            assert result.report.cached_prompt_tokens == start
    assert session.messages[2].reasoning_content == "A greeting."


def test_reasoning_off_reuses_up_to_the_dropped_empty_think_block(model) -> None:
    session = model.chat_session(system=SYSTEM)
    cfg = config("no_thinking")
    first = checked(model, session, session.send("Say yes", config=cfg), cfg)
    assert (first.text, first.thinking) == ("Yes.", None)
    second = checked(model, session, session.send("Say no", config=cfg), cfg)
    assert second.text == "No."
    head = len(model.apply_chat_template([m.template_dict() for m in session.messages[:2]],
                                         add_generation_prompt=False, enable_thinking=False))
    # "<|im_start|>assistant\n" survives; the empty "<think>\n\n</think>\n\n" after it does not
    assert second.report.cached_prompt_tokens > head


def test_one_tool_call_round_trip_prefills_only_the_tool_turn(model) -> None:
    session = model.chat_session(system=SYSTEM, tools=TOOLS)
    cfg = config("one_call")
    call_turn = checked(model, session, session.send("What is the weather in Paris?", config=cfg), cfg, TOOLS)
    assert call_turn.finish_reason == "tool_calls" and call_turn.thinking == "I need the weather tool."
    [call] = call_turn.tool_calls
    assert (call.id, call.name, call.arguments, call.status) == ("call_1", "get_weather", {"city": "Paris"}, "ok")
    assert session.tool_calls[0].id == "call_1" and session.messages[-1].tool_calls[0].id == "call_1"
    held = len(session.cache.tokens)
    answer = session.send_tool_result("call_1", "sunny, 21 C", config=cfg)
    checked(model, session, answer, cfg, TOOLS)
    assert answer.text == "It is sunny in Paris, 21 C." and answer.finish_reason == "stop"
    # everything the cache held (prompt, reasoning, the call, <|im_end|>) was reused
    assert answer.report.cached_prompt_tokens == held
    tool_turn = prompt_ids(model, session.messages[:-1], cfg, TOOLS)
    assert answer.report.prefilled_tokens == len(tool_turn) - held


def test_three_calls_in_one_turn_answered_out_of_order(model) -> None:
    session = model.chat_session(system=SYSTEM, tools=TOOLS)
    cfg = config("three_calls")
    turn = checked(model, session, session.send("Weather in Paris, Rome and Oslo?", config=cfg), cfg, TOOLS)
    assert turn.finish_reason == "tool_calls"
    assert [(c.id, c.arguments["city"]) for c in turn.tool_calls] == [
        ("call_1", "Paris"), ("call_2", "Rome"), ("call_3", "Oslo")]
    results = {"call_1": "sunny", "call_2": "rain", "call_3": "snow"}
    for call_id in ("call_3", "call_1"):
        session.add_tool_result(call_id, results[call_id])
    with pytest.raises(mlxchat.SessionStateError, match="call_2"):
        session.respond(config=cfg)
    session.add_tool_result("call_2", results["call_2"])
    answer = checked(model, session, session.respond(config=cfg), cfg, TOOLS)
    assert answer.text == "Paris is sunny, Rome has rain, Oslo has snow."
    assert answer.report.cached_prompt_tokens > turn.report.prompt_tokens


def test_streamed_tool_calls_arrive_as_events_and_never_as_text(model) -> None:
    session = model.chat_session(system=SYSTEM, tools=TOOLS)
    events = list(session.send_stream("What is the weather in Paris?", config=config("one_call")))
    calls = [e for e in events if isinstance(e, mlxchat.ToolCallEvent)]
    text = "".join(e.text for e in events if isinstance(e, mlxchat.TextDelta))
    assert len(calls) == 1 and "<tool_call>" not in text and "get_weather" not in text


def test_tool_call_cut_by_max_tokens_is_kept_as_invalid(model) -> None:
    full = model.chat_session(system=SYSTEM, tools=TOOLS).send("What is the weather in Paris?",
                                                               config=config("one_call"))
    cut = full.tokens.index(model.tokenizer.token_id("<tool_call>")) + 5
    session = model.chat_session(system=SYSTEM, tools=TOOLS)
    result = session.send("What is the weather in Paris?", config={**config("one_call"), "max_tokens": cut})
    [call] = result.tool_calls
    assert call.status == "invalid" and call.raw.startswith("<tool_call>") and "unterminated" in (call.error or "")
    assert result.finish_reason == "length" and session.messages[-1].tool_calls is None
