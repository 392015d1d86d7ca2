"""The real LFM2 chat templates render through mlxchat exactly as transformers' apply_chat_template renders
them (stored by tests/fixtures/builders/lfm2.py), the {% generation %} tag included; the Pythonic calls
the LFM2.5 templates write parse back to the same arguments."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlxchat.chat_template import ChatTemplate
from mlxchat.errors import TemplateError
from mlxchat.tokenizer import Tokenizer
from mlxchat.tools.parsing import CallBlock
from mlxchat_lfm2.tool_calls import PythonicCallsParser

from conftest import FIXTURES, fixture_path

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
RENDERS = json.loads((FIXTURES / "lfm2_templates" / "renders.json").read_text())
CASES, EXPECTED = RENDERS["cases"], RENDERS["renders"]
TOKENIZER = Tokenizer.from_folder(fixture_path("lfm2"))
_DATE = re.compile(r"Today's date: \d{4}-\d{2}-\d{2}")


def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), TOKENIZER)


def undated(text: str) -> str:
    """lfm2.5-8b-a1b writes today's date (strftime_now) into the system turn."""
    return _DATE.sub("Today's date: <date>", text)


def render(name: str, case: dict) -> str:
    return template(name).render(case["messages"], tools=case.get("tools"),
                                 add_generation_prompt=case.get("add_generation_prompt", True),
                                 **case.get("kwargs", {}))


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("case", sorted(CASES))
def test_renders_like_transformers(name: str, case: str) -> None:
    expected = EXPECTED[name][case]
    if "error" in expected:
        with pytest.raises(TemplateError):
            render(name, CASES[case])
    else:
        assert undated(render(name, CASES[case])) == undated(expected["text"])


def test_generation_tag_templates_are_covered() -> None:
    tagged = {n for n in EXPECTED if "{%- generation -%}" in (TEMPLATES / n).read_text()}
    assert tagged == {"lfm2.5.jinja", "lfm2.5-8b-a1b.jinja"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_templates_that_never_mention_tool_calls_drop_them(name: str) -> None:
    """lfm2.jinja and lfm2.5-1.2b-instruct.jinja ignore ``tool_calls`` (and fail on an assistant turn without
    content); a session must keep the raw call text in the content for them."""
    mentions = "tool_calls" in (TEMPLATES / name).read_text()
    assert ("<|tool_call_start|>" in EXPECTED[name]["tools_round_trip"]["text"]) == mentions
    assert ("error" in EXPECTED[name]["call_without_content"]) == (not mentions)
    assert "<|tool_call_start|>[get_weather(city=\"Paris\")]" in EXPECTED[name]["raw_call_in_content"]["text"]


@pytest.mark.parametrize("name", ["lfm2.5.jinja", "lfm2.5-8b-a1b.jinja"])
def test_rendered_calls_parse_back(name: str) -> None:
    case = CASES["tools_round_trip"]
    calls = [c["function"] for m in case["messages"] for c in m.get("tool_calls", [])]
    parser = PythonicCallsParser(case["tools"])
    blocks = [b for b in parser.feed(render(name, case)) + parser.finish() if isinstance(b, CallBlock)]
    assert [(c.name, c.arguments, c.error) for b in blocks for c in b.calls] == [
        (c["name"], c["arguments"], None) for c in calls]


def test_prompt_starts_with_one_bos() -> None:
    bos = TOKENIZER.token_id("<|startoftext|>")
    ids = template("lfm2.jinja").encode([{"role": "user", "content": "hi"}])
    assert ids[0] == bos and ids.count(bos) == 1
    assert TOKENIZER.encode("hi", add_special_tokens=True)[0] == bos  # a raw prompt: from the tokenizer
