"""Sequences decode together: concurrent generations, several sessions driven from threads, server requests
and ``generate_batch`` share each decode step (one pass over the weights), and every sequence gets exactly
what it gets alone, whoever leaves early; a failed step fails only the generations in it. (That one batched
step equals each row alone, on every architecture, is in the conformance kit: ``batched_decoding_problems``.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import mlxchat
from mlxchat import GenerationError, batching
from mlxchat.batching import DecodeRow
from mlxchat.testing import GREEDY

from conftest import fixture_path

PROMPTS = ["Hello there", "What is the capital of France?", "Tell me a number", "And of Italy?"]


@pytest.fixture
def steps(monkeypatch) -> list[int]:
    """The number of rows of every decode step the worker runs."""
    sizes: list[int] = []
    real = DecodeRow.run_together.__func__  # type: ignore[attr-defined]

    def counted(cls, rows):
        sizes.append(len(rows))
        return real(cls, rows)

    monkeypatch.setattr(DecodeRow, "run_together", classmethod(counted))
    return sizes


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "lfm2", "gemma4"])
def test_generate_batch_equals_each_prompt_alone_and_decodes_together(name: str, steps: list[int]) -> None:
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    config = {**GREEDY, "max_tokens": 16}
    alone = [model.generate(p, config) for p in PROMPTS]
    steps.clear()
    together = model.generate_batch(PROMPTS, config)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert max(steps) == len(PROMPTS)  # all four in one step
    model.close()


def test_sessions_driven_from_threads_decode_together_and_equal_sessions_alone(steps: list[int]) -> None:
    model = mlxchat.load_model(fixture_path("qwen3_5"), dtype="float32")
    config = {**GREEDY, "max_tokens": 20}

    def conversation() -> list[list[int]]:
        session = model.chat_session(system="Be terse.")
        return [session.send(q, config=config).tokens for q in ("Hello there", "And of Italy?")]

    expected = conversation()
    steps.clear()
    results: list[list[list[int]]] = []
    threads = [threading.Thread(target=lambda: results.append(conversation())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected] * 4
    assert max(steps) > 1  # the sessions' steps ran together
    model.close()


def test_a_failed_step_fails_the_generations_in_it_and_the_model_goes_on(monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    config = {**GREEDY, "max_tokens": 12}
    alone = [model.generate(p, config).tokens for p in PROMPTS[:3]]
    real, calls = batching.batched_last_logits, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(batching, "batched_last_logits", failing)
    with pytest.raises(GenerationError, match="injected failure"):
        model.generate_batch(PROMPTS[:3], config)
    monkeypatch.undo()
    assert [r.tokens for r in model.generate_batch(PROMPTS[:3], config)] == alone
    model.close()


def test_a_stream_left_mid_batch_stops_alone_and_the_others_finish_as_alone(steps: list[int]) -> None:
    model = mlxchat.load_model(fixture_path("lfm2"), dtype="float32")
    config = {**GREEDY, "max_tokens": 16}
    alone = [model.generate(p, config).tokens for p in PROMPTS[1:]]
    steps.clear()
    start = threading.Barrier(len(PROMPTS))
    results: dict[int, list[int]] = {}
    left: list[int] = []

    def full(index: int) -> None:
        start.wait()
        results[index] = [c.token for c in model.stream(PROMPTS[index], config) if c.token is not None]

    def leaving() -> None:
        start.wait()
        for chunk in model.stream(PROMPTS[0], config):
            left.append(chunk.token)
            if len(left) == 3:
                break

    threads = [threading.Thread(target=leaving)] + [threading.Thread(target=full, args=(i,)) for i in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(left) == 3 and [results[i] for i in (1, 2, 3)] == alone
    assert max(steps) > 1
    model.close()


def test_concurrent_server_requests_decode_together(steps: list[int]) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from server_support import serving

    model = mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32")
    with serving("qwen3_chat", model) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def ask(question: str) -> str | None:
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
            return reply.choices[0].message.content

        alone = [ask(q) for q in PROMPTS]
        steps.clear()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(ask, PROMPTS))
    assert together == alone
    assert max(steps) > 1
    model.close()
