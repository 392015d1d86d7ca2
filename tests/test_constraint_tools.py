"""Tool calls under constraint, on all four call formats (Qwen3 JSON, Qwen3.5 XML, Gemma 4, LFM2 pythonic):
``tool_choice="required"`` and a named function on random weights always give valid calls of an offered
tool with schema-valid arguments; a strict tool's call is constrained from its opener on in ``auto`` mode;
the demo model answers "Hello!" with a real call; ``response_format`` through a session gives ``parsed``."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

import mlxchat
from mlxchat import load_session, tool
from mlxchat.constraints import Constraint, RowMatcher, tool_constraint
from mlxchat.errors import InvalidInputError
from mlxchat.testing.sessions import expected_reuse, prompt_ids

from conftest import loaded

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 400, "reasoning_budget": 16}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now.", "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
FORMATS = ["qwen3", "qwen3_5", "gemma4", "lfm2"]


def assert_valid_calls(result, names: set[str]) -> None:
    assert result.finish_reason == "tool_calls" and result.tool_calls, result
    for call in result.tool_calls:
        assert call.status == "ok", call
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


@pytest.mark.parametrize("fixture", FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_are_valid_calls_of_offered_tools(fixture: str, seed: int) -> None:
    """(The end of turn is favoured, so that random weights do not chain calls to the end of ``max_tokens``;
    the mask still allows it only after a whole call.)"""
    model = loaded(fixture)
    session = model.chat_session(tools=TOOLS)
    favour_end = {i: 4.0 for i in model.eos_ids}
    result = session.send("What is the weather?", tool_choice="required",
                          config={**SAMPLED, "seed": seed, "logit_bias": favour_end})
    assert_valid_calls(result, set(SCHEMAS))


@pytest.mark.parametrize("fixture", FORMATS)
def test_a_named_function_is_the_one_called(fixture: str) -> None:
    session = loaded(fixture).chat_session(tools=TOOLS)
    result = session.send("Time?", tool_choice={"type": "function", "function": {"name": "get_time"}},
                          config={**SAMPLED, "seed": 7})
    assert_valid_calls(result, {"get_time"})
    assert len(result.tool_calls) == 1


@pytest.mark.parametrize("fixture", FORMATS)
def test_a_strict_tool_is_constrained_once_its_call_opens(fixture: str) -> None:
    """``auto`` with a strict tool: free text until the call's opener, then only the call, then free."""
    model = loaded(fixture)
    strict = [{**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": True}}]
    parser = model.tool_parser(strict)
    constraint = tool_constraint(parser, strict, model.call_markup, "auto", None, None)
    assert constraint is not None and constraint.trigger == parser.start
    matcher = RowMatcher(model.token_table, constraint)
    tokenizer = model.tokenizer
    for token in tokenizer.encode("Let me look."):
        assert matcher.mask() is None
        matcher.advance(token)
    opener = tokenizer.encode(parser.start)
    for token in opener:
        matcher.advance(token)
    mask = matcher.mask()
    assert mask is not None and not mask[sorted(model.eos_ids)].any()
    allowed = int(mask.sum())
    assert 0 < allowed < len(mask) // 2


@pytest.mark.parametrize("fixture", FORMATS)
def test_every_strict_call_opened_in_auto_mode_is_valid(fixture: str) -> None:
    """``auto`` with strict tools, sampled to the end on random weights at temperature 1: whenever the reply
    opens a call, the call parses (``status="ok"``) and its arguments validate. The opener and the end of
    turn are favoured so that calls happen and replies end; several seeds."""
    model = loaded(fixture)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    (opener,) = model.tokenizer.encode(model.tool_parser(strict).start)
    bias = {opener: 6.0, **{i: 6.0 for i in model.eos_ids}}
    opened = 0
    for seed in range(6):
        result = model.chat_session(tools=strict).send("What is the weather?",
                                                       config={**SAMPLED, "seed": seed, "logit_bias": bias})
        assert result.finish_reason in ("stop", "tool_calls"), result
        calls = result.tool_calls
        blocks = [c.raw for i, c in enumerate(calls) if i == 0 or c.raw != calls[i - 1].raw]  # LFM2: a list a block
        assert len(blocks) == result.tokens.count(opener), result
        for call in result.tool_calls:
            assert call.status == "ok", call
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
        opened += len(result.tool_calls)
    assert opened  # calls did happen


def test_masks_fit_logits_narrower_than_the_tokenizer() -> None:
    """A checkpoint whose embedding has fewer rows than its tokenizer has tokens: masks as wide as its logits,
    the grammar still followed."""
    from mlxchat.constraints import TokenTable, format_grammar

    model = loaded("qwen3")
    narrow = model.tokenizer.vocab_size - 4
    table = TokenTable(model.tokenizer, narrow, [i for i in model.eos_ids if i < narrow])
    matcher = RowMatcher(table, Constraint(format_grammar(POINT_FORMAT)))
    mask = matcher.mask()
    assert mask is not None and len(mask) == narrow and mask[model.tokenizer.encode("{")[0]] and mask.sum() < narrow


def test_the_demo_model_answers_hello_with_a_call() -> None:
    from mlxchat.demo.world import DEMO_TOOLS

    session = load_session(tools=DEMO_TOOLS)
    result = session.send("Hello!", tool_choice="required")
    assert result.finish_reason == "tool_calls" and result.tool_calls
    assert all(c.status == "ok" and c.name in {t.name for t in DEMO_TOOLS} for c in result.tool_calls)


def test_strict_tool_decorator_marks_the_schema() -> None:
    @tool(strict=True)
    def get_zone(zone: str) -> str:
        """Zone.

        Args:
            zone: A zone.
        """
        return zone

    assert get_zone.schema["function"]["strict"] is True


class Reply(BaseModel):
    answer: bool


def test_session_response_format_gives_the_parsed_object() -> None:
    session = loaded("qwen3").chat_session()
    result = session.send("Yes or no?", response_format=Reply, config={**SAMPLED, "seed": 3})
    assert result.finish_reason == "stop"
    assert isinstance(result.parsed, Reply) and result.text == result.parsed.model_dump_json(indent=None).replace(
        ":", ": ")
    raw = session.send("Again", response_format={"type": "object", "properties": {"n": {"type": "integer"}},
                                                 "required": ["n"], "additionalProperties": False},
                       config={**SAMPLED, "seed": 4})
    assert raw.finish_reason == "stop" and isinstance(raw.parsed["n"], int)


def test_a_cut_reply_keeps_its_text_and_parses_to_none() -> None:
    session = loaded("qwen3").chat_session()
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 30, "maxLength": 40}},
              "required": ["s"]}
    result = session.send("Hi", response_format=schema, config={**SAMPLED, "max_tokens": 4, "seed": 1})
    assert result.finish_reason == "length" and result.parsed is None and result.text


def test_bad_tool_choices_are_refused() -> None:
    session = loaded("qwen3").chat_session(tools=TOOLS)
    with pytest.raises(InvalidInputError, match="not among the tools"):
        session.send("Hi", tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidInputError, match="tool_choice"):
        session.send("Hi", tool_choice="sometimes")
    with pytest.raises(InvalidInputError, match="needs tools"):
        loaded("qwen3").chat_session().send("Hi", tool_choice="required")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}]
    with pytest.raises(InvalidInputError, match=r"tool 'f'.*\$\.properties\.x"):
        loaded("qwen3").chat_session(tools=bad).send("Hi", tool_choice="required")
    assert Constraint("start: x\nx: \"a\"").trigger is None


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tag": {"enum": ["a", "b"]}}, "required": ["x", "tag"]}
POINT_FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}


def test_a_constrained_reply_is_not_drafted_and_stays_valid() -> None:
    """Speculative decoding is off for a constrained reply (see mlxchat.generation.stream_generation)."""
    model = loaded("qwen3")
    fast = model.with_draft(model, draft_tokens=3)
    result = fast.generate("Hi", {**SAMPLED, "seed": 2, "response_format": POINT_FORMAT})
    assert result.finish_reason == "stop" and result.report.draft_tokens == 0
    jsonschema.validate(json.loads(result.text), POINT)


def test_generate_on_messages_reasons_first_then_follows_the_format() -> None:
    """``model.generate`` on chat messages: the constraint starts after the reasoning the template lets the
    reply write (the demo model opens ``<think>`` itself), bounded by ``reasoning_budget``."""
    from server_support import demo_model

    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    result = demo_model().generate([{"role": "user", "content": "Capital of France as JSON?"}], {
        "max_tokens": 120, "reasoning_budget": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": city}}})
    assert result.finish_reason == "stop" and result.text.startswith("<think>")
    thinking, answer = result.text.split("</think>")
    assert len(thinking) > len("<think>") and json.loads(answer)["city"] in ("Paris", "Rome")


def test_a_format_without_a_grammar_falls_back_to_opening_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parser that gives no grammar (a plugin's own format): a required call's reply is made to open the
    call in its markup (``forced_prefix``), as before constrained decoding."""
    from mlxchat.tools.parsing import JsonTagsParser

    monkeypatch.setattr(JsonTagsParser, "call_grammar", lambda self, tools, markup: None)
    session = loaded("qwen3").chat_session(tools=TOOLS)
    result = session.send("Weather?", tool_choice="required", config={**SAMPLED, "seed": 1, "max_tokens": 40})
    assert result.tool_calls and result.tool_calls[0].raw.startswith('<tool_call>\n{"name": "')


LONG = {"type": "object", "properties": {"s": {"type": "string", "minLength": 60, "maxLength": 80}}, "required": ["s"],
        "additionalProperties": False}


def test_a_cancelled_constrained_reply_keeps_its_text_and_the_session_goes_on() -> None:
    session = loaded("qwen3").chat_session()
    stream = session.send_stream("Write it.", response_format=LONG, config={**SAMPLED, "seed": 1})
    events = []
    for event in stream:
        events.append(event)
        if sum(isinstance(e, mlxchat.TextDelta) for e in events) == 3:
            stream.cancel()
    done = events[-1]
    assert isinstance(done, mlxchat.Done) and done.result.finish_reason == "cancelled" and done.result.parsed is None
    streamed = "".join(e.text for e in events if isinstance(e, mlxchat.TextDelta))
    assert streamed.startswith("{") and session.messages[-1].content == streamed == done.result.text
    again = session.send("Now a point.", response_format=POINT_FORMAT, config={**SAMPLED, "seed": 2})
    assert again.finish_reason == "stop"
    jsonschema.validate(again.parsed, POINT)


def test_a_session_saved_after_a_constrained_turn_resumes_and_goes_on_as_it_would(tmp_path) -> None:
    """Saved after a ``response_format`` turn and loaded back, a session's next constrained turn reuses the
    same cache and writes the same reply as the session that stayed in memory."""
    model = loaded("qwen3")
    session = model.chat_session()
    first = session.send("A point?", response_format=POINT_FORMAT, config={**SAMPLED, "seed": 3})
    assert first.finish_reason == "stop" and first.parsed is not None
    session.save(tmp_path / "point.session")
    resumed = mlxchat.ChatSession.load(model, tmp_path / "point.session")
    assert resumed.messages == session.messages
    config = {**SAMPLED, "seed": 4}
    went_on, stayed = (s.send("Another?", response_format=POINT_FORMAT, config=config) for s in (resumed, session))
    assert went_on.tokens == stayed.tokens and went_on.parsed == stayed.parsed
    assert went_on.report.cached_prompt_tokens == stayed.report.cached_prompt_tokens >= first.report.prompt_tokens


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3_5"])
def test_the_turn_after_a_constrained_reply_reuses_what_the_cache_can_serve(fixture: str) -> None:
    """(As a free reply's: up to where the re-rendered history departs from what the cache holds, or the last
    snapshot before it on a hybrid model.)"""
    model = loaded(fixture)
    session = model.chat_session()
    first = session.send("A point?", response_format=POINT_FORMAT, config={**SAMPLED, "seed": 5})
    assert first.finish_reason == "stop"
    history = [*session.messages, mlxchat.ChatMessage(role="user", content="Thanks.")]
    reuse = expected_reuse(session, prompt_ids(model, history, SAMPLED))
    second = session.send("Thanks.", config={**SAMPLED, "seed": 6, "max_tokens": 8})
    assert second.report.cached_prompt_tokens == reuse > 0


def test_the_answer_to_a_forced_call_reuses_what_the_cache_can_serve() -> None:
    model = loaded("qwen3")
    session = model.chat_session(tools=TOOLS)
    call_turn = session.send("Time?", tool_choice={"type": "function", "function": {"name": "get_time"}},
                             config={**SAMPLED, "seed": 7})
    assert_valid_calls(call_turn, {"get_time"})
    session.add_tool_result(call_turn.tool_calls[0].id, "12:00")
    reuse = expected_reuse(session, prompt_ids(model, session.messages, SAMPLED, TOOLS))
    answer = session.respond(config={**SAMPLED, "seed": 8, "max_tokens": 8})
    assert answer.report.cached_prompt_tokens == reuse >= call_turn.report.prompt_tokens
