"""Nothing from outside crashes the library: token ids are checked before MLX sees them, prompts that cannot
fit the context are refused before any work (or the oldest turns give way, when asked), text must be valid
Unicode, parsers turn any failure into an invalid call, and a half-read stream cannot hold the model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

import mlxchat
from mlxchat import ContextLengthError, InvalidInputError
from mlxchat.generation import GenerationConfig
from mlxchat.reply import ReplyParser
from mlxchat.testing import GREEDY, assert_matches_stateless
from mlxchat.tools.parsing import JsonTagsParser
from mlxchat.worker import Cancelled
from mlxchat_gemma4 import Gemma4ToolParser
from mlxchat_lfm2 import PythonicCallsParser
from mlxchat_qwen35 import XmlToolCallParser

from conftest import fixture_path, loaded

HERE = Path(__file__).resolve().parent


@pytest.fixture
def model() -> mlxchat.GenerativeModel:
    return loaded("qwen3")


@pytest.fixture(scope="module")
def short_context() -> mlxchat.GenerativeModel:
    """The qwen3 fixture limited to 200 tokens of context."""
    return mlxchat.load_model(fixture_path("qwen3"), dtype="float32", context_length=200)


# -- token ids -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [{512: 5.0}, {99999999999: 5.0}, {-1: 1.0}, {5000: 1.0}])
def test_logit_bias_outside_the_vocabulary_is_refused_before_mlx(model, bias) -> None:
    with pytest.raises(InvalidInputError, match="logit_bias token id"):
        model.generate("hello", {"logit_bias": bias})
    assert model.generate("hello", {"max_tokens": 2, "logit_bias": {511: 1.0}}).report.generated_tokens >= 1


@pytest.mark.parametrize("ids", [[1, 512], [-1], [1, 2**40], [1.5], [True], ["3"]])
def test_prompt_ids_are_checked_in_generate_and_logits(model, ids) -> None:
    with pytest.raises(InvalidInputError):
        model.generate(ids, {"max_tokens": 1})
    with pytest.raises(InvalidInputError):
        model.logits(ids)


def test_random_ids_in_every_id_taking_api_never_crash_the_process() -> None:
    """Run in a child process, so that memory corruption would fail this test instead of killing the run."""
    script = HERE / "data" / "fuzz_token_ids.py"
    done = subprocess.run([sys.executable, str(script), str(fixture_path("qwen3")), "300"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["refused"] > 0 and summary["ran"] > 0 and summary["other_errors"] == []


# -- generation settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [{"frequency_penalty": math.nan}, {"temperature": math.inf},
                                    {"seed": 2**64}, {"seed": -2}, {"max_tokens": 0},
                                    {"chat_template_kwargs": {"messages": []}},
                                    {"chat_template_kwargs": {"add_generation_prompt": False}},
                                    {"logit_bias": {1: math.nan}}, {"stop": ["\ud800"]}])
def test_bad_generation_settings_are_refused(values) -> None:
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate(values)


def test_seed_minus_one_means_no_seed_as_in_vllm() -> None:
    assert GenerationConfig(seed=-1).seed is None
    assert GenerationConfig(seed=2**64 - 1).seed == 2**64 - 1


# -- the context limit -----------------------------------------------------------------------------------

def test_a_prompt_longer_than_the_context_is_refused_before_any_work(short_context) -> None:
    with pytest.raises(ContextLengthError, match="200"):
        short_context.generate(list(range(1, 201)), {"max_tokens": 5})


def test_max_tokens_is_lowered_to_what_the_context_leaves(short_context) -> None:
    eos = sorted(short_context.eos_ids)
    config = {"max_tokens": 10**30, "temperature": 0.0, "logit_bias": {e: -100.0 for e in eos}}
    result = short_context.generate(list(range(1, 191)), config)
    assert result.finish_reason == "length" and result.report.generated_tokens == 10


def test_a_session_turn_that_cannot_fit_is_an_error_and_leaves_the_session_as_it_was(short_context) -> None:
    session = short_context.chat_session(system="Be terse.")
    session.send("Hello", config=GREEDY)
    before = session.messages
    with pytest.raises(ContextLengthError):
        session.send("word " * 400, config=GREEDY)
    assert session.messages == before
    assert session.send("Hi again", config=GREEDY).finish_reason in ("stop", "length")


def test_truncate_oldest_drops_whole_turns_and_keeps_the_system_prompt(short_context) -> None:
    session = short_context.chat_session(system="Be terse.", context_policy="truncate_oldest")
    config = {**GREEDY, "max_tokens": 8}
    for i in range(6):
        result = session.send(f"Question number {i}: " + "tell me more " * 6, config=config)
    assert session.truncated_messages > 0 and session.truncated_messages % 2 == 0
    assert len(session.messages) == 13 and session.messages[0].role == "system"
    assert result.report.prompt_tokens + 8 <= 200
    visible = session.messages[:1] + session.messages[1 + session.truncated_messages:]
    history = [m.template_dict() for m in visible[:-1]]
    stateless = short_context.generate(short_context.apply_chat_template(history), config)
    assert result.tokens == stateless.tokens


def test_the_context_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="context_policy"):
        loaded("qwen3").chat_session(context_policy="drop_all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_length"):
        mlxchat.load_model(fixture_path("qwen3"), context_length=1)


# -- text ------------------------------------------------------------------------------------------------

def test_a_lone_surrogate_is_refused_and_the_session_goes_on(model) -> None:
    session = model.chat_session()
    with pytest.raises(InvalidInputError, match="surrogate"):
        session.send("hi \ud800", config=GREEDY)
    assert session.messages == []
    result = session.send("hi", config=GREEDY)
    assert_matches_stateless(model, session, result, GREEDY)
    with pytest.raises(ValidationError, match="surrogate"):
        model.chat_session().prime_history([{"role": "user", "content": "\udfff"}])


def test_a_system_prompt_that_is_no_valid_text_is_invalid_input_and_changes_nothing(model) -> None:
    with pytest.raises(InvalidInputError, match="the system prompt holds a lone surrogate"):
        model.chat_session(system="be \udcff brief")
    session = model.chat_session(system="Be brief.")
    for bad in ("\ud800", 5):
        with pytest.raises(InvalidInputError, match="the system prompt"):
            session.set_system(bad)  # type: ignore[arg-type]
    assert session.export_state().system == "Be brief." and [m.content for m in session.messages] == ["Be brief."]


def test_empty_messages_are_refused(model) -> None:
    session = model.chat_session()
    for empty in ("", "   \n"):
        with pytest.raises(InvalidInputError, match="nothing to send"):
            session.send(empty)
    assert session.messages == []


def test_private_use_marker_characters_in_user_text_reach_the_model(model) -> None:
    text = "a\ue000b\ue001c \ue000<|im_end|>\ue001"
    ids = model.apply_chat_template([{"role": "user", "content": text}])
    assert text in model.tokenizer.decode(ids)
    assert ids.count(model.tokenizer.token_id("<|im_end|>")) == 1  # only the template's own


def test_developer_messages_are_system_messages() -> None:
    assert mlxchat.ChatMessage(role="developer", content="x").role == "system"  # type: ignore[arg-type]


def test_text_part_lists_become_one_string(model) -> None:
    message = mlxchat.ChatMessage(role="user", content=[{"type": "text", "text": "Hello"},
                                                        {"type": "text", "text": "there"}])
    assert message.content == "Hello\nthere"
    ids = model.apply_chat_template([message.model_dump()])
    assert "Hello\nthere" in model.tokenizer.decode(ids)


def test_deep_nesting_in_messages_is_refused() -> None:
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValidationError, match="nests deeper"):
        mlxchat.ChatMessage(role="user", content="x", metadata=deep)


def test_tool_call_arguments_that_are_not_json_render_verbatim_everywhere(model) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    direct = model.apply_chat_template(messages, tokenize=False)
    via_session = model.apply_chat_template([mlxchat.ChatMessage.coerce(m).template_dict() for m in messages],
                                            tokenize=False)
    assert "{not json" in direct and direct == via_session


# -- tool-call parsers -----------------------------------------------------------------------------------

DEEP = 3000
NESTED = "[" * DEEP + "]" * DEEP
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "array"}}}}}]


@pytest.mark.parametrize(("parser", "text"), [
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"a": ' + NESTED + "}}</tool_call>"),
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100 + "]" * 100 + "}}</tool_call>"),
    (XmlToolCallParser, "<tool_call><function=f><parameter=a>" + NESTED + "</parameter></function></tool_call>"),
    (Gemma4ToolParser, "<|tool_call>call:f{a:" + NESTED + "}<tool_call|>"),
    (PythonicCallsParser, "<|tool_call_start|>[f(a=" + NESTED + ")]<|tool_call_end|>"),
], ids=["json", "json-100", "xml", "gemma4", "pythonic"])
def test_parsers_turn_deep_nesting_into_an_invalid_call_with_its_raw_text(parser, text) -> None:
    reader = parser(TOOLS)
    blocks = [b for b in reader.feed(text) + reader.finish() if not isinstance(b, str)]
    assert len(blocks) == 1 and blocks[0].raw == text
    assert [c.error is not None for c in blocks[0].calls] == [True]


@pytest.mark.parametrize(("parser", "text"), [
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"a": [NaN]}}</tool_call>'),
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"a": [1e999]}}</tool_call>'),
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": [-Infinity]}"}</tool_call>'),
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"a": ["\\ud800"]}}</tool_call>'),
    (JsonTagsParser, '<tool_call>{"name": "f", "arguments": {"\\udc00": []}}</tool_call>'),
    (XmlToolCallParser, "<tool_call><function=f><parameter=a>[1j, b'x', ..., {1}]</parameter></function></tool_call>"),
    (XmlToolCallParser, "<tool_call><function=f><parameter=a>[{(1, 2): 3}]</parameter></function></tool_call>"),
    (XmlToolCallParser, "<tool_call><function=f><parameter=a>[NaN]</parameter></function></tool_call>"),
    (Gemma4ToolParser, "<|tool_call>call:f{a:[1e999]}<tool_call|>"),
    (Gemma4ToolParser, '<|tool_call>call:f{a:["\\ud800"]}<tool_call|>'),
    (PythonicCallsParser, "<|tool_call_start|>[f(a=[-1e999])]<|tool_call_end|>"),
    (PythonicCallsParser, '<|tool_call_start|>[f(a=["\\ud800"])]<|tool_call_end|>'),
], ids=["nan", "overflow", "string-infinity", "surrogate", "surrogate-key", "xml-python-values", "xml-tuple-key",
        "xml-nan", "gemma4-overflow", "gemma4-surrogate", "pythonic-overflow", "pythonic-surrogate"])
def test_parsers_turn_arguments_json_cannot_carry_into_an_invalid_call_with_its_raw_text(parser, text) -> None:
    reply = ReplyParser(None, False, parser(TOOLS), lambda: "c1")
    reply.feed(text)
    reply.finish()
    (call,) = reply.calls
    assert call.status == "invalid" and call.raw == text and call.function.arguments == "{}"
    assert "not JSON" in call.error or "lone surrogate" in call.error


def test_a_failing_parser_never_fails_the_turn() -> None:
    class Broken(JsonTagsParser):
        def parse(self, body: str):
            raise KeyError("bug in a plugin")

    blocks = Broken().feed('<tool_call>{"name": "f"}</tool_call>')
    assert blocks[0].calls[0].error is not None and "KeyError" in blocks[0].calls[0].error


# -- cancel and stalled readers --------------------------------------------------------------------------

def test_cancel_stops_prefill_between_chunks(model) -> None:
    calls = {"n": 0}
    cancel = Cancelled()
    module = model.module

    def counting(tokens, cache=None):
        calls["n"] += 1
        cancel.set()
        return module(tokens, cache)

    def run() -> list[int]:
        cache = model.make_prompt_cache()
        reused, pending = cache.prefill(counting, list(range(1, 60)), step=8, cancel=cancel)
        assert len(cache) == 8  # only the first chunk ran
        return pending

    assert model.worker.run(run) == list(range(9, 60)) and calls["n"] == 1


def test_a_half_read_stream_holds_up_nothing_else_and_can_go_on_later() -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    first = model.chat_session()
    config = {**GREEDY, "max_tokens": 40, "logit_bias": {e: -100.0 for e in model.eos_ids}}
    stream = iter(first.send_stream("Hello", config=config))
    next(stream)
    started = time.monotonic()
    other = threading.Thread(target=lambda: model.generate("hi", {"max_tokens": 3}))
    other.start()
    other.join(timeout=30)
    assert not other.is_alive() and time.monotonic() - started < 10
    rest = list(stream)
    assert isinstance(rest[-1], mlxchat.Done) and rest[-1].result.report.generated_tokens == 40
    model.close()
