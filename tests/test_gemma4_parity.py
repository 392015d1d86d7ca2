"""Gemma 4 beyond the common parity suite (tests/test_parity.py, whose uneven chunks cross the fixtures'
16-token sliding window): KV-shared layers own no cache, sliding layers keep only their window, both config
dialects and the checkpoint layouts Gemma 4 ships in load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat.cache import KVCache, SlidingWindowCache
from mlxchat.checkpoint import read_json
from mlxchat.generation import decode_tokens
from mlxchat.sampling import make_sampler
from mlxchat.testing import assert_close, full_logits
from mlxchat_gemma4 import Gemma4Config

from conftest import fixture_path, loaded, reference

ARCHS = ["gemma4", "gemma4_moe"]
WINDOW = 16  # the fixtures' sliding window, shorter than the 40-token reference sequence


def test_kv_shared_layers_have_no_cache() -> None:
    model = loaded("gemma4")
    caches = model.module.make_cache()
    # S S S F S | S S F: the last three layers reuse layer 4's (sliding) and layer 3's (global) K/V.
    assert [type(c) for c in caches] == [SlidingWindowCache] * 3 + [KVCache, SlidingWindowCache]
    assert [c.window for c in caches if isinstance(c, SlidingWindowCache)] == [WINDOW] * 4
    assert not any(hasattr(model.module.model.layers[i].self_attn, "k_proj") for i in (5, 6, 7))


def test_long_chat_keeps_sliding_memory_at_the_window() -> None:
    """2,100 tokens (prefill in window-sized and larger chunks, then decoding) through the sliding layers:
    each keeps exactly its window; the global layer keeps everything."""
    model = loaded("gemma4")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 400, size=1600).tolist()
    def run() -> mlxchat.PromptCache:
        cache = model.make_prompt_cache()
        _, pending = cache.prefill(model.module, prompt, step=37)
        for _ in decode_tokens(model.module, cache, pending, make_sampler(0.8, seed=0), 500):
            pass
        return cache

    cache = model.worker.run(run)
    assert len(cache) >= 2_000
    per_token = 2 * 1 * 16 * 4  # keys and values, 1 KV head of 16 float32s
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowCache):
            assert layer.offset == len(cache)
            assert layer.nbytes == WINDOW * per_token
            assert all(a.shape[2] == WINDOW for a in layer.state)
        else:
            assert layer.offset == len(cache) and layer.nbytes >= len(cache) * 2 * 32 * 4


def test_both_config_dialects_describe_the_same_model() -> None:
    """transformers 5's per_layer_config and the released global_head_dim / num_global_key_value_heads."""
    raw = read_json(fixture_path("gemma4_moe") / "config.json")
    released = Gemma4Config.from_hf(raw)
    released_keys = ("global_head_dim", "num_global_key_value_heads")
    text = {k: v for k, v in raw["text_config"].items() if k not in released_keys}
    text["per_layer_config"] = {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                "5": {"head_dim": 32, "num_key_value_heads": 1}}
    transformers5 = Gemma4Config.from_hf({**raw, "text_config": text})
    assert released.layer_head_dims == transformers5.layer_head_dims == [16, 16, 32, 16, 16, 32]
    assert released.layer_kv_heads == transformers5.layer_kv_heads == [2, 2, 1, 2, 2, 1]
    assert released.vocab_size == 512  # the text model's, not the wrapper's 262144


def test_global_kv_heads_need_k_eq_v() -> None:
    """transformers applies num_global_key_value_heads only with attention_k_eq_v."""
    raw = read_json(fixture_path("gemma4_moe") / "config.json")
    config = Gemma4Config.from_hf({**raw, "text_config": {**raw["text_config"], "attention_k_eq_v": False}})
    assert config.layer_kv_heads == [2] * 6


def test_unknown_per_layer_override_is_a_clear_error() -> None:
    raw = read_json(fixture_path("gemma4") / "config.json")
    text = {**raw["text_config"], "per_layer_config": {"3": {"head_dim": 32, "sliding_window": 8}}}
    with pytest.raises(mlxchat.CheckpointError, match="sliding_window"):
        Gemma4Config.from_hf({**raw, "text_config": text})


def _rewrite(source: str, folder: Path, rename) -> Path:
    """A copy of a fixture with its tensors renamed (and some added) by ``rename(weights) -> weights``."""
    shutil.copytree(fixture_path(source), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), rename(weights), metadata={"format": "pt"})
    return folder


def test_mlx_lm_layout_with_towers_and_unused_shared_kv_loads(tmp_path: Path) -> None:
    """mlx-lm's converted layout (``language_model.model.*``), multimodal towers (skipped) and the K/V
    projections some checkpoints keep on KV-shared layers (dropped) give the same model."""
    def rename(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {k.replace("model.language_model.", "language_model.model."): v for k, v in weights.items()}
        out["vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"] = mx.zeros((4, 4))
        out["embed_audio.embedding_projection.weight"] = mx.zeros((4, 4))
        out["language_model.model.layers.6.self_attn.k_proj.weight"] = mx.zeros((16, 64))
        return out

    ref = reference("gemma4")
    model = mlxchat.load_model(_rewrite("gemma4", tmp_path / "g", rename), dtype="float32")
    try:
        assert_close(full_logits(model, ref["input_ids"]), ref["logits"])
    finally:
        model.close()


def test_stray_tensor_is_named(tmp_path: Path) -> None:
    def rename(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {**weights, "mystery.weight": mx.zeros((2,))}

    with pytest.raises(mlxchat.CheckpointError, match="mystery.weight"):
        mlxchat.load_model(_rewrite("gemma4", tmp_path / "g", rename), dtype="float32")


def test_fixture_configs_are_in_the_wrapper_layout() -> None:
    for name in ARCHS:
        raw = json.loads((fixture_path(name) / "config.json").read_text())
        assert raw["model_type"] == "gemma4" and raw["text_config"]["model_type"] == "gemma4_text"
        assert raw["text_config"]["sliding_window"] == WINDOW


