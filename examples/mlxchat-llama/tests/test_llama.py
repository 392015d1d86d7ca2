"""mlxchat-llama passes mlxchat's conformance kit against transformers, and reads Llama 3.1's JSON tool
calls as the model streams them.

Every fixture under tests/fixtures (built by tests/fixtures/make_fixtures.py with transformers'
LlamaForCausalLM and MistralForCausalLM) must match its oracle; both architectures keep the session
contract."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlxchat
from mlxchat.testing import (
    SessionContract,
    assert_parity,
    batched_decoding_problems,
    fixture_folders,
    full_logits,
    load_fixture,
    reference,
)
from mlxchat_llama import LLAMA, MISTRAL, Llama31JsonParser

FIXTURES = Path(__file__).parent / "fixtures"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_the_entry_point_registers_both_architectures() -> None:
    assert mlxchat.registry().architecture_for("llama") is LLAMA
    assert mlxchat.registry().architecture_for("mistral") is MISTRAL
    assert mlxchat.registry().tool_parsers()["llama3_json"] is Llama31JsonParser


@pytest.mark.parametrize("folder", fixture_folders(FIXTURES), ids=lambda folder: folder.name)
def test_matches_transformers(folder: Path) -> None:
    assert_parity(folder)


@pytest.mark.parametrize("folder", fixture_folders(FIXTURES), ids=lambda folder: folder.name)
def test_a_step_of_several_sequences_equals_each_alone(folder: Path) -> None:
    """Decode rows and a prompt chunk in one pass (the plugin ``runs_ragged``), the window included."""
    model = load_fixture(folder)
    assert batched_decoding_problems(model, [list(range(3, 23)), [5, 9, 2], list(range(40, 75))]) == []


class TestLlamaSessions(SessionContract):
    fixture = FIXTURES / "llama3"


class TestMistralSessions(SessionContract):
    fixture = FIXTURES / "mistral"


@pytest.mark.parametrize(("name", "change"), [
    ("llama3", {"rope_scaling": None}),  # the llama3 frequency scaling
    ("mistral", {"sliding_window": None}),  # the 16-token window, over a 40-token sequence
])
def test_the_fixtures_exercise_what_they_are_for(name: str, change: dict, tmp_path: Path) -> None:
    folder = shutil.copytree(FIXTURES / name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    ref = reference(FIXTURES / name)
    with mlxchat.load_model(folder, dtype="float32") as changed:
        assert np.abs(full_logits(changed, ref["input_ids"]) - ref["logits"]).max() > 1e-2


# -- Llama 3.1 JSON tool calls ---------------------------------------------------------------------


def parse_stream(pieces: list[str]) -> list:
    parser = Llama31JsonParser(TOOLS)
    out = [item for piece in pieces for item in parser.feed(piece)]
    return out + parser.finish()


CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("split", [1, 3, 7, len(CALL)])
def test_a_reply_that_is_a_call_parses_however_it_streams(split: int) -> None:
    pieces = [CALL[i : i + split] for i in range(0, len(CALL), split)]
    (block,) = parse_stream(["  ", *pieces])
    assert block.raw == CALL
    assert [(c.name, c.arguments, c.error) for c in block.calls] == [("get_weather", {"city": "Paris"}, None)]


def test_python_tag_calls_and_several_calls_separated_by_semicolons() -> None:
    second = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    text, block = parse_stream(["Checking. <|python", "_tag|>", CALL, "; ", second])
    assert text == "Checking. "
    assert block.raw == "<|python_tag|>" + CALL + "; " + second
    assert [c.arguments for c in block.calls] == [{"city": "Paris"}, {"city": "Rome"}]


def test_plain_text_streams_through_and_braces_later_stay_text() -> None:
    assert "".join(parse_stream(["Hello", " {not a call}"])) == "Hello {not a call}"


@pytest.mark.parametrize(("reply", "error"), [
    ('{"name": "get_weather", "parameters": {"city": "Par', "invalid JSON"),
    ('{"name": "get_time", "parameters": {}}', "unknown function 'get_time'"),
    ('{"function": "get_weather"}', 'expected {"name"'),
    ("<|python_tag|>", "an empty tool call"),
])
def test_broken_calls_are_kept_as_invalid_calls(reply: str, error: str) -> None:
    (block,) = parse_stream([reply])
    assert block.raw == reply and error in (block.calls[0].error or "")


def test_the_template_takes_tools_and_its_rendered_calls_read_back() -> None:
    model = load_fixture(FIXTURES / "llama3")
    assert model.supports_tools and not load_fixture(FIXTURES / "mistral").supports_tools
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris"}'}}]}]
    text = model.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    assert isinstance(text, str)
    written = text.rsplit("<|end_header_id|>\n\n", 1)[1].removesuffix("<|eot_id|>")
    (block,) = parse_stream([written])
    assert [(c.name, c.arguments) for c in block.calls] == [("get_weather", {"city": "Paris"})]
