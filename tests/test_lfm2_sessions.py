"""A tool round trip on LFM2 sessions costs only the delta: after a reply that calls a tool, the answer to
the tool result is prefilled from the snapshot at the end of that reply (the conv state cannot be cut
back), both with a template that renders ``tool_calls`` (lfm2.5) and with one that drops them (lfm2, where
the call text stays in the content); the conversation then continues exactly like a stateless run.

The tool-call replies are scripted (random-weight models do not call tools): the sampler returns given
tokens."""

from __future__ import annotations

import json

import pytest

from mlxchat.testing import GREEDY, assert_matches_stateless

from conftest import loaded

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = "<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>"


@pytest.mark.parametrize(("name", "renders_calls"), [("lfm2", True), ("lfm2_moe", False)])
def test_tool_round_trip_prefills_only_the_tool_turn(name: str, renders_calls: bool, scripted) -> None:
    model = loaded(name)
    assert model.renders_tool_calls == renders_calls
    end = model.tokenizer.token_id("<|im_end|>")
    config = {"max_tokens": 40, "temperature": 0.0}
    session = model.chat_session(system="You are terse.", tools=TOOLS)

    scripted.append(model.tokenizer.encode(CALL) + [end])
    asked = session.send("Weather in Paris?", config=config)
    assert asked.finish_reason == "tool_calls"
    (call,) = asked.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert session.messages[-1].content == ("" if renders_calls else CALL)
    held = len(session.cache.tokens)  # the prompt, the reply and its end-of-turn token
    assert held == asked.report.prompt_tokens + len(asked.tokens) + 1 and held in session.cache.snapshot_positions

    session.add_tool_result(call.id, "sunny")
    scripted.append(model.tokenizer.encode("It is sunny.") + [end])
    answer = session.respond(config=config)
    assert answer.text == "It is sunny."
    assert answer.report.cached_prompt_tokens == held
    tool_turn = "<|tool_response_start|>sunny<|tool_response_end|>" if not renders_calls else "sunny"
    delta = model.tokenizer.encode(f"\n<|im_start|>tool\n{tool_turn}<|im_end|>\n<|im_start|>assistant\n")
    assert answer.report.prefilled_tokens == len(delta)

    result = session.send("And tomorrow?", config=GREEDY)  # real decoding from the restored state
    assert result.report.cached_prompt_tokens > held
    assert_matches_stateless(model, session, result, GREEDY, TOOLS)
