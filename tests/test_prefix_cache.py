"""Shared prefixes: conversations that start alike (a long system prompt) copy the prefix another one
prefilled, from a pool over all their caches, busy or idle, never taking another conversation's cache; in
the library (``PromptCachePool`` shared by sessions) and behind the server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import mlxchat
from mlxchat import PromptCachePool
from mlxchat.prompt_cache import common_prefix_length
from mlxchat.testing import GREEDY

from conftest import fixture_path, hold_worker_until_queued

SYSTEM = " ".join(f"Rule {i}: answer briefly and name your sources." for i in range(30))
QUESTIONS = ["What is the capital of France?", "Tell me a number", "And of Italy?", "Hello there"]


def user_start(model: mlxchat.GenerativeModel) -> int:
    """Tokens every conversation with ``SYSTEM`` shares: up to where its first user message's content starts."""
    probes = [model.render_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])[1]
              for text in ("a", "b")]
    return common_prefix_length(*probes)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "lfm2", "gemma4"])
def test_new_conversations_at_once_copy_the_system_prompt_another_conversation_prefilled(name: str) -> None:
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    config = {**GREEDY, "max_tokens": 8}
    alone = [model.chat_session(system=SYSTEM).send(q, config=config) for q in QUESTIONS]
    assert all(r.report.cached_prompt_tokens == 0 for r in alone)
    unshared = model.chat_session(system=SYSTEM)
    unshared.send("Hello", config=config)
    follow_up = unshared.send("And again?", config=config)
    pool = PromptCachePool()
    first = model.chat_session(system=SYSTEM, prefix_cache=pool)
    first.send("Hello", config=config)
    held = list(first.cache.tokens)
    sessions = [model.chat_session(system=SYSTEM, prefix_cache=pool) for _ in QUESTIONS]
    with ThreadPoolExecutor(len(sessions)) as threads:
        together = list(threads.map(lambda s, q: s.send(q, config=config), sessions, QUESTIONS))
    shared = user_start(model)
    assert shared > 300
    assert all(r.report.cached_prompt_tokens >= shared for r in together)  # was [n, 0, 0, 0] before the pool
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert first.cache.tokens == held  # copied from, never cut back
    again = first.send("And again?", config=config)  # reuses its own cache as if it had shared nothing
    assert again.tokens == follow_up.tokens
    assert again.report.cached_prompt_tokens == follow_up.report.cached_prompt_tokens
    model.close()


def test_quantized_kv_conversations_read_a_copied_system_prompt_where_it_lies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 8-bit KV the copies read the first conversation's packed system prompt where it lies (one prefix for
    every layer of every conversation), and reply exactly as when each holds a copy of its own."""
    from mlxchat.cache import QuantizedKVCache

    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32", kv_bits=8, kv_group_size=32)
    config = {**GREEDY, "max_tokens": 8}

    def conversations() -> tuple[list[list[int]], list[mlxchat.ChatSession]]:
        pool = PromptCachePool()
        first = model.chat_session(system=SYSTEM, prefix_cache=pool)
        first.send("Hello", config=config)
        sessions = [model.chat_session(system=SYSTEM, prefix_cache=pool) for _ in QUESTIONS]
        replies = [s.send(q, config=config) for s, q in zip(sessions, QUESTIONS, strict=True)]
        assert all(r.report.cached_prompt_tokens >= user_start(model) for r in replies)
        return [r.tokens for r in replies], [first, *sessions]

    shared, sessions = conversations()
    for i in range(len(sessions[0].cache.layers)):
        prefixes = {id(s.cache.layers[i].packed_prefix) for s in sessions}
        assert len(prefixes) == 1 and sessions[0].cache.layers[i].packed_prefix is not None
    with monkeypatch.context() as patch:
        patch.setattr(QuantizedKVCache, "can_copy_from", lambda self, source: False)  # a copy each, as before
        copied, sessions = conversations()
        assert all(layer.packed_prefix is None for s in sessions for layer in s.cache.layers)
    assert shared == copied
    model.close()


def test_a_conversation_copies_a_prefix_from_a_busy_one_and_a_closed_one_drops_out() -> None:
    model = mlxchat.load_model(fixture_path("qwen3_5"), dtype="float32")
    model.prefix_cache = PromptCachePool()  # every session of the model shares it
    config = {**GREEDY, "max_tokens": 6}
    first = model.chat_session(system=SYSTEM)
    stream = first.send_stream("Hello", config=config)
    events = iter(stream)
    next(events)  # the first conversation is mid-reply
    second = model.chat_session(system=SYSTEM).send("Hi", config=config)
    assert second.report.cached_prompt_tokens >= user_start(model)
    for _ in events:
        pass
    assert len(model.prefix_cache) == 2
    first.close()
    assert len(model.prefix_cache) == 1
    model.close()


def test_server_conversations_sharing_a_system_prompt_each_report_it_cached() -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from server_support import serving

    model = mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32")
    with serving("qwen3_chat", model) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def ask(question: str) -> int:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
            return reply.usage.prompt_tokens_details.cached_tokens

        assert ask("Hello") == 0
        with ThreadPoolExecutor(4) as threads:
            cached = list(threads.map(ask, QUESTIONS))
    assert min(cached) >= user_start(model)  # each of the four, not only the one that took the idle cache
    model.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_conversations_arriving_together_prefill_their_shared_system_prompt_once(name: str, monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    config = {**GREEDY, "max_tokens": 6}
    alone = [model.chat_session(system=SYSTEM).send(q, config=config).tokens for q in QUESTIONS]
    pool = PromptCachePool()
    sessions = [model.chat_session(system=SYSTEM, prefix_cache=pool) for _ in QUESTIONS]
    hold_worker_until_queued(model, len(QUESTIONS), monkeypatch)  # the four wait together, none prefilled yet
    with ThreadPoolExecutor(len(sessions)) as threads:
        together = list(threads.map(lambda s, q: s.send(q, config=config), sessions, QUESTIONS))
    cached = sorted(r.report.cached_prompt_tokens for r in together)
    assert cached[0] == 0 and cached[1] >= user_start(model)  # the first in line prefilled it; the others copied
    assert [r.tokens for r in together] == alone
    model.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_decode_rows_that_copied_one_prefix_read_it_once_with_their_own_logits(name: str, monkeypatch) -> None:
    """Caches that copied a prefix from the pool's source read it where it lies (one shared prefix, held once); a
    decode step of them together attends over the shared keys once (cascade attention) and gives each row the
    logits of its own step."""
    import mlx.core as mx

    from mlxchat.batching import batched_last_logits
    from mlxchat.cache import KVCache, distinct_nbytes
    from mlxchat.layers import attention
    from mlxchat.prompt_cache import last_logits_of

    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    prompt = model.render_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])[1]
    assert len(prompt) > attention.SHARED_PREFIX_MIN

    copied = len(prompt) - 2

    def fill(cache, ids) -> None:  # noqa: ANN001
        plan = cache.start_prefill(model.module, ids, step=128, logits=True, snapshot_at=[copied])
        while not plan.done:
            plan.run(plan.next_chunk)
        mx.eval(cache.arrays())

    def run() -> tuple[np.ndarray, np.ndarray, list[list[int]], list[int]]:
        """Logits of each row's decode step alone, of the three together, each cache's shared prefixes, and the
        bytes the caches hold: each counted alone, and together."""
        source = model.make_prompt_cache()
        fill(source, prompt)
        caches = [source]
        for i in range(2):
            copy = model.make_prompt_cache()
            assert copy.copy_prefix(source, [*prompt[:copied], 5 + i]) == copied  # hybrids: through a snapshot
            caches.append(copy)
        for i, cache in enumerate(caches):  # each goes on with a reply of its own
            fill(cache, [*list(cache.tokens), *range(40 + i, 43 + 2 * i)])
        marks = [[id(layer.shared) for layer in cache.layers if type(layer) is KVCache] for cache in caches]
        held = [sum(cache.nbytes for cache in caches), distinct_nbytes(cache.held() for cache in caches)]
        alone = []
        for cache in caches:  # each row's own step, then back (recurrent layers through a mark)
            mark = cache.mark()
            alone.append(last_logits_of(model.module)(mx.array([[9]]), cache.layers))
            mx.eval(alone[-1])
            cache.rewind(len(cache.tokens), mark)
        together = batched_last_logits(model.module, [9, 9, 9], caches)
        return np.array(mx.concatenate(alone)), np.array(together), marks, held

    groups = []
    shared = attention.shared_part
    monkeypatch.setattr(attention, "shared_part", lambda *a: groups.append(a[1]) or shared(*a))
    alone, together, marks, (each, distinct) = model.worker.run(run)
    assert all(m == marks[0] for m in marks) and marks[0] and id(None) not in marks[0]
    assert distinct < each * 0.6  # the prefix's keys and values held once for the three
    assert groups and all(g == [0, 1, 2] for g in groups)  # every full-attention layer
    assert float(np.abs(alone - together).max()) < 1e-4
    assert (alone.argmax(-1) == together.argmax(-1)).all()
    model.close()
