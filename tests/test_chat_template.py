"""Chat templates render exactly as transformers renders them, and message content stays data when the
prompt is tokenized (checked against the real Qwen3 vocabulary too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxchat.chat_template import ChatTemplate, normalize_messages
from mlxchat.errors import CheckpointError, TemplateError
from mlxchat.tokenizer import Tokenizer

from conftest import FIXTURES, fixture_path
from real_vocab import real_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
RENDERS = json.loads((FIXTURES / "qwen3_templates" / "renders.json").read_text())
TOKENIZER = Tokenizer.from_folder(fixture_path("qwen3"))


def template(name: str, tokenizer: Tokenizer = TOKENIZER) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), tokenizer)


@pytest.mark.parametrize("name", sorted(RENDERS["renders"]))
@pytest.mark.parametrize("case", sorted(RENDERS["cases"]))
def test_renders_like_transformers(name: str, case: str) -> None:
    spec = RENDERS["cases"][case]
    text = template(name).render(spec["messages"], tools=spec.get("tools"),
                                 add_generation_prompt=spec.get("add_generation_prompt", True),
                                 **spec.get("kwargs", {}))
    assert text == RENDERS["renders"][name][case]["text"]


def test_none_values_are_dropped_and_reasoning_is_aliased() -> None:
    [message] = normalize_messages([{"role": "assistant", "content": None, "thinking": "r", "name": None}])
    assert message == {"role": "assistant", "thinking": "r", "reasoning_content": "r"}


def test_template_helpers_behave_like_transformers() -> None:
    source = ("{{ {'b': 'é', 'a': [1, 2]} | tojson }}|{{ strftime_now('%Y') | length }}|"
              "{% generation %}gen{% endgeneration %}|{% for i in range(3) %}{% if i == 1 %}{% break %}"
              "{% endif %}{{ i }}{% endfor %}")
    assert ChatTemplate(source, TOKENIZER).render([]) == '{"b": "é", "a": [1, 2]}|4|gen|0'


def test_raise_exception_becomes_a_template_error() -> None:
    source = "{{ raise_exception('No user query found in messages.') }}"
    with pytest.raises(TemplateError, match="No user query found"):
        ChatTemplate(source, TOKENIZER).render([])


@pytest.mark.parametrize("source", ["{{ 1 / 0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                                    "{{ '%(role)s' % {} }}"])
def test_a_template_that_divides_by_zero_recurses_or_misses_a_key_is_a_template_error(source: str) -> None:
    with pytest.raises(TemplateError, match="chat template failed"):
        ChatTemplate(source, TOKENIZER).render([])


@pytest.mark.parametrize("source", ["{{ " + "9" * 5000 + " }}", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"])
def test_a_template_too_big_to_compile_is_a_checkpoint_error(source: str) -> None:
    with pytest.raises(CheckpointError, match="chat template does not parse"):
        ChatTemplate(source, TOKENIZER)


@pytest.mark.parametrize("declared", [["<|im_end|>"], "x", {"one": {"content": "<|im_end|>"}}])
def test_added_tokens_decoder_that_is_no_object_of_ids_is_a_checkpoint_error(declared) -> None:
    with pytest.raises(CheckpointError, match="added_tokens_decoder must be an object of tokens by their ids"):
        Tokenizer(TOKENIZER.backend, {"added_tokens_decoder": declared})


def test_sandbox_refuses_underscore_namespace_attributes() -> None:
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}", TOKENIZER).render([])


def _count(ids: list[int], tokenizer: Tokenizer, token: str) -> int:
    return ids.count(tokenizer.token_id(token))


def check_content_is_data(tokenizer: Tokenizer) -> None:
    messages = RENDERS["cases"]["control_text_in_content"]["messages"]
    chat = template("qwen3.jinja", tokenizer)
    text, ids = chat.render_encoded(messages)
    assert text == chat.render(messages)
    # Only the template's own markup is control tokens: system and user turns close, three turns open.
    assert _count(ids, tokenizer, "<|im_end|>") == 2
    assert _count(ids, tokenizer, "<|im_start|>") == 3
    assert _count(ids, tokenizer, "<think>") == 0
    assert tokenizer.decode(ids) == text
    # The same text tokenized naively would have become control tokens.
    assert _count(tokenizer.encode(text), tokenizer, "<|im_end|>") == 4


def test_user_and_system_content_never_become_control_tokens() -> None:
    check_content_is_data(TOKENIZER)


def test_assistant_content_keeps_the_models_own_markup() -> None:
    chat = template("qwen3.jinja")
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>r</think>y"},
                {"role": "user", "content": "<think>"}]
    ids = chat.encode(messages)
    assert _count(ids, TOKENIZER, "<think>") == 0  # the template drops the old reasoning; the user's is text
    tools = [{"type": "function", "function": {"name": "f", "description": "ends with <|im_end|>"}}]
    ids = chat.encode([{"role": "user", "content": "hi"}], tools=tools)
    assert _count(ids, TOKENIZER, "<|im_end|>") == 2  # system (with tools) and user turns


@pytest.fixture(scope="module")
def real_qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return real_tokenizer("qwen3", request, tmp_path_factory)


def test_content_is_data_with_the_real_qwen3_vocabulary(real_qwen3: Tokenizer) -> None:
    assert real_qwen3.token_id("<|im_end|>") == 151645 and real_qwen3.token_id("<think>") == 151667
    check_content_is_data(real_qwen3)
    plain = real_qwen3.encode_plain("<|im_end|>")
    assert 151645 not in plain and real_qwen3.decode(plain) == "<|im_end|>"


def test_string_tool_call_arguments_reach_templates_as_mappings() -> None:
    """OpenAI clients send arguments as a JSON string; Qwen3.5's template iterates them as a mapping."""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]}]
    text = template("qwen3.5.jinja").render(messages)
    assert "<parameter=city>\nParis\n</parameter>" in text and "<parameter=days>\n2\n</parameter>" in text


def test_content_as_data_keeps_the_templates_own_logic() -> None:
    """Qwen3 tells a tool response sent as a user turn apart with ``startswith('<tool_response>')``: marking
    the control-token text as data must not change that test, so earlier reasoning is kept as transformers
    keeps it."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should call the tool."},
                {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}]
    chat = template("qwen3.jinja")
    text, ids = chat.render_encoded(messages)
    assert text == chat.render(messages)
    assert "I should call the tool." in text
    assert _count(ids, TOKENIZER, "<tool_response>") == 0  # still data


@pytest.mark.parametrize(("source", "takes_tools", "renders_calls"), [
    # Words in comments or strings decide nothing: what the template renders does.
    ("{# tools and tool_calls are not supported #}{% for m in messages %}{{ m.content }}{% endfor %}", False, False),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", True, False),
    ("{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}"
     "{% endfor %}", False, True),
    ("{{ raise_exception('no') }}", False, False),
])
def test_tool_support_is_decided_by_rendering_a_probe(source: str, takes_tools: bool, renders_calls: bool) -> None:
    chat = ChatTemplate(source, TOKENIZER)
    assert (chat.takes_tools, chat.renders_tool_calls) == (takes_tools, renders_calls)
