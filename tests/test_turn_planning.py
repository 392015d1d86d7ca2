"""A turn is planned before its job reaches the worker: rendering and tokenizing run on the reader's side
(a thread, or a thread beside the event loop), never inside the worker's steps; and a cold cache under a
long transcript renders a bounded number of prefixes (not one per reply) while keeping the same snapshots."""

from __future__ import annotations

import asyncio

import pytest

import mlxchat
from mlxchat.testing import GREEDY

from conftest import fixture_path

CONFIG = {**GREEDY, "max_tokens": 4}


def transcript(turns: int) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    return messages + [{"role": "user", "content": "And now?"}]


@pytest.fixture
def renders(monkeypatch) -> tuple[mlxchat.GenerativeModel, list[bool]]:
    """A hybrid model whose renders are logged: whether each ran on the worker."""
    model = mlxchat.load_model(fixture_path("qwen3_5"), dtype="float32")
    log: list[bool] = []
    render = model.render_prompt

    def logged(*args, **kwargs):
        log.append(model.worker.on_worker)
        return render(*args, **kwargs)

    monkeypatch.setattr(model, "render_prompt", logged)
    yield model, log
    model.close()


def test_a_turn_is_rendered_off_the_worker_sync_and_async(renders) -> None:
    model, log = renders
    session = model.chat_session(system="Be terse.")
    session.send("Hello", config=CONFIG)
    asyncio.run(session.asend("And again?", config=CONFIG))
    assert log and not any(log)


@pytest.mark.parametrize("turns", [20, 40])
def test_a_cold_cache_under_a_long_transcript_renders_a_bounded_number_of_prefixes(renders, turns: int) -> None:
    model, log = renders
    session = model.chat_session(system="Be terse.")
    session.prime_history(transcript(turns))
    session.start_from_history(config=CONFIG)
    assert len(log) <= session.cache.max_snapshots + 4  # the prompt, two probes, the next turn's; not one a reply
    # The same snapshots as with every reply's start computed: the latest the cache keeps.
    wide = model.chat_session(system="Be terse.", cache=model.make_prompt_cache(max_snapshots=10 * turns))
    wide.prime_history(transcript(turns))
    wide.start_from_history(config=CONFIG)
    assert len(wide.cache.snapshot_positions) > session.cache.max_snapshots
    assert session.cache.snapshot_positions == wide.cache.snapshot_positions[-session.cache.max_snapshots:]
