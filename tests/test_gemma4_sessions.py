"""Gemma 4 sessions prefill only what changed: the sliding-window layers cannot be cut back past their
window, so a turn restarts from a snapshot, and with the E2B-style template the snapshot at the end of the
previous reply is exactly where the next prompt diverges (tool results continue the model turn after the
``<|tool_response>`` stop token the cache already holds). A long chat keeps the sliding layers at their
window.

Replies are scripted (random-weight models neither call tools nor end turns): the sampler returns given
tokens.
"""

from __future__ import annotations

import json

import pytest

import mlxchat
import mlxchat.generation
from mlxchat.cache import SlidingWindowCache
from mlxchat.prompt_cache import common_prefix_length
from mlxchat.testing import GREEDY, assert_matches_stateless, prompt_ids

from conftest import loaded

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
ARCHS = ["gemma4", "gemma4_moe"]


def reply(model: mlxchat.GenerativeModel, text: str, stop: str = "<turn|>") -> list[int]:
    return model.tokenizer.encode(text) + [model.tokenizer.token_id(stop)]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", ARCHS)
def test_tool_result_prefills_only_the_result(name: str, thinking: bool, scripted) -> None:
    """The call's turn stays in the cache up to its <|tool_response> stop token; the result continues it."""
    model = loaded(name)
    config = {"max_tokens": 200, "temperature": 0.0, "enable_thinking": thinking}
    session = model.chat_session(system="You are terse.", tools=TOOLS)

    thought = "<|channel>thought\nI should look it up.\n<channel|>" if thinking else ""
    scripted.append(reply(model, thought + CALL, stop="<|tool_response>"))
    asked = session.send("Weather in Paris?", config=config)
    assert asked.finish_reason == "tool_calls"
    assert asked.thinking == ("I should look it up." if thinking else None)
    (call,) = asked.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    held = len(session.cache.tokens)  # the prompt, the call and the <|tool_response> that stopped it
    assert held == asked.report.prompt_tokens + len(asked.tokens) + 1
    assert held in session.cache.snapshot_positions

    session.add_tool_result(call.id, "sunny")
    # With thinking on, the template opens the thought channel for the answer.
    scripted.append(reply(model, ("It is warm.\n<channel|>" if thinking else "") + "It is sunny."))
    answer = session.respond(config=config)
    assert answer.text == "It is sunny." and answer.thinking == ("It is warm." if thinking else None)
    if name == "gemma4_moe" and not thinking:
        # The 31B-style template closes an empty thought in the generation prompt when thinking is off but
        # does not render it back into the turn: the turn is prefilled again from where the two renders
        # part (inside that generation prompt, where the cache took a snapshot for this).
        asked_prompt = prompt_ids(model, session.messages[:2], config, TOOLS)
        answer_prompt = prompt_ids(model, session.messages[:-1], config, TOOLS)
        assert answer.report.cached_prompt_tokens == common_prefix_length(asked_prompt, answer_prompt)
    else:
        assert answer.report.cached_prompt_tokens == held
        delta = 'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
        delta += "<|channel>thought\n" if thinking else ""
        assert answer.report.prefilled_tokens == len(model.tokenizer.encode(delta))

    config = {**GREEDY, "enable_thinking": thinking}
    result = session.send("And tomorrow?", config=config)
    if thinking:
        # Once a user turn follows, the template drops the model turn's thoughts: the prompt diverges right
        # after that turn's generation prompt, where the cache took a snapshot for this (the next render
        # was probed when that turn started).
        assert result.report.cached_prompt_tokens == asked.report.prompt_tokens
    else:
        assert result.report.cached_prompt_tokens > held
    assert_matches_stateless(model, session, result, config, TOOLS)


def new_turn(model: mlxchat.GenerativeModel, question: str) -> int:
    """Tokens a turn adds after a reply that ended with <turn|> (E2B-style template, thinking off)."""
    return len(model.tokenizer.encode(f"\n<|turn>user\n{question}<turn|>\n<|turn>model\n"))


def test_each_turn_prefills_only_itself_and_rewind_restarts_at_that_turn(scripted) -> None:
    model = loaded("gemma4")  # the E2B-style template re-renders a finished reply exactly as it was sampled
    session = model.chat_session(system="You are terse.")
    questions = ["Hello there", "And of Italy?", "Thanks, and Spain?"]
    ends = []
    for i, question in enumerate(questions):
        scripted.append(reply(model, f"Answer number {i}."))
        result = session.send(question, config=GREEDY)
        if i:
            assert result.report.cached_prompt_tokens == ends[-1]
            assert result.report.prefilled_tokens == new_turn(model, question)
        ends.append(len(session.cache.tokens))
    session.rewind(3)  # system, first question, first reply
    result = session.send("Something else entirely", config=GREEDY)
    assert result.report.cached_prompt_tokens == ends[0]
    assert result.report.prefilled_tokens == new_turn(model, "Something else entirely")
    assert len(prompt_ids(model, session.messages[:-1], GREEDY)) == result.report.prompt_tokens


def test_a_long_chat_keeps_the_sliding_layers_at_their_window(scripted) -> None:
    model = loaded("gemma4")
    session = model.chat_session(system="You are terse.")
    words = "the weather in tokyo is sunny and the capital of france is paris".split()
    turn = 0
    while len(session.cache.tokens) < 2_000:
        question = " ".join(words[(turn + i) % len(words)] for i in range(60))
        scripted.append(reply(model, f"Noted {turn}."))
        result = session.send(question, config=GREEDY)
        if turn:
            assert result.report.prefilled_tokens == new_turn(model, question)
        turn += 1
    sliding = [c for c in session.cache.layers if isinstance(c, SlidingWindowCache)]
    assert sliding and all(c.offset == len(session.cache.tokens) for c in sliding)
    assert all(c.nbytes == c.window * 2 * 1 * 16 * 4 for c in sliding)  # K and V, 1 head of 16 float32s
