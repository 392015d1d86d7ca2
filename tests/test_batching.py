"""Sequences decode together: concurrent generations, several sessions driven from threads and
``generate_batch`` share each decode step (one pass over the weights), and every sequence gets exactly what
it gets alone. (That one batched step equals each row alone, on every architecture, is in the conformance
kit: ``batched_decoding_problems``.)"""

from __future__ import annotations

import threading

import pytest

import mlxchat
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
