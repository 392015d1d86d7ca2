"""Qwen3.5 sessions prefill only what changed since a snapshot: the DeltaNet state cannot be cut back, so
regenerate, a rewind to an earlier turn and the answer to a tool result each restart from the latest
snapshot at or before the common prefix, and the reply equals a stateless run.

The tool-call reply is scripted (random-weight models do not call tools): the sampler returns given tokens.
"""

from __future__ import annotations

import json

import pytest

import mlxchat
import mlxchat.generation
from mlxchat.prompt_cache import common_prefix_length
from mlxchat.testing import GREEDY, assert_matches_stateless, prompt_ids

from conftest import loaded

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
ARCHS = ["qwen3_5", "qwen3_5_moe"]


def head_length(model: mlxchat.GenerativeModel, messages: list[mlxchat.ChatMessage]) -> int:
    """Tokens of ``messages`` rendered without a generation prompt: where the next turn starts."""
    return len(model.apply_chat_template([m.template_dict() for m in messages], add_generation_prompt=False))


@pytest.mark.parametrize("name", ARCHS)
def test_rewind_restarts_from_the_snapshot_of_that_turn(name: str) -> None:
    model = loaded(name)
    session = model.chat_session(system="You are terse.")
    for question in ("Hello there", "And of Italy?", "Thanks, and Spain?"):
        session.send(question, config=GREEDY)
    first_prompt = prompt_ids(model, session.messages[:2], GREEDY)
    session.rewind(3)  # system, first question, first reply
    # The first reply re-renders without its (empty) reasoning block, so the state to return to is the one
    # snapshotted where the renders part, inside the first turn's generation prompt (probed then).
    result = session.send("Something else entirely", config=GREEDY)
    prompt = prompt_ids(model, session.messages[:-1], GREEDY)
    start = common_prefix_length(first_prompt, prompt)
    assert head_length(model, session.messages[:2]) < start < len(first_prompt)
    assert result.report.cached_prompt_tokens == start
    assert result.report.prefilled_tokens == len(prompt) - start
    assert_matches_stateless(model, session, result, GREEDY)


@pytest.mark.parametrize("name", ARCHS)
def test_tool_result_prefills_only_the_tool_turn(name: str, scripted) -> None:
    model = loaded(name)
    end = model.tokenizer.token_id("<|im_end|>")
    config = {"max_tokens": 200, "temperature": 0.0, "enable_thinking": False}
    session = model.chat_session(system="You are terse.", tools=TOOLS)

    scripted.append(model.tokenizer.encode(CALL) + [end])
    asked = session.send("Weather in Paris?", config=config)
    assert asked.finish_reason == "tool_calls"
    (call,) = asked.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    held = len(session.cache.tokens)  # the prompt, the reply and its end-of-turn token
    assert held == asked.report.prompt_tokens + len(asked.tokens) + 1
    assert held in session.cache.snapshot_positions

    session.add_tool_result(call.id, "sunny")
    scripted.append(model.tokenizer.encode("It is sunny.") + [end])
    answer = session.respond(config=config)
    assert answer.text == "It is sunny."
    assert answer.report.cached_prompt_tokens == held
    delta = model.tokenizer.encode("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert answer.report.prefilled_tokens == len(delta)

    result = session.send("And tomorrow?", config={**GREEDY, "enable_thinking": False})
    assert result.report.cached_prompt_tokens > 0
    assert_matches_stateless(model, session, result, {**GREEDY, "enable_thinking": False}, TOOLS)
