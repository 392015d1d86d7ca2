"""The OpenAI-compatible API, driven by the official ``openai`` client against a real uvicorn server:
completions with reasoning and tool calls, streaming, and prompts served from the cache across requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from server_support import serving as served  # noqa: E402

SCRIPTS = json.loads((Path(__file__).resolve().parent / "data" / "chat_scripts.json").read_text())
TOOLS = [SCRIPTS["tools"]["get_weather"]]
SYSTEM = {"role": "system", "content": "You are a test assistant."}


@contextmanager
def serving(fixture: str) -> Iterator[openai.OpenAI]:
    """A uvicorn server of the fixture model on a free port, and a client of it."""
    with served(fixture) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with serving("qwen3_chat") as c:
        yield c


def test_lists_the_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_conversation_reuses_the_cache_across_requests(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0)
    message = first.choices[0].message
    assert message.content == "Hi! How can I help?" and first.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "A greeting."
    messages += [{"role": "assistant", "content": message.content},
                 {"role": "user", "content": "What is 2 plus 3?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0)
    assert second.choices[0].message.content == "5."
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1 and second.usage.prompt_tokens > cached


def test_tool_calls_and_their_results(client: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris, Rome and Oslo?"}]
    asked = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                           temperature=0)
    assert asked.choices[0].finish_reason == "tool_calls"
    calls = asked.choices[0].message.tool_calls
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {"city": "Rome"}),
        ("call_3", "get_weather", {"city": "Oslo"})]
    messages.append(asked.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, ["sunny", "rain", "snow"],
                                                                                          strict=True)]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                            temperature=0)
    assert answer.choices[0].message.content == "Paris is sunny, Rome has rain, Oslo has snow."
    assert answer.usage.prompt_tokens_details.cached_tokens > asked.usage.prompt_tokens


def test_streaming_sends_reasoning_text_and_calls_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        max_tokens=200, temperature=0, stream=True, stream_options={"include_usage": True})
    reasoning, text, calls, finish, usage = "", "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert reasoning == "I need the weather tool." and text == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens > 0


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="respond"):
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "hi"}])


def test_messages_the_template_rejects_are_a_bad_request() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [SYSTEM, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "{}"}]
    with serving("qwen3_5") as client:  # Qwen3.5's template raises when no user message asked anything
        with pytest.raises(openai.BadRequestError, match="No user query") as raised:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        assert raised.value.body["type"] == "invalid_request_error"
        ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, temperature=0.0)
        # The failed request returned its cache to the pool: the next one is served.
        assert ok.choices[0].finish_reason in ("length", "stop") and ok.usage and ok.usage.prompt_tokens > 0


# -- chat.completions, completed (on the demo model, which calls its tools for real) -------------------------

from mlxchat.demo.world import DEMO_TOOLS  # noqa: E402

from server_support import DEMO  # noqa: E402

DEMO_SCHEMAS = [t.schema for t in DEMO_TOOLS]
WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def demo() -> Iterator[openai.OpenAI]:
    with served("demo") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def calls_of(completion) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in completion.choices[0].message.tool_calls or []]


def test_the_served_model_is_named_after_the_checkpoint(demo: openai.OpenAI, tmp_path: Path) -> None:
    from mlxchat.server.state import served_name

    assert [m.id for m in demo.models.list()] == [DEMO]
    snapshot = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "0123abcd"
    model = type("Stub", (), {"path": snapshot, "architecture": None})()
    assert served_name(model) == "Qwen/Qwen3-0.6B"
    model.path = tmp_path / "my-finetune"
    assert served_name(model) == "my-finetune"
    with pytest.raises(openai.NotFoundError) as raised:
        demo.chat.completions.create(model="gpt-4o", messages=WEATHER)
    assert raised.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(("choice", "expected"), [
    ("auto", [("get_weather", {"city": "Paris"})]),
    ("none", []),
    ("required", [("get_weather", {"city": "Paris"})]),
    ({"type": "function", "function": {"name": "get_time"}}, [("get_time", {"city": "Paris"})]),
])
def test_tool_choice_is_honoured(demo: openai.OpenAI, choice, expected) -> None:
    reply = demo.chat.completions.create(model=DEMO, messages=WEATHER, tools=DEMO_SCHEMAS, tool_choice=choice,
                                         temperature=0)
    assert calls_of(reply) == expected
    assert reply.choices[0].finish_reason == ("tool_calls" if expected else "stop")


def test_a_required_call_comes_even_for_a_question_that_needs_none(demo: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    assert calls_of(demo.chat.completions.create(model=DEMO, messages=messages, tools=DEMO_SCHEMAS,
                                                 temperature=0)) == []
    forced = demo.chat.completions.create(model=DEMO, messages=messages, tools=DEMO_SCHEMAS, tool_choice="required",
                                          temperature=0)
    assert len(calls_of(forced)) == 1 and forced.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(demo: openai.OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "What's the weather in Lima and the time in Oslo?"}]
    both = demo.chat.completions.create(model=DEMO, messages=messages, tools=DEMO_SCHEMAS, temperature=0)
    assert [name for name, _ in calls_of(both)] == ["get_weather", "get_time"]
    if not stream:
        one = demo.chat.completions.create(model=DEMO, messages=messages, tools=DEMO_SCHEMAS, temperature=0,
                                           parallel_tool_calls=False)
        assert calls_of(one) == calls_of(both)[:1] and one.choices[0].finish_reason == "tool_calls"
        return
    chunks = list(demo.chat.completions.create(model=DEMO, messages=messages, tools=DEMO_SCHEMAS, temperature=0,
                                               parallel_tool_calls=False, stream=True))
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_are_the_models_own(demo: openai.OpenAI) -> None:
    from server_support import demo_model

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = demo.chat.completions.create(model=DEMO, messages=messages, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - 1  # the end-of-turn token is not part of the reply
    for entry in content:  # greedy: each token is its place's likeliest
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    model = demo_model()
    prompt = model.apply_chat_template(messages)
    tokens = [model.tokenizer.token_id(e.token) or model.tokenizer.encode(e.token)[0] for e in content]
    logits = model.logits(prompt + tokens)
    oracle = [float(logits[len(prompt) - 1 + i, t] - mx.logsumexp(logits[len(prompt) - 1 + i]))
              for i, t in enumerate(tokens)]
    assert [e.logprob for e in content] == pytest.approx(oracle, abs=1e-4)
    chunks = list(demo.chat.completions.create(model=DEMO, messages=messages, temperature=0, logprobs=True,
                                               stream=True))
    streamed = [e for chunk in chunks for choice in chunk.choices if choice.logprobs
                for e in choice.logprobs.content or []]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_n_choices_are_replies_to_the_same_prompt(demo: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    greedy = demo.chat.completions.create(model=DEMO, messages=messages, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content == "12 + 30 = 42."
    sampled = demo.chat.completions.create(model=DEMO, messages=messages, temperature=1.5, seed=3, n=3)
    assert len(sampled.choices) == 3
    alone = demo.chat.completions.create(model=DEMO, messages=messages, temperature=1.5, seed=3)
    assert sampled.choices[0].message.content == alone.choices[0].message.content
    assert sampled.usage.completion_tokens > alone.usage.completion_tokens
    chunks = list(demo.chat.completions.create(model=DEMO, messages=messages, temperature=0, n=2, stream=True))
    texts = ["".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
             for i in (0, 1)]
    assert texts == ["12 + 30 = 42."] * 2
