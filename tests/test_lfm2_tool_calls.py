"""LFM2's Pythonic tool calls: literals only (never evaluated), several calls per list, dotted names, the
slips models make repaired, broken calls kept as invalid with their raw text, and streaming that gives
the same result however the text is split."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlxchat
from mlxchat.tools.parsing import CallBlock, ParsedCall
from mlxchat_lfm2.tool_calls import PythonicCallsParser, repair

from tool_call_support import feed_in_pieces

START, END = "<|tool_call_start|>", "<|tool_call_end|>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def calls(body: str, tools: list | None = None) -> list[ParsedCall]:
    return PythonicCallsParser(tools or []).parse(body)


def valid(body: str) -> list[tuple[str, dict]]:
    out = calls(body)
    assert all(c.error is None for c in out), out
    return [(c.name, c.arguments) for c in out]


def stream(text: str, pieces: list[int] | None = None, tools: list | None = None) -> list[str | CallBlock]:
    """Feed ``text`` in pieces cut at the given offsets; adjacent text pieces merged."""
    return feed_in_pieces(PythonicCallsParser(tools or []), text, pieces)


def test_registered_for_the_lfm2_architecture() -> None:
    registry = mlxchat.registry()
    assert registry.tool_parsers()["pythonic"] is PythonicCallsParser
    assert registry.architecture_for("lfm2").chat.tool_format == "pythonic"


def test_one_call_between_markers_with_text_around() -> None:
    out = stream(f'Let me look.{START}[get_weather(city="Tokyo")]{END}Done.')
    assert out[0] == "Let me look." and out[2] == "Done."
    block = out[1]
    assert isinstance(block, CallBlock) and block.raw == f'{START}[get_weather(city="Tokyo")]{END}'
    assert block.calls == [ParsedCall("get_weather", {"city": "Tokyo"})]


def test_several_calls_dotted_names_and_quotes() -> None:
    body = "[get_weather(city='Paris', days=2), Calendar.create_event(title=\"it's \\\"on\\\"\"), ping()]"
    assert valid(body) == [("get_weather", {"city": "Paris", "days": 2}),
                           ("Calendar.create_event", {"title": 'it\'s "on"'}), ("ping", {})]


def test_python_and_json_literals() -> None:
    body = ("[f(a=True, b=true, c=None, d=null, e=False, g=false, h=-3, i=+2.5, j=1e-3, k=[1, 'x', (2, 3)], "
            "l={'k': {\"n\": [null]}}, m='\\u00e9\\n', n='日本')]")
    assert valid(body) == [("f", {"a": True, "b": True, "c": None, "d": None, "e": False, "g": False, "h": -3,
                                  "i": 2.5, "j": 0.001, "k": [1, "x", [2, 3]], "l": {"k": {"n": [None]}},
                                  "m": "é\n", "n": "日本"})]


def test_bare_call_and_whitespace() -> None:
    assert valid(' \n get_weather(city="Rome") ') == [("get_weather", {"city": "Rome"})]
    assert valid('[\n  a(x=1),\n  b(y=2),\n]') == [("a", {"x": 1}), ("b", {"y": 2})]


def test_empty_list_is_no_call() -> None:
    assert calls("[]") == [] and calls("  ") == []


def test_nothing_is_evaluated() -> None:
    for body in ["[f(x=__import__('os').system('touch /tmp/pwned_lfm2'))]", "[f(x=1+1)]", "[f(x=lambda: 1)]",
                 "[f(x=open('/etc/passwd').read())]", "[f(x=y)]", "[f(x={1, 2})]", "[f(x=b'raw')]",
                 "[f(x=f'{y}')]", "[f(x={1: 2})]", "[f(x=1j)]", "[f(x=[*y])]"]:
        (call,) = calls(body)
        assert call.name == "f" and call.arguments is None and call.error, body


def test_repairs_of_what_python_rejects() -> None:
    assert valid("[f(code='line1\nline2\tend')]") == [("f", {"code": "line1\nline2\tend"})]
    assert valid("[f(month=07, day=009, zero=00, x=1.05, y=.05, z=1e-05, s='07')]") == [
        ("f", {"month": 7, "day": 9, "zero": 0, "x": 1.05, "y": 0.05, "z": 1e-05, "s": "07"})]
    assert valid("[convert(from='USD', to='EUR', class=1, s='from=1')]") == [
        ("convert", {"from": "USD", "to": "EUR", "class": 1, "s": "from=1"})]
    assert valid("[f(if_=1, x='''a\nb''')]") == [("f", {"if_": 1, "x": "a\nb"})]


@pytest.mark.timeout(30)  # (a hang guard, no timing: each slip copying the call around it took ~40 s here)
def test_slips_after_a_long_string_are_repaired_in_time_linear_in_the_call() -> None:
    head = f'[f(city="{"x" * 8_000_000}", days=['
    repaired = repair(head + "07," * 120_000 + "7]), g(" + "if=1," * 120_000 + ")]")
    assert repaired == head + "7," * 120_000 + "7]), g(" + "__kw_if=1," * 120_000 + ")]"


def test_broken_call_is_kept_invalid_beside_good_ones() -> None:
    out = calls("[good(a=1), bad(a=), also_good(s='x, y]')]")
    assert [(c.name, c.arguments) for c in out] == [
        ("good", {"a": 1}), ("bad", None), ("also_good", {"s": "x, y]"})]
    assert "bad(a=)" in (out[1].error or "")


def test_argument_errors() -> None:
    assert calls("[f(a=1, a=2)]")[0].error == "argument 'a' is given twice"
    assert "**" in (calls("[f(**kw)]")[0].error or "")
    assert "literal" in (calls("[f(a=g(1))]")[0].error or "")
    assert calls("[1, 'x']")[0].error == "expected a call like name(arg=value)"
    assert calls("[f()(x=1)]")[0].error == "the function must be a (dotted) name"
    assert calls("[f(1)]")[0].arguments is None


def test_positional_arguments_follow_the_offered_schema() -> None:
    assert [(c.name, c.arguments, c.error) for c in calls("[get_weather('Oslo', days=3)]", [WEATHER])] == [
        ("get_weather", {"city": "Oslo", "days": 3}, None)]
    assert calls("[get_weather('Oslo', 3, 4)]", [WEATHER])[0].arguments is None
    twice = calls("[get_weather('Oslo', city='Bergen')]", [WEATHER])[0]
    assert twice.error == "argument 'city' is given twice"


def test_unknown_function_is_invalid_when_tools_are_offered() -> None:
    (block,) = stream(f"{START}[get_time(zone='UTC')]{END}", tools=[WEATHER])
    assert isinstance(block, CallBlock)
    assert block.calls[0].name == "get_time" and "unknown function" in (block.calls[0].error or "")


def test_unterminated_block_keeps_its_raw_text() -> None:
    text = f"ok {START}[get_weather(city='Par"
    out = stream(text)
    assert out[0] == "ok "
    block = out[1]
    assert isinstance(block, CallBlock) and block.raw == text[3:]
    assert block.calls[0].name == "get_weather" and block.calls[0].arguments is None


def test_partial_marker_is_held_back_and_released_when_it_is_not_one() -> None:
    parser = PythonicCallsParser()
    assert parser.feed("hello <|tool_ca") == ["hello "]
    assert parser.feed("t|> plain") == ["<|tool_cat|> plain"]
    assert parser.finish() == []


# -- property tests ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda n: "__kw_" not in n)
names = identifiers.filter(lambda n: not keyword.iskeyword(n))  # functions; arguments may be keywords
arguments = st.dictionaries(identifiers, json_values, max_size=4)


def python_literal(value: object) -> str:
    """How LFM2.5's template writes values (repr-like); JSON dialect for dicts."""
    if isinstance(value, dict):
        return json.dumps(value)
    return repr(value)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.booleans())
def test_written_calls_parse_back(written: list[tuple[str, dict]], json_dialect: bool) -> None:
    render = json.dumps if json_dialect else python_literal
    body = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={render(v)}" for k, v in a.items()) + ")"
                           for n, a in written) + "]"
    out = calls(body)
    assert [(c.name, c.error) for c in out] == [(n, None) for n, _ in written]
    for call, (_, args) in zip(out, written, strict=True):
        assert json.dumps(call.arguments, sort_keys=True) == json.dumps(args, sort_keys=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.text(alphabet=st.sampled_from("ab <|>_[]()='\"\n"), max_size=12),
    st.builds(lambda n, a: f"{START}[{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + f")]{END}",
              names, arguments),
    st.just(f"{START}[broken(x=]{END}"),
    st.just(START + "[f(x=1)"),
), max_size=5), st.data())
def test_any_split_of_a_stream_gives_the_one_shot_result(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert stream(text, cuts) == stream(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("abf_.0179 ,[](){}=:'\"\\\n-+eTNnul*") | st.characters(),
               max_size=40))
def test_arbitrary_bodies_never_raise(body: str) -> None:
    for call in calls(body):
        assert (call.arguments is None) == (call.error is not None)


def test_keywords_of_python_are_all_accepted_as_argument_names() -> None:
    words = [w for w in keyword.kwlist if w not in ("True", "False", "None")]
    body = "[f(" + ", ".join(f"{w}={i}" for i, w in enumerate(words)) + ")]"
    assert valid(body) == [("f", {w: i for i, w in enumerate(words)})]


def test_json_escaped_surrogate_pairs_are_one_character() -> None:
    """Found by the property test above: JSON writes U+10000 and up as an escaped pair, which a Python
    string literal would keep as two lone surrogates."""
    [call] = calls('[f(a={"\\ud800\\udc00": "\\ud83d\\ude00"}, b="\\ud800")]')
    assert call.arguments == {"a": {"\U00010000": "\U0001f600"}, "b": "\ud800"}
