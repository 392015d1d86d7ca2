"""Qwen3.5's XML tool calls: values typed by the offered tool's schema (both the Qwen3.5 and Qwen3.6
spellings of null and booleans), several calls per reply, the slips models make tolerated, broken calls kept
as invalid with their raw text, streaming that gives the same result however the text is split, and the
round trip through the real chat template."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlxchat
from mlxchat.tools.parsing import CallBlock, ParsedCall
from mlxchat_qwen35.tool_parser import XmlToolCallParser, coerce

from conftest import loaded
from tool_call_support import feed_in_pieces


def function(name: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                          "properties": properties}}}


WEATHER = function("get_weather", city={"type": "string"}, days={"type": "integer"},
                   metric={"type": "boolean"}, threshold={"type": "number"},
                   hours={"type": "array", "items": {"type": "integer"}}, options={"type": "object"},
                   limit={"anyOf": [{"type": "integer"}, {"type": "null"}]},
                   note={"type": ["string", "null"]}, unit={"enum": ["C", "F"]})
TIME = function("get_time", zone={"type": "string"})
TOOLS = [WEATHER, TIME]


def call(name: str, **params: str) -> str:
    """A call as the template writes it (values already as text)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(body: str, tools: list | None = TOOLS) -> list[ParsedCall]:
    return XmlToolCallParser(tools or []).parse(body)


def stream(text: str, pieces: list[int] | None = None, tools: list | None = TOOLS) -> list[str | CallBlock]:
    """Feed ``text`` in pieces cut at the given offsets; adjacent text pieces merged."""
    return feed_in_pieces(XmlToolCallParser(tools or []), text, pieces)


def test_registered_for_the_qwen35_architecture() -> None:
    registry = mlxchat.registry()
    assert registry.tool_parsers()["qwen3_xml"] is XmlToolCallParser
    for model_type in ("qwen3_5", "qwen3_5_moe"):
        chat = registry.architecture_for(model_type).chat
        assert chat.tool_format == "qwen3_xml"
        assert chat.reasoning == ("<think>", "</think>")
        assert chat.stop_tokens == ("<|im_end|>", "<|endoftext|>")


def test_one_call_with_text_before_it() -> None:
    raw = call("get_weather", city="Paris", days="2")
    out = stream(f"Let me check.\n\n{raw}")
    expected = CallBlock(raw, [ParsedCall("get_weather", {"city": "Paris", "days": 2})])
    assert out == ["Let me check.\n\n", expected]


def test_values_are_typed_by_the_schema() -> None:
    raw = call("get_weather", city="42", days="3", metric="true", threshold="2.5", hours="[1, 2]",
               options='{"a": {"b": null}}', limit="7", note="hello", unit="F")
    assert parse(raw[len("<tool_call>"):-len("</tool_call>")]) == [ParsedCall("get_weather", {
        "city": "42", "days": 3, "metric": True, "threshold": 2.5, "hours": [1, 2],
        "options": {"a": {"b": None}}, "limit": 7, "note": "hello", "unit": "F"})]


def test_python_and_json_spellings_are_both_read() -> None:
    """Qwen3.5's template writes non-string values with ``str`` (None, True), Qwen3.6's as JSON."""
    python = {"metric": "True", "limit": "None", "options": "{'x': True, 'y': None}", "note": "None"}
    json_ = {"metric": "true", "limit": "null", "options": '{"x": true, "y": null}', "note": "null"}
    for spelling in (python, json_):
        (parsed,) = parse(call("get_weather", **spelling))
        assert parsed.arguments == {"metric": True, "limit": None, "options": {"x": True, "y": None},
                                    "note": None}


def test_coercion_edge_cases() -> None:
    string, integer, number = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    assert coerce("None", string) == "None"  # a string parameter keeps the text, even "None"
    assert coerce("None", integer) is None
    assert coerce(" 12 ", integer) == 12
    assert coerce("12.5", integer) == "12.5"  # does not fit: stays text
    assert coerce("3", number) == 3 and coerce("3.0", number) == 3.0 and coerce("1e3", number) == 1000.0
    assert coerce("nan", number) == "nan"
    assert coerce("yes", {"type": "boolean"}) == "yes"
    assert coerce("False", {"type": "boolean"}) is False
    assert coerce("[1, 'a']", {"type": "array"}) == [1, "a"]
    assert coerce('"[1, 2]"', {"type": "array"}) == [1, 2]  # JSON-encoded twice
    assert coerce("[1, 2]", {"type": "object"}) == "[1, 2]"  # wrong structure: stays text
    assert coerce("not json", {"type": "object"}) == "not json"
    assert coerce("5", None) == "5"  # undeclared parameter
    assert coerce("5", {}) == "5"
    assert coerce("5", {"type": ["integer", "string"]}) == 5
    assert coerce("five", {"type": ["integer", "string"]}) == "five"
    assert coerce("2", {"enum": [1, 2, 3]}) == 2


def test_string_values_keep_their_text() -> None:
    value = "  line one\n\n  <b>line two</b> </function> ok  \n"
    (parsed,) = parse(call("get_weather", city=value))
    assert parsed.arguments == {"city": value}


def test_undeclared_parameters_stay_strings() -> None:
    (parsed,) = parse(call("get_weather", city="Rome", extra="12"))
    assert parsed.arguments == {"city": "Rome", "extra": "12"}


def test_several_calls_per_reply_and_per_block() -> None:
    first, second = call("get_weather", city="Oslo"), call("get_time", zone="CET")
    out = stream(f"{first}\n{second}")
    assert out == [CallBlock(first, [ParsedCall("get_weather", {"city": "Oslo"})]), "\n",
                   CallBlock(second, [ParsedCall("get_time", {"zone": "CET"})])]
    both = ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
            "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>")
    assert parse(both) == [ParsedCall("get_weather", {"city": "Oslo"}),
                           ParsedCall("get_time", {"zone": "CET"})]


def test_call_without_parameters() -> None:
    assert parse("\n<function=get_time>\n</function>\n") == [ParsedCall("get_time", {})]


def test_missing_closing_tags_are_tolerated() -> None:
    # </parameter> missing: the next declared parameter, or the end of the function, ends the value.
    body = "<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</function>\n"
    assert parse(body) == [ParsedCall("get_weather", {"city": "Paris", "days": 3})]
    # </function> missing before the end of the block or the next function.
    body = ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n")
    assert parse(body) == [ParsedCall("get_weather", {"city": "Paris"}),
                           ParsedCall("get_time", {"zone": "UTC"})]


def test_a_parameter_tag_inside_a_value_is_text_unless_it_opens_a_line() -> None:
    (parsed,) = parse(call("get_weather", city="see <parameter=days> here"))
    assert parsed.arguments == {"city": "see <parameter=days> here"}


def test_unknown_function_is_invalid() -> None:
    (block,) = stream(call("launch", target="moon"))
    (parsed,) = block.calls
    assert parsed.name == "launch" and parsed.error and "unknown function" in parsed.error


def test_malformed_calls_are_invalid_with_their_raw_text() -> None:
    cases = {
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>': "expected <function=NAME>",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>": "unexpected text",
        "<tool_call>\n<function=>\n</function>\n</tool_call>": "empty function name",
    }
    for raw, error in cases.items():
        out = stream(f"ok {raw} done")
        assert out[0] == "ok " and out[2] == " done"
        block = out[1]
        assert isinstance(block, CallBlock) and block.raw == raw
        assert block.calls[0].arguments is None and error in block.calls[0].error


@pytest.mark.timeout(30)  # (a hang guard, no timing: each value or opener searching the rest took minutes here)
def test_a_block_of_thousands_of_unclosed_values_or_openers_reads_in_time_linear_in_its_length() -> None:
    values = "\n<function=get_time>\n" + "<parameter=zone>\nUTC\n" * 80_000
    openers = "<function=" * 80_000
    (values_call,), (openers_call,) = parse(values), parse(openers)
    assert values_call == ParsedCall("get_time", {"zone": "UTC"}) and "expected <function=NAME>" in openers_call.error


def test_unterminated_call_is_invalid_and_kept() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    (block,) = stream(text)
    assert block.raw == text
    assert block.calls == [ParsedCall("get_weather", None, "unterminated tool call (output was cut)")]


def test_partial_start_marker_is_held_back_then_released() -> None:
    parser = XmlToolCallParser(TOOLS)
    assert parser.feed("Sure <tool_") == ["Sure "]
    assert parser.feed("box") == ["<tool_box"]


REPLY = ("I'll check both.\n\n" + call("get_weather", city="São Paulo", days="2", hours="[9, 18]") + "\n"
         + call("get_time", zone="America/Sao_Paulo") + "\n" + call("get_weather", city="Lima\n</function>")
         + "<tool_call>\n<function=get_weather>\n<parameter=city>\nBroken")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(REPLY)), max_size=12))
def test_any_split_of_the_stream_gives_the_one_shot_result(cuts: list[int]) -> None:
    assert stream(REPLY, cuts) == stream(REPLY)


_PIECES = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=", "</function>",
           "<parameter=city>", "<parameter=days>", "</parameter>", "\n", "Paris", "3", "{", "None", ">", "<"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30), st.lists(st.integers(0, 400), max_size=6))
def test_never_raises_and_loses_no_text(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    out = stream(text, [c for c in cuts if c <= len(text)])
    assert "".join(item if isinstance(item, str) else item.raw for item in out) == text
    for item in out:
        if isinstance(item, CallBlock):
            assert item.calls
            assert all(c.error is not None or isinstance(c.arguments, dict) for c in item.calls)


def test_round_trip_through_the_real_template() -> None:
    """Arguments given as dicts render through the Qwen3.5 template and parse back to the same values."""
    model = loaded("qwen3_5")
    arguments = {"city": "Paris", "days": 3, "metric": False, "threshold": 0.5, "hours": [9, 18],
                 "options": {"lang": "fr", "alerts": None}, "limit": None, "note": "two\nlines"}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                    {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
                {"role": "tool", "content": "sunny"}]
    text = model.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "<parameter=limit>\nNone\n</parameter>" in text  # Qwen3.5 writes non-strings with str()
    assert "<parameter=metric>\nFalse\n</parameter>" in text
    reply = text[text.index("Checking.") : text.index("<|im_end|>", text.index("Checking."))]
    blocks = [item for item in stream(reply) if isinstance(item, CallBlock)]
    assert [c for b in blocks for c in b.calls] == [ParsedCall("get_weather", arguments),
                                                   ParsedCall("get_time", {"zone": "CET"})]
    assert re.search(r"</tool_call>\n<tool_call>", reply)
