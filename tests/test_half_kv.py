"""Float16 KV caches (``kv_bits=16``): full-attention keys and values stored as float16, half of float32's
memory and of what a decode step reads of them, read by the attention kernel as they lie (test_attention.py);
every fixture's logits stay close to float KV's and the demo model's greedy tokens equal them over 200
tokens; a value past float16's range saturates instead of becoming infinite; sessions reuse, cut back, share
prefixes, save and resume in the format; batching, speculative decoding, split models and the server's
memory estimate run on it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_quantized_kv import (
    ARCHITECTURES,
    GREEDY,
    assert_speculative_decoding_rolls_back,
    cached_logits,
    demo_greedy_tokens,
    softmax,
)

import mlxchat
from mlxchat.cache import KVCache, QuantizedKVCache, check_kv_format
from mlxchat.cli import build_parser
from mlxchat.prefix_cache import PromptCachePool
from mlxchat.testing import batched_decoding_problems, load_fixture

from conftest import FIXTURES


def half_layers(cache: mlxchat.PromptCache) -> list[KVCache]:
    return [layer for layer in cache.layers if type(layer) is KVCache and str(layer.dtype) == str(mx.float16)]


@pytest.mark.parametrize("folder", ARCHITECTURES, ids=lambda f: f.name)
def test_float16_kv_logits_stay_close_to_float_kv(folder: Path) -> None:
    """Measured: float16 keys and values (a value rounded by up to 2^-11 of itself) move these fixtures' logits
    by 3e-4 to 9e-3 (max abs, logits up to 17), next-token probabilities by 2e-6 to 1.5e-3; Qwen3-MoE's by 0.12 at
    one position of 120 (every other within 3.4e-3: a jump, as where a router's top-k choice tips over)."""
    model = load_fixture(folder)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 120).tolist()
    float_kv, half_kv = cached_logits(model, ids, None), cached_logits(model, ids, 16)
    error = float(np.abs(half_kv - float_kv).max())
    moved = float(np.abs(softmax(half_kv) - softmax(float_kv)).max())
    print(f"{folder.name}: float16 KV from float KV: logits {error:.2e} (max abs), probabilities {moved:.2e}")
    assert error < 0.25
    assert moved < 2e-3
    assert (half_kv.argmax(-1) == float_kv.argmax(-1)).mean() >= 0.99


def test_float16_kv_greedy_tokens_equal_float_kv_on_the_demo_model_over_200_tokens() -> None:
    assert demo_greedy_tokens(16) == demo_greedy_tokens(None)


def test_a_float16_cache_holds_half_saturates_and_copies_only_its_own_format() -> None:
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 2, 40, 64)).astype(np.float32))
    half, floats = KVCache(mx.float16), KVCache()
    for cache in (half, floats):
        cache.update_and_fetch(keys, keys * 2)
    held, _ = half.update_and_fetch(mx.full((1, 2, 1, 64), 1e6), mx.full((1, 2, 1, 64), -1e6))
    assert held.dtype == mx.float16 and half.nbytes * 2 == floats.nbytes
    assert float(held[..., -1, :].max()) == 65504 and float(half.values[..., 40, :].min()) == -65504  # not inf
    wide = mx.array([70000.0, -1e6, 65519.0, 65530.0, 1.0], dtype=mx.bfloat16)  # a bfloat16 model's, clipped exactly
    assert half.stored(wide).tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 1.0]
    assert float(mx.abs(held[..., :40, :].astype(mx.float32) - keys).max()) < 2e-3
    copy = KVCache(mx.float16)
    assert copy.can_copy_from(half) and not copy.can_copy_from(floats) and not floats.can_copy_from(half)
    copy.copy_from(half, 30)
    assert mx.array_equal(copy.span(0, 30)[0], half.span(0, 30)[0])
    arrays, fields = half.state_dict()
    assert arrays["keys"].dtype == mx.float16
    again = KVCache(mx.float16)
    again.load_state({name: a.astype(mx.float32) for name, a in arrays.items()}, fields)  # stored as float16
    assert again.keys is not None and again.keys.dtype == mx.float16 and mx.array_equal(again.keys, arrays["keys"])


def test_the_format_is_taken_from_outside_without_groups() -> None:
    check_kv_format(16, 48)  # float16 has no groups: the group size is not used
    with pytest.raises(mlxchat.InvalidInputError, match="16 \\(float16\\)"):
        check_kv_format(12, 64)
    with pytest.raises(mlxchat.InvalidInputError, match="2-8 bits"):
        QuantizedKVCache(16, 64)
    assert build_parser().parse_args(["serve", "--kv-bits", "16"]).kv_bits == 16


def test_a_session_on_float16_kv_reuses_cuts_back_saves_and_resumes(tmp_path: Path) -> None:
    with mlxchat.load_model() as model:
        session, floats = model.chat_session(kv_bits=16, kv_group_size=32), model.chat_session()
        assert half_layers(session.cache) and not half_layers(floats.cache)
        for text in ("Hello there, tell me about cats and everything they like to do all day.", "And dogs?"):
            second, expected = session.send(text, config=GREEDY), floats.send(text, config=GREEDY)
            assert second.report.cached_prompt_tokens == expected.report.cached_prompt_tokens
            assert second.text == expected.text
        again = session.regenerate(config=GREEDY)
        assert again.text == second.text and again.report.cached_prompt_tokens == again.report.prompt_tokens - 1
        session.save(tmp_path / "s.mlxchat")
        third = session.send("And birds?", config=GREEDY)
        resumed = mlxchat.ChatSession.load(model, tmp_path / "s.mlxchat")  # the file's format, not the model's
        assert resumed.cache.kv_format == (16, 0) and half_layers(resumed.cache)  # no groups
        assert resumed.send("And birds?", config=GREEDY).text == third.text


def test_conversations_on_float16_kv_share_a_system_prompt_where_it_lies() -> None:
    system = "You are a careful assistant. " * 40
    with mlxchat.load_model(FIXTURES / "qwen3", dtype="float32", kv_bits=16) as model:
        pool, config = PromptCachePool(), {**GREEDY, "max_tokens": 6}
        first = model.chat_session(system=system, prefix_cache=pool)
        first.send("Hello", config=config)
        second = model.chat_session(system=system, prefix_cache=pool, kv_group_size=32)  # one format: no groups
        reply = second.send("Hi", config=config)
        alone = model.chat_session(system=system).send("Hi", config=config)
        assert reply.report.cached_prompt_tokens > KVCache.share_from and reply.tokens == alone.tokens
        layers = half_layers(second.cache)
        assert layers and all(layer.shared is not None and layer.shared.keys.dtype == mx.float16 for layer in layers)


def test_batched_and_speculative_decoding_run_on_float16_caches() -> None:
    with mlxchat.load_model(kv_bits=16) as model:
        prompts = [list(range(3, 3 + n)) for n in (70, 9, 130)]
        assert batched_decoding_problems(model, prompts, steps=40, tolerance=1e-3) == []
    assert_speculative_decoding_rolls_back(16)


def test_the_servers_memory_estimate_counts_float16_keys_and_values() -> None:
    from mlxchat.server.admission import Footprint

    with mlxchat.load_model(FIXTURES / "qwen3", dtype="float32") as model:
        float_kv = Footprint(model)
    with mlxchat.load_model(FIXTURES / "qwen3", dtype="float32", kv_bits=16) as model:
        footprint = Footprint(model)
        session = model.chat_session()
        result = session.send("Hello there, how are you today?", config={"max_tokens": 20, "temperature": 0.0})
        tokens = result.report.prompt_tokens + result.report.generated_tokens
        assert session.cache.nbytes == footprint.nbytes(tokens)
        assert footprint.nbytes(4096) * 2 == float_kv.nbytes(4096)
