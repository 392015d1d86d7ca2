"""Reading replies: reasoning apart from text, Qwen3 JSON tool calls out of the text, incrementally and in
one piece alike; malformed or cut calls are kept as invalid with their raw text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxchat.reply import Channel, ReasoningSplitter, ReplyParser, TextDelta, ThinkingDelta, ToolCallEvent
from mlxchat.tools.parsing import CallBlock, JsonTagsParser, ParsedCall, TrailingCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]

# Real Qwen3 outputs (thinking on): reasoning, text, and calls as the template re-renders them.
REAL_OUTPUTS = [
    '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>',
    '<think>\nTwo cities.\n</think>\n\nLet me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    '</tool_call>',
    '<think>\n\n</think>\n\nThe capital of France is Paris.',
    'No reasoning here, and a stray <tool_call> that never closes {"name": "get_weather"',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not offered
    '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call> after',
]


def parse(text: str, pieces: list[str] | None = None, in_reasoning: bool = False) -> ReplyParser:
    ids = iter(range(1, 100))
    parser = ReplyParser(("<think>", "</think>"), in_reasoning, JsonTagsParser(TOOLS), lambda: f"call_{next(ids)}")
    events = []
    for piece in pieces if pieces is not None else [text]:
        events += parser.feed(piece)
    events += parser.finish()
    parser.events = events  # type: ignore[attr-defined]
    return parser


def summary(parser: ReplyParser) -> tuple:
    return (parser.text, parser.thinking, [(c.name, c.arguments, c.status, c.raw) for c in parser.calls])


def test_reasoning_text_and_calls_are_separated() -> None:
    p = parse(REAL_OUTPUTS[1])
    assert p.thinking == "Two cities."
    assert p.text == "Let me check both."
    assert [(c.id, c.name, c.arguments, c.status) for c in p.calls] == [
        ("call_1", "get_weather", {"city": "Paris"}, "ok"), ("call_2", "get_weather", {"city": "Rome"}, "ok")]
    assert "<tool_call>" not in "".join(e.text for e in p.events if isinstance(e, TextDelta))


def test_empty_reasoning_block_is_reasoning_not_text() -> None:
    p = parse(REAL_OUTPUTS[2])
    assert p.thinking == "" and p.text == "The capital of France is Paris."


def test_prompt_that_opened_reasoning_starts_inside_it() -> None:
    p = parse("I should answer.\n</think>\n\nParis.", in_reasoning=True)
    assert p.thinking == "I should answer." and p.text == "Paris."


def test_tool_call_inside_reasoning_ends_it() -> None:
    p = parse('planning <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', in_reasoning=True)
    assert p.thinking == "planning" and [c.name for c in p.calls] == ["get_time"] and p.text == ""


def test_unterminated_call_is_invalid_with_its_raw_text() -> None:
    p = parse(REAL_OUTPUTS[3])
    [call] = p.calls
    assert call.status == "invalid" and call.name == "get_weather"
    assert call.raw == '<tool_call> that never closes {"name": "get_weather"'
    assert p.text == "No reasoning here, and a stray"


@pytest.mark.timeout(30)  # (a hang guard, no timing: each token searching the whole call took ~80 s here)
def test_a_long_call_streamed_a_token_at_a_time_is_not_searched_from_its_start_at_every_token() -> None:
    parser, piece = JsonTagsParser(TOOLS), "abcd"
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "') == []
    assert all(parser.feed(piece) == [] for _ in range(320_000))
    [block] = parser.feed('"}}</tool_call>')
    assert block.calls == [ParsedCall("get_weather", {"city": piece * 320_000})]


@pytest.mark.timeout(30)  # (a hang guard, no timing: searching for a name from every position took minutes here)
def test_a_call_cut_inside_a_long_run_of_name_characters_is_reported_at_once() -> None:
    run = "a0" * 60_000  # a model repeating itself
    calls = [parse(text).calls[0] for text in ("<tool_call>" + run, "<tool_call>get_weather(" + run)]
    assert [(c.status, c.name) for c in calls] == [("invalid", ""), ("invalid", "get_weather")]


def test_broken_json_and_unknown_functions_are_invalid_not_errors() -> None:
    broken, unknown = parse(REAL_OUTPUTS[4]).calls[0], parse(REAL_OUTPUTS[5]).calls[0]
    assert broken.status == "invalid" and "JSON" in (broken.error or "") and broken.raw.startswith("<tool_call>")
    assert unknown.status == "invalid" and "unknown function" in (unknown.error or "")


def test_string_arguments_are_parsed() -> None:
    p = parse(REAL_OUTPUTS[6])
    assert p.calls[0].arguments == {} and p.calls[0].status == "ok" and p.text == "after"


def test_streamed_text_concatenates_to_the_final_text_and_keeps_the_models_whitespace() -> None:
    p = parse("x", [" Hello", " ", "world  ", "\n", "!\n"])
    streamed = "".join(e.text for e in p.events if isinstance(e, TextDelta))
    assert streamed == p.text == " Hello world  \n!\n"


def test_whitespace_touching_markup_is_dropped() -> None:
    p = parse('<think>\n r \n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
              '</tool_call>\n Done. ')
    assert (p.thinking, p.text) == ("r", "Let me check.Done. ")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(REAL_OUTPUTS), st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_split_of_the_stream_gives_the_one_shot_result(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    streamed = parse(text, pieces)
    assert summary(streamed) == summary(parse(text))
    deltas = "".join(e.text for e in streamed.events if isinstance(e, TextDelta))
    thinking = "".join(e.text for e in streamed.events if isinstance(e, ThinkingDelta))
    assert deltas == streamed.text and thinking == (streamed.thinking or "")
    assert len([e for e in streamed.events if isinstance(e, ToolCallEvent)]) == len(streamed.calls)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}":, \nabtoolcalthink_[]')), max_size=120),
       st.lists(st.integers(min_value=0, max_value=120), max_size=6))
def test_the_call_parser_never_raises_and_loses_no_character(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    parser = JsonTagsParser(TOOLS)
    items: list[str | CallBlock] = []
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        items += parser.feed(text[a:b])
    items += parser.finish()
    assert "".join(item if isinstance(item, str) else item.raw for item in items) == text


def test_json_tags_parser_alone_handles_several_blocks_and_held_markers() -> None:
    parser = JsonTagsParser(TOOLS)
    out = parser.feed("a <tool_c")
    assert out == ["a "]
    out += parser.feed('all>{"name": "get_time", "arguments": {}}</tool_call>b')
    out += parser.finish()
    assert out[0] == "a " and isinstance(out[1], CallBlock) and out[2] == "b"
    assert json.dumps(out[1].calls[0].arguments) == "{}"


def test_reasoning_splitter_holds_partial_markers() -> None:
    splitter = ReasoningSplitter("<think>", "</think>")
    assert splitter.feed("x<thi") == [("text", "x")]
    assert splitter.feed("nk>y</th") == [("thinking", "y")]
    assert splitter.feed("ink>z") == [("text", "z")]


def test_channel_holds_trailing_whitespace_until_it_knows_where_it_belongs() -> None:
    channel = Channel(after_markup=True)
    assert [channel.feed(s) for s in ["\n\n", " a ", " ", "b\n"]] == ["", "a", "", "  b"]
    assert channel.finish() == "\n" and channel.value == "a  b\n"
    channel.feed(" c ")
    channel.markup()
    assert channel.feed(" d") == "d" and channel.value == "a  b\n cd"


class WholeReplyCalls(TrailingCallParser):
    """A trailing format: a reply that opens with ``{`` (or anything after ``<|call|>``) is one call."""

    start = "<|call|>"
    openers = ("{",)

    def parse(self, body: str) -> list[ParsedCall]:
        return [ParsedCall("get_time", {"body": body})]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_trailing_calls_parse_alike_however_the_reply_streams(cuts: list[int]) -> None:
    for reply, expected in [
        (' \n{"a": 1}', [CallBlock('{"a": 1}', [ParsedCall("get_time", {"body": '{"a": 1}'})])]),
        ("Text first <|call|>x(1)", ["Text first ", CallBlock("<|call|>x(1)", [ParsedCall("get_time",
                                                                                        {"body": "x(1)"})])]),
        ("Plain text { with a brace", ["Plain text { with a brace"]),
    ]:
        parser, pieces, position = WholeReplyCalls(TOOLS), [], 0
        for cut in cuts:
            pieces += parser.feed(reply[position : position + cut])
            position += cut
        pieces += parser.feed(reply[position:]) + parser.finish()
        merged: list[str | CallBlock] = []
        for piece in pieces:
            if isinstance(piece, str) and merged and isinstance(merged[-1], str):
                merged[-1] += piece
            else:
                merged.append(piece)
        assert merged == expected


def test_a_trailing_call_becomes_a_tool_call_event() -> None:
    parser = ReplyParser(None, False, WholeReplyCalls(TOOLS), lambda: "call_1")
    events = parser.feed('{"x": 1}') + parser.finish()
    assert [type(e) for e in events] == [ToolCallEvent] and parser.text == ""
    assert parser.calls[0].raw == '{"x": 1}' and parser.calls[0].status == "ok"
