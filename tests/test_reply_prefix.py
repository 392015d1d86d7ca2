"""A forced reply prefix (``GenerationConfig.reply_prefix``): its tokens count as the reply's first, the cache
holds exactly what the model saw, and with ``reply_prefix_after`` it follows the model's reasoning (the
token sampled after the closer is dropped, never fed), on a full-attention and a hybrid model. Every
tool-call format's ``forced_prefix`` is the start of the call markup its chat template writes."""

from __future__ import annotations

import pytest

import mlxchat
from mlxchat.testing import fixture_folders, load_fixture

from conftest import FIXTURES, loaded

PROMPT = [5, 77, 300, 12, 9, 41]
AFTER = ("<think>", "</think>")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def special(model: mlxchat.GenerativeModel, text: str) -> int:
    token = model.tokenizer.token_id(text)
    assert token is not None
    return token


def assert_cache_is_what_the_model_saw(model: mlxchat.GenerativeModel, cache: mlxchat.PromptCache) -> None:
    """A next token from the cache equals one from a fresh run over the same tokens."""
    follow = [*cache.tokens, 7]
    config = {"max_tokens": 3, "temperature": 0.0}
    again = model.generate(follow, config, cache=cache)
    assert again.report.cached_prompt_tokens == len(follow) - 1
    assert again.tokens == model.generate(follow, config).tokens


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_a_prefix_at_once_is_the_start_of_the_reply(name, scripted) -> None:
    model = loaded(name)
    prefix = model.tokenizer.encode("<tool_call>\nhello")
    scripted.append([50, 51, 52])
    cache = model.make_prompt_cache()
    result = model.generate(PROMPT, {"max_tokens": 5, "reply_prefix": "<tool_call>\nhello"}, cache=cache)
    assert result.tokens == [*prefix, 50, 51, 52][:5]
    assert result.report.prompt_tokens == len(PROMPT) and result.report.generated_tokens == 5
    assert cache.tokens == [*PROMPT, *result.tokens[:-1]]  # the last token was never fed
    assert_cache_is_what_the_model_saw(model, cache)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_a_prefix_after_reasoning_follows_the_closer_and_drops_the_next_token(name, scripted) -> None:
    model = loaded(name)
    think, close, end = special(model, "<think>"), special(model, "</think>"), special(model, "<|im_end|>")
    prefix = model.tokenizer.encode("<tool_call>")
    dropped = 99
    scripted.append([think, 60, 61, close, dropped, 70, 71, end])
    cache = model.make_prompt_cache()
    result = model.generate(PROMPT, {"max_tokens": 30, "reply_prefix": "<tool_call>", "reply_prefix_after": AFTER},
                            cache=cache)
    assert result.tokens == [think, 60, 61, close, *prefix, 70, 71]
    assert result.finish_reason == "stop" and result.report.generated_tokens == len(result.tokens) + 1
    assert cache.tokens == [*PROMPT, *result.tokens, end]
    assert_cache_is_what_the_model_saw(model, cache)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_a_reply_that_does_not_reason_gets_the_prefix_at_once(name, scripted) -> None:
    model = loaded(name)
    prefix = model.tokenizer.encode("<tool_call>")
    scripted.append([42, 70, 71, special(model, "<|im_end|>")])  # 42 opens no reasoning: dropped
    cache = model.make_prompt_cache()
    result = model.generate(PROMPT, {"max_tokens": 30, "reply_prefix": "<tool_call>", "reply_prefix_after": AFTER},
                            cache=cache)
    assert result.tokens == [*prefix, 70, 71]
    assert_cache_is_what_the_model_saw(model, cache)


def test_a_prompt_that_opened_reasoning_waits_for_its_closer(scripted) -> None:
    model = loaded("qwen3")
    close = special(model, "</think>")
    scripted.append([60, close, 99, 70, special(model, "<|im_end|>")])
    result = model.generate(PROMPT, {"max_tokens": 30, "reply_prefix": "<tool_call>",
                                     "reply_prefix_after": ("", "</think>")})
    assert result.tokens == [60, close, *model.tokenizer.encode("<tool_call>"), 70]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("after", [AFTER, ("", "</think>")])
def test_a_closer_that_is_the_decoders_first_token_is_fed_before_the_prefix(name, after, scripted) -> None:
    """The decoder's first token reaches the reader before its forward pass is queued (the first token is not
    held back a step): stopped there, the cache lacks it, so it goes in with the prefix (and no token was
    sampled after it: none is dropped)."""
    model = loaded(name)
    think, close, end = special(model, "<think>"), special(model, "</think>"), special(model, "<|im_end|>")
    opened = [think] if after[0] else []
    scripted.append([*opened, close, 99, 70, end])
    cache = model.make_prompt_cache()
    result = model.generate(PROMPT, {"max_tokens": 30, "reply_prefix": "<tool_call>", "reply_prefix_after": after},
                            cache=cache)
    assert result.tokens == [*opened, close, *model.tokenizer.encode("<tool_call>"), 99, 70]
    assert cache.tokens == [*PROMPT, *result.tokens, end]
    assert_cache_is_what_the_model_saw(model, cache)


def test_a_prefix_after_reasoning_stays_within_max_tokens(scripted) -> None:
    model = loaded("qwen3")
    think, close = special(model, "<think>"), special(model, "</think>")
    prefix = model.tokenizer.encode("<tool_call>\nhello there")
    scripted.append([think, 60, close, 99, 70])
    result = model.generate(PROMPT, {"max_tokens": 5, "reply_prefix": "<tool_call>\nhello there",
                                     "reply_prefix_after": AFTER})
    assert result.tokens == [think, 60, close, *prefix[:2]] and result.finish_reason == "length"


def test_the_prefix_counts_against_max_tokens() -> None:
    model = loaded("qwen3")
    prefix = model.tokenizer.encode("<tool_call>\nhello there")
    assert len(prefix) > 2
    cache = model.make_prompt_cache()
    result = model.generate(PROMPT, {"max_tokens": 2, "reply_prefix": "<tool_call>\nhello there"}, cache=cache)
    assert result.tokens == prefix[:2] and result.finish_reason == "length"
    assert cache.tokens == [*PROMPT, *prefix[:2]][: len(cache.tokens)]  # nothing decoded: nothing more fed


TOOL_FIXTURES = [f for f in fixture_folders(FIXTURES, variants=False)
                 if load_fixture(f).supports_tools and load_fixture(f).renders_tool_calls]


@pytest.mark.parametrize("folder", TOOL_FIXTURES, ids=lambda f: f.name)
def test_every_formats_forced_prefix_starts_the_call_its_template_writes(folder) -> None:
    model = load_fixture(folder)
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "",
                                                                     "tool_calls": [CALL]}]
    head = model.render_text(messages[:1], tools=TOOLS, add_generation_prompt=False)
    written = model.render_text(messages, tools=TOOLS, add_generation_prompt=False)[len(head):]
    parser = model.tool_parser(TOOLS)
    assert parser is not None
    for name in (None, "get_weather"):
        prefix = parser.forced_prefix(name)
        assert prefix and prefix in written, (prefix, written)
        rest = written[written.index(prefix):]
        calls = [item for item in [*parser.feed(rest), *parser.finish()] if not isinstance(item, str)]
        assert [(c.name, c.arguments) for block in calls for c in block.calls] == [("get_weather", {"city": "Paris"})]
        parser = model.tool_parser(TOOLS)
