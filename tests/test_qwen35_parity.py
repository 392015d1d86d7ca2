"""Qwen3.5 beyond the common parity suite (tests/test_parity.py): logits over several DeltaNet chunks, the
released layout, the other layouts of the same weights (per-expert MoE tensors, mlx-lm's conversion),
layer caches and snapshots, config fallbacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat.cache import KVCache, StateCache
from mlxchat.errors import CheckpointError
from mlxchat.testing import assert_close, chunked_logits, full_logits
from mlxchat_qwen35 import Qwen35Config

from conftest import fixture_path, loaded, reference

ARCHS = ["qwen3_5", "qwen3_5_moe"]


@pytest.mark.parametrize("name", ARCHS)
def test_logits_over_several_chunks_match_transformers(name: str) -> None:
    ref = reference(name)
    assert len(ref["long_ids"]) > 2 * 64
    assert_close(full_logits(loaded(name), ref["long_ids"]), ref["long_logits"])


@pytest.mark.parametrize("name", ARCHS)
def test_uneven_chunks_across_deltanet_chunks_match(name: str) -> None:
    """Chunks that straddle the 64-token DeltaNet chunks of a full forward, then single tokens."""
    ref = reference(name)
    assert_close(chunked_logits(loaded(name), ref["long_ids"], [3, 70, 1, 64, 2, 13]), ref["long_logits"])


def test_released_layout_is_what_the_fixtures_hold() -> None:
    raw = json.loads((fixture_path("qwen3_5_moe") / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and raw["text_config"]["model_type"] == "qwen3_5_moe_text"
    names = mx.load(str(fixture_path("qwen3_5_moe") / "model.safetensors")).keys()
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.") for n in names)


def test_per_expert_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    """The other MoE layout: one tensor per expert and projection (transformers' save_pretrained)."""
    source = fixture_path("qwen3_5_moe")
    for item in source.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    weights = mx.load(str(source / "model.safetensors"))
    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        prefix = key[: -len("gate_up_proj")]
        gate, up = mx.split(weights.pop(key), 2, axis=1)
        down = weights.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            weights[f"{prefix}{e}.gate_proj.weight"] = gate[e]
            weights[f"{prefix}{e}.up_proj.weight"] = up[e]
            weights[f"{prefix}{e}.down_proj.weight"] = down[e]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    model = mlxchat.load_model(tmp_path, dtype="float32")
    try:
        ref = reference("qwen3_5_moe")
        assert_close(full_logits(model, ref["input_ids"]), ref["logits"])
    finally:
        model.close()


def test_mlx_lm_conversion_is_detected() -> None:
    """mlx-lm's copy has the conv weights transposed and the norms' 1 folded in: loading it unchanged
    gives the same module weights as loading the released layout."""
    released, converted = loaded("qwen3_5").module, loaded("qwen3_5_mlx").module
    a, b = released.model.layers[0], converted.model.layers[0]
    assert mx.array_equal(a.linear_attn.conv1d.weight, b.linear_attn.conv1d.weight)
    assert mx.allclose(a.input_layernorm.weight, b.input_layernorm.weight)
    assert mx.array_equal(a.linear_attn.norm.weight, b.linear_attn.norm.weight)
    raw = mx.load(str(fixture_path("qwen3_5") / "model.safetensors"))
    stored = raw["model.language_model.layers.0.input_layernorm.weight"]
    assert mx.allclose(a.input_layernorm.weight, stored + 1.0)


def test_caches_follow_the_layer_types() -> None:
    model = loaded("qwen3_5")
    kinds = [type(c) for c in model.module.make_cache()]
    assert kinds == [StateCache, StateCache, StateCache, KVCache]
    assert model.module.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_state_snapshot_restores_exactly() -> None:
    """A prompt cache rewinds the DeltaNet layers through a snapshot, never by resetting their state."""
    model = loaded("qwen3_5")
    ids = reference("qwen3_5")["long_ids"].tolist()

    def run() -> tuple[np.ndarray, np.ndarray, int]:
        cache = model.make_prompt_cache()
        model.module(mx.array(ids[:50])[None], cache.layers)
        cache.feed(ids[:50])
        cache.snapshot()
        first = model.module(mx.array(ids[50:90])[None], cache.layers)
        cache.feed(ids[50:90])
        kept = cache.reuse(ids[:70])  # diverges inside the second chunk: back to the snapshot at 50
        second = model.module(mx.array(ids[kept:70])[None], cache.layers)
        mx.eval(first, second)
        return np.array(first[0, : 70 - 50]), np.array(second[0]), kept

    first, second, kept = model.worker.run(run)
    assert kept == 50
    assert_close(second, first, 1e-5)


def test_config_falls_back_to_the_full_attention_interval() -> None:
    raw = json.loads((fixture_path("qwen3_5") / "config.json").read_text())
    text = {k: v for k, v in raw["text_config"].items() if k != "layer_types"}
    config = Qwen35Config.from_hf({**raw, "text_config": {**text, "num_hidden_layers": 8,
                                                          "full_attention_interval": 4}})
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert config.rotary_dims == 8


def test_bad_conv_weight_names_the_tensor(tmp_path: Path) -> None:
    source = fixture_path("qwen3_5")
    for item in source.iterdir():
        shutil.copy(item, tmp_path / item.name)
    weights = mx.load(str(source / "model.safetensors"))
    key = "model.language_model.layers.1.linear_attn.conv1d.weight"
    weights[key] = weights[key][:, 0]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="layers.1.linear_attn.conv1d.weight"):
        mlxchat.load_model(tmp_path, dtype="float32")
