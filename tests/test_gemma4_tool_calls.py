"""Gemma 4's tool-call parser: every value kind, several calls, what models are seen to write besides the
canonical form, malformed calls kept as invalid with their raw text (never an exception), schema
coercion, streaming in any split equal to one pass, and calls rendered by the real template read back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxchat import registry
from mlxchat.chat_template import ChatTemplate
from mlxchat.tokenizer import Tokenizer
from mlxchat.tools.parsing import CallBlock
from mlxchat_gemma4 import Gemma4ToolParser

from conftest import fixture_path
from tool_call_support import feed_in_pieces, merge

Q = '<|"|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}, "metric": {"type": "boolean"},
                                     "ratio": {"type": ["number", "null"]}}}}}


def parse(text: str, tools: list[dict[str, Any]] | None = None) -> list[str | CallBlock]:
    return feed_in_pieces(Gemma4ToolParser(tools or []), text)


def calls(text: str, tools: list[dict[str, Any]] | None = None) -> list[tuple[str, Any, str | None]]:
    blocks = [b for b in parse(text, tools) if isinstance(b, CallBlock)]
    return [(c.name, c.arguments, c.error) for b in blocks for c in b.calls]


def call(body: str) -> str:
    return f"<|tool_call>{body}<tool_call|>"


def test_registered_under_its_format_name() -> None:
    assert registry().tool_parsers()["gemma4"] is Gemma4ToolParser
    assert registry().architecture_for("gemma4").chat.tool_format == "gemma4"


def test_canonical_call() -> None:
    text = call(f"call:get_weather{{city:{Q}Paris{Q},days:2}}")
    assert parse(text) == [CallBlock(text, parse(text)[0].calls)]  # type: ignore[union-attr]
    assert calls(text) == [("get_weather", {"city": "Paris", "days": 2}, None)]


def test_every_value_kind() -> None:
    body = (f"call:f{{s:{Q}a, b: {{c}} [d] \"e\" 'f'\nü{Q},empty:{Q}{Q},i:-7,x:2.5,e:1e-3,E:-2.0E+2,t:true,"
            f"n:false,z:null,o:{{inner:{{deep:[1,{Q}x{Q},{{k:null}}]}},blank:{{}}}},l:[],m:[[1,2],[]]}}")
    assert calls(call(body)) == [("f", {
        "s": "a, b: {c} [d] \"e\" 'f'\nü", "empty": "", "i": -7, "x": 2.5, "e": 1e-3, "E": -200.0, "t": True,
        "n": False, "z": None, "o": {"inner": {"deep": [1, "x", {"k": None}]}, "blank": {}}, "l": [],
        "m": [[1, 2], []]}, None)]


def test_several_calls_in_a_row_and_text_around() -> None:
    text = f"Sure.{call('call:a{x:1}')}{call(f'call:b.c-d{{y:{Q}z{Q}}}')} done"
    out = parse(text)
    assert out[0] == "Sure." and out[-1] == " done"
    assert calls(text) == [("a", {"x": 1}, None), ("b.c-d", {"y": "z"}, None)]


def test_several_calls_in_one_block() -> None:
    assert calls(call("call:a{x:1}call:b{}")) == [("a", {"x": 1}, None), ("b", {}, None)]


@pytest.mark.parametrize(("body", "arguments"), [
    ("call:f{a:none,b:None,c:nil,d:True,e:FALSE}", {"a": None, "b": None, "c": None, "d": True, "e": False}),
    ('call:f{tags:["x","y\\n"],who:\'me\'}', {"tags": ["x", "y\n"], "who": "me"}),  # quotes, not <|"|>
    ('call:f(key: "v", n: 3)', {"key": "v", "n": 3}),  # parenthesis form
    (" call : f { a : 1 , b : [ 1 , 2 ] , } ", {"a": 1, "b": [1, 2]}),  # spaces, trailing comma
    (f'call:f{{{Q}odd key{Q}:1,"q":2,with space:3}}', {"odd key": 1, "q": 2, "with space": 3}),
    ("f{a:1}", {"a": 1}),  # no "call:" label
    ("call:f{a:1,a:2}", {"a": 2}),  # a repeated key: the last one
])
def test_what_models_write_besides_the_canonical_form(body: str, arguments: dict[str, Any]) -> None:
    assert calls(call(body)) == [("f", arguments, None)]


@pytest.mark.parametrize(("body", "name", "message"), [
    (f"call:f{{a:{Q}open", "f", "unterminated"),
    ("call:f{a:1", "f", "expected"),
    ("call:f{a:Paris}", "f", "expected a value"),
    ("call:f{a:12abc}", "f", "expected a value"),
    ("call:f{a 1}", "f", "expected ':'"),
    ("call:f{a:1}}", "", "expected call:NAME"),
    ("", "", "expected call:NAME"),
    ("call:{}", "", "expected call:NAME"),
    ("call:f[1]", "f", "expected '{'"),
    ('call:f{a:"unclosed}', "f", "bad quoted string"),
])
def test_malformed_calls_are_invalid_with_raw_text(body: str, name: str, message: str) -> None:
    text = f"before {call(body)} after"
    out = parse(text)
    assert out[0] == "before " and out[-1] == " after"
    block = out[1]
    assert isinstance(block, CallBlock) and block.raw == call(body)
    bad = block.calls[-1]
    assert bad.name == name and bad.arguments is None and bad.error is not None and message in bad.error


def test_good_call_then_garbage_in_one_block() -> None:
    assert [(n, e is None) for n, _, e in calls(call("call:a{x:1} oops"))] == [("a", True), ("oops", False)]


def test_unterminated_block() -> None:
    # The model stopped (on <|tool_response>) before closing: a complete call still counts...
    assert calls(f"ok <|tool_call>call:f{{a:{Q}x{Q}}}") == [("f", {"a": "x"}, None)]
    # ... a cut one does not, and keeps its raw text.
    out = parse(f"ok <|tool_call>call:f{{a:{Q}x")
    assert out[0] == "ok " and isinstance(out[1], CallBlock) and out[1].raw == f"<|tool_call>call:f{{a:{Q}x"
    assert out[1].calls[0].arguments is None and "unterminated" in (out[1].calls[0].error or "")


@pytest.mark.timeout(30)  # (a hang guard, no timing: each number copying the rest of the call took ~40 s here)
def test_a_long_list_beside_a_long_string_reads_in_time_linear_in_the_call() -> None:
    text = "x" * 8_000_000
    found = calls(call(f"call:f{{days:[{'1,' * 240_000}1],city:{Q}{text}{Q}}}"))
    assert found == [("f", {"days": [1] * 240_001, "city": text}, None)]


def test_unknown_function_is_invalid() -> None:
    (name, arguments, error), = calls(call("call:get_time{}"), [WEATHER])
    assert name == "get_time" and arguments == {} and error is not None and "unknown function" in error
    assert calls(call("call:get_weather{}"), [WEATHER]) == [("get_weather", {}, None)]


def test_arguments_fit_the_declared_types() -> None:
    body = f"call:get_weather{{zip:02139,days:{Q}3{Q},metric:{Q}TRUE{Q},ratio:{Q}0.5{Q},city:7,extra:08}}"
    assert calls(call(body), [WEATHER]) == [("get_weather", {
        "zip": "02139", "days": 3, "metric": True, "ratio": 0.5, "city": "7", "extra": 8}, None)]
    # Without a schema, values stay as written.
    assert calls(call(f"call:get_weather{{zip:02139,days:{Q}3{Q}}}")) == [
        ("get_weather", {"zip": 2139, "days": "3"}, None)]


STREAMS = [
    f"Let me check.{call(f'call:get_weather{{city:{Q}Paris{Q},days:2}}')}{call('call:f{a:[1,{b:null}]}')}",
    f"no calls here < | tool_call <|tool < tool_call|> {Q}",
    f"x{call('call:f{a:Paris}')}y{call('call:g{}')}",
    f"tail <|tool_call>call:f{{a:{Q}x{Q}}}",
    "cut <|tool_call>call:f{a:",
    "<|tool_ca",
    f"{call('call:a{}')}{call('')}<|tool_call><|tool_call>call:b{{}}<tool_call|>",
]


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from(STREAMS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_of_the_stream_gives_the_one_shot_result(text: str, cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    parser = Gemma4ToolParser([WEATHER])
    streamed: list[str | CallBlock] = []
    for piece in pieces:
        streamed += parser.feed(piece)
    streamed += parser.finish()
    assert merge(streamed) == parse(text, [WEATHER])


def test_partial_start_marker_is_held_back() -> None:
    parser = Gemma4ToolParser()
    assert parser.feed("hello <|tool_") == ["hello "]
    assert parser.feed("response>") == ["<|tool_response>"]


# -- calls as the real template renders them ---------------------------------------------------------

keys = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
strings = st.text(max_size=12).filter(lambda s: Q not in s and "<tool_call|>" not in s)
scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12) | strings
           | st.floats(allow_nan=False, allow_infinity=False, width=64))
values = st.recursive(scalars,
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=12)


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    folder = fixture_path("gemma4")
    return ChatTemplate((folder / "chat_template.jinja").read_text(), Tokenizer.from_folder(folder))


@settings(max_examples=150, deadline=None)
@given(arguments=st.dictionaries(keys, values, max_size=5), name=st.from_regex(r"[a-z][a-z0-9_.\-]{0,10}",
                                                                               fullmatch=True))
def test_calls_rendered_by_the_template_read_back(template: ChatTemplate, arguments: dict[str, Any],
                                                  name: str) -> None:
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function",
                                                      "function": {"name": name, "arguments": arguments}}]}]
    text = template.render(messages, add_generation_prompt=False)
    rendered = text[text.index("<|tool_call>") : text.index("<tool_call|>") + len("<tool_call|>")]
    assert calls(rendered) == [(name, arguments, None)]
