"""Generation: sampling options, stop strings, penalties, streaming text that never splits a character,
and the report."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest

import mlxchat
from mlxchat import cache as caches
from mlxchat import kernels
from mlxchat.cache import KVCache
from mlxchat.detokenizer import StreamingDetokenizer
from mlxchat.generation import GenerationConfig, StopStrings

from conftest import fixture_path, loaded

PROMPT = [5, 77, 300, 12, 9, 41]


@pytest.fixture
def model() -> mlxchat.GenerativeModel:
    return loaded("qwen3")


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model) -> None:
    sampled = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "min_p": 0.05, "seed": 7}
    assert model.generate(PROMPT, sampled).tokens == model.generate(PROMPT, sampled).tokens
    greedy = model.generate(PROMPT, {"max_tokens": 16, "temperature": 0.0}).tokens
    assert model.generate(PROMPT, {"max_tokens": 16, "temperature": 0.8, "top_k": 1, "seed": 1}).tokens == greedy


def test_logit_bias_and_penalties_change_the_choice(model) -> None:
    forced = model.generate(PROMPT, {"max_tokens": 4, "temperature": 0.0, "logit_bias": {123: 100.0}}).tokens
    assert forced == [123, 123, 123, 123]
    repeated = model.generate(PROMPT, {"max_tokens": 4, "temperature": 0.0, "logit_bias": {123: 100.0},
                                       "frequency_penalty": 150.0}).tokens
    assert repeated[0] == 123 and repeated[1] != 123
    presence = model.generate(PROMPT, {"max_tokens": 3, "temperature": 0.0, "logit_bias": {123: 100.0},
                                       "presence_penalty": 200.0}).tokens
    assert presence[0] == 123 and 123 not in presence[1:]


def test_a_long_prompt_is_allocated_once_not_grown_chunk_by_chunk(model, monkeypatch) -> None:
    from mlxchat.prefix_cache import PromptCachePool

    growths: list[tuple[int, int]] = []  # (layer cache, tokens it held)
    grown = KVCache._grown

    def counted(self, buffers, like, start, length):  # type: ignore[no-untyped-def]
        growths.append((id(self), start))
        return grown(self, buffers, like, start, length)

    monkeypatch.setattr(KVCache, "_grown", counted)
    cache = model.make_prompt_cache()
    prompt = [(7 * i) % 500 + 3 for i in range(700)]
    result = model.generate(prompt, {"max_tokens": 4, "temperature": 0.0, "prefill_step": 128}, cache=cache)
    layers = [layer for layer in cache.layers if isinstance(layer, KVCache)]
    assert layers and sorted(growths) == sorted((id(layer), 0) for layer in layers)  # each allocated once, at first
    assert {layer.keys.shape[2] for layer in layers} == {KVCache.capacity(701)}  # type: ignore[union-attr]
    assert result.tokens == model.generate(prompt, {"max_tokens": 4, "temperature": 0.0}).tokens
    pool = PromptCachePool()  # a cache whose layers are replaced by a prefix copy from another does the same
    first, second = model.make_prompt_cache(), model.make_prompt_cache()
    for cache, tail in ((first, prompt[::-1]), (second, prompt[::-2] * 2)):
        pool.add(cache)
        growths.clear()
        model.generate([*prompt[:300], *tail], {"max_tokens": 2, "temperature": 0.0, "prefill_step": 128}, cache=cache)
        assert len({layer for layer, _ in growths}) == len(growths)  # no layer grew twice
    assert second.layers[0].base >= 300  # type: ignore[attr-defined]  # it read the first's prefix in place
    assert {layer for layer, _ in growths} >= {id(layer) for layer in second.layers}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "gemma4"])
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_what_a_cache_never_wrote_into_its_buffers_is_never_read(name: str, kv_bits: int | None, monkeypatch) -> None:
    """Buffers are allocated unwritten (:func:`mlxchat.cache.blank`): filled with NaN (packed ones with every bit
    set), every way a cache is read gives what zeroed buffers give: prefill chunks, decode steps, growths that copy
    what a buffer held (small steps here), batched rows, a regenerated reply, a follow-up turn, sessions sharing a
    pool's prefix (read in place past a small threshold here), sliding windows, 8-bit KV."""
    from mlxchat.layers import attention
    from mlxchat.prefix_cache import PromptCachePool

    monkeypatch.setattr(KVCache, "step", 16)
    monkeypatch.setattr(KVCache, "share_from", 32)
    monkeypatch.setattr(attention, "SHARED_PREFIX_MIN", 32)
    model = loaded(name) if kv_bits is None else \
        mlxchat.load_model(fixture_path(name), dtype="float32", kv_bits=kv_bits, kv_group_size=32)
    prompts = [[(7 * i + j) % 200 + 5 for i in range(90 + 31 * j)] for j in range(3)]
    config = {"max_tokens": 12, "temperature": 0.0, "prefill_step": 32}
    grown = KVCache._grown
    copies: list[int] = []

    def counted(self, buffers, like, start, length):  # type: ignore[no-untyped-def]
        copies.append(start if buffers is not None else 0)
        return grown(self, buffers, like, start, length)

    monkeypatch.setattr(KVCache, "_grown", counted)

    def run() -> list[list[int]]:
        alone = [model.generate(p, config).tokens for p in prompts]
        together = [r.tokens for r in model.generate_batch(prompts, config)]
        session = model.chat_session()
        turns = [session.send("Tell me about the sea.", config=config).tokens,
                 session.regenerate(config=config).tokens, session.send("And lakes?", config=config).tokens]
        pool = PromptCachePool()
        system = "You answer questions about the weather, in detail, politely and briefly. " * 3
        shared = [model.chat_session(system=system, prefix_cache=pool) for _ in range(2)]
        turns += [each.send(f"Is it raining in town {i}?", config=config).tokens for i, each in enumerate(shared)]
        return [*alone, *together, *turns]

    def poisoned(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        return mx.full(shape, float("nan")).astype(dtype) if mx.issubdtype(dtype, mx.floating) else \
            mx.full(shape, -1, mx.int32).view(mx.uint32).astype(dtype)

    try:
        monkeypatch.setattr(caches, "blank", mx.zeros)
        expected = run()
        assert any(copies)  # growths that copied what a buffer held
        monkeypatch.setattr(caches, "blank", poisoned)
        assert run() == expected
    finally:
        if kv_bits is not None:
            model.close()


def test_a_caches_buffer_is_allocated_not_written() -> None:
    """On the CPU with the kernels built a buffer's room holds what the memory held (here NaN, freed just before),
    so its pages are mapped only as tokens are written."""
    if kernels._native()[0] is None or mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("buffers are zeros without the native kernels, or off the CPU")
    mx.clear_cache()  # MLX's freed buffers: only the poison's below are left to reuse
    poison = [mx.full((1, 2, KVCache.capacity(5), 32), float("nan")) for _ in range(4)]
    mx.eval(poison)
    del poison
    cache = KVCache()
    keys = mx.ones((1, 2, 5, 32))
    held_keys, held_values = cache.update_and_fetch(keys, keys)
    assert mx.array_equal(held_keys, keys).item() and mx.array_equal(held_values, keys).item()
    assert cache.keys is not None and bool(mx.isnan(cache.keys[..., 5:, :]).any())  # the room: never written


def test_config_fields_merge_over_the_checkpoint_defaults(model) -> None:
    assert model.defaults.temperature == 0.6 and model.defaults.top_k == 20  # generation_config.json
    merged = model.defaults.merged({"max_tokens": 3})
    assert merged.max_tokens == 3 and merged.temperature == 0.6
    with pytest.raises(ValueError):
        GenerationConfig(max_tokens=0)
    with pytest.raises(ValueError):
        GenerationConfig.model_validate({"temprature": 1.0})


def test_stop_strings_end_the_reply_before_them(model) -> None:
    full = model.generate(PROMPT, {"max_tokens": 24, "temperature": 0.0})
    stop = full.text[5:8]
    assert stop and stop not in full.text[:7]
    cut = model.generate(PROMPT, {"max_tokens": 24, "temperature": 0.0, "stop": [stop]})
    assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"


def test_stop_string_matcher_holds_back_a_possible_start() -> None:
    stops = StopStrings(["</end>"])
    assert stops.feed("abc</e") == ("abc", False)
    assert stops.feed("nd>rest") == ("", True)
    stops = StopStrings(["xy"])
    assert stops.feed("ax") == ("a", False) and stops.feed("z") == ("xz", False)


def test_eos_ends_with_stop_and_the_report_adds_up(model) -> None:
    eos = next(iter(model.eos_ids))
    result = model.generate(PROMPT, {"max_tokens": 10, "temperature": 0.0, "logit_bias": {eos: 100.0}})
    assert result.finish_reason == "stop" and result.tokens == [] and result.text == ""
    report = model.generate(PROMPT, {"max_tokens": 10, "temperature": 0.0}).report
    assert report.prompt_tokens == len(PROMPT) and report.cached_prompt_tokens == 0
    assert report.generated_tokens == 10 and report.finish_reason == "length"
    assert report.ttft_s > 0 and report.prefill_tps > 0 and report.decode_tps > 0 and report.peak_memory_gb > 0


def test_a_prompt_cache_carries_state_between_generate_calls(model) -> None:
    cache = model.make_prompt_cache()
    first = model.generate(PROMPT, {"max_tokens": 4, "temperature": 0.0}, cache=cache)
    again = model.generate(PROMPT + first.tokens + [7], {"max_tokens": 4, "temperature": 0.0}, cache=cache)
    fresh = model.generate(PROMPT + first.tokens + [7], {"max_tokens": 4, "temperature": 0.0})
    assert again.tokens == fresh.tokens
    # the reply's last token was sampled but never fed to the model, so the cache holds one token less
    assert again.report.cached_prompt_tokens == len(PROMPT) + len(first.tokens) - 1


def test_streaming_never_splits_a_character() -> None:
    tokenizer = loaded("qwen3").tokenizer
    text = "naïve café — 日本語のテキスト 🙂 ok"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens are partial characters
    detok = StreamingDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_long_streams_decode_in_windows_and_still_match() -> None:
    tokenizer = loaded("qwen3").tokenizer
    text = " ".join(["the weather in tokyo is sunny today, 21 C — ça va?"] * 12)
    detok = StreamingDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in tokenizer.encode(text)) + detok.flush() == text


def test_async_generate_and_stream(model) -> None:
    async def main():
        result = await model.agenerate(PROMPT, {"max_tokens": 5, "temperature": 0.0})
        chunks = [c async for c in model.astream(PROMPT, {"max_tokens": 5, "temperature": 0.0})]
        return result, chunks

    result, chunks = asyncio.run(main())
    assert result.tokens == [c.token for c in chunks if c.token is not None]
    assert chunks[-1].report is not None


def test_empty_prompt_is_refused(model) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate([], {"max_tokens": 2})


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "lfm2", "gemma4"])
def test_reply_logprobs_are_the_full_forwards_and_the_cache_goes_on(name) -> None:
    """Rescoring a session's reply gives the log-probabilities a cache-free forward gives, and leaves the
    cache (hybrid layers included) holding the reply, so the next turn still reuses it."""
    import mlx.core as mx

    model = loaded(name)
    config = {"max_tokens": 8, "temperature": 0.0, "repetition_penalty": 1.3}
    session, untouched = model.chat_session(), model.chat_session()
    result = session.send("Hello there", config=config)
    untouched.send("Hello there", config=config)
    start = result.report.prompt_tokens
    scored = model.reply_logprobs(session.cache, start, result.tokens, top=2)
    logits = model.logits(session.cache.tokens[:start] + result.tokens)
    rows = logits[start - 1 : start - 1 + len(result.tokens)]
    oracle = [float(rows[i, t] - mx.logsumexp(rows[i])) for i, t in enumerate(result.tokens)]
    assert [value for value, _ in scored] == pytest.approx(oracle, abs=1e-4)
    assert all(len(best) == 2 and best[0][1] >= best[1][1] for _, best in scored)
    assert session.cache.tokens[start:] == result.tokens
    follow = session.send("And then?", config={"max_tokens": 2, "temperature": 0.0})
    unscored = untouched.send("And then?", config={"max_tokens": 2, "temperature": 0.0})
    assert follow.report.cached_prompt_tokens == unscored.report.cached_prompt_tokens > 0
    assert follow.tokens == unscored.tokens
