"""LFM2 beyond the common parity suite (tests/test_parity.py): hybrid layout and caches, expert_bias routing,
the conv state returning to earlier positions only through snapshots, and the config dialects resolving as
transformers resolves them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat.cache import KVCache, StateCache
from mlxchat.testing import full_logits, prefill_and_decode
from mlxchat_lfm2.model import Lfm2Config

from conftest import fixture_path, loaded, reference

ARCHS = ["lfm2", "lfm2_moe"]


def test_hybrid_layout_and_caches() -> None:
    for name in ARCHS:
        module = loaded(name).module
        kinds = [type(c) for c in module.make_cache()]
        assert kinds == [StateCache, KVCache, StateCache, StateCache, KVCache, StateCache]
    moe = loaded("lfm2_moe").module.model.layers
    assert [type(layer.feed_forward).__name__ for layer in moe] == ["SwiGLU"] * 2 + ["Lfm2MoE"] * 4


def test_expert_bias_steers_the_routing() -> None:
    """Without expert_bias (used only to choose experts) the logits are far off: the fixture checks it."""
    ref = reference("lfm2_moe")
    model = mlxchat.load_model(fixture_path("lfm2_moe"), dtype="float32")
    try:
        def zero_bias() -> None:
            for layer in model.module.model.layers[2:]:
                layer.feed_forward.expert_bias = mx.zeros_like(layer.feed_forward.expert_bias)

        model.worker.run(zero_bias)
        assert np.abs(full_logits(model, ref["input_ids"]) - ref["logits"]).max() > 0.1
    finally:
        model.close()


def test_conv_state_returns_only_through_snapshots() -> None:
    """A conv state cannot be cut back: rewinding restores the snapshot at or before the common prefix,
    and the continuation then equals a fresh run."""
    model = loaded("lfm2")
    ids = reference("lfm2")["input_ids"].tolist()

    def run(prompt: list[int], cache: mlxchat.PromptCache, checkpoints: list[int]) -> tuple[list[int], int]:
        return prefill_and_decode(model, prompt, cache, 4, snapshot_at=checkpoints)

    def scenario() -> None:
        cache = model.make_prompt_cache()
        run(ids[:30], cache, checkpoints=[20, 29])
        assert cache.snapshot_positions == [20, 29]
        edited = ids[:25] + [7, 8, 9]  # diverges at 25: back to the snapshot at 20, prefill the delta
        tokens, cached = run(edited, cache, checkpoints=[])
        assert cached == 20
        assert tokens == run(edited, model.make_prompt_cache(), checkpoints=[])[0]
        same = ids[:30]  # regenerate: back to the last prompt token's snapshot
        cache = model.make_prompt_cache()
        first, _ = run(same, cache, checkpoints=[29])
        again, cached = run(same, cache, checkpoints=[])
        assert (cached, again) == (29, first)

    model.worker.run(scenario)


# -- config dialects ------------------------------------------------------------------------------

BASE = {"model_type": "lfm2", "vocab_size": 512, "hidden_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 6656}


def config(**changes: object) -> Lfm2Config:
    return Lfm2Config.from_hf({**BASE, **changes})  # type: ignore[return-value]


@pytest.mark.parametrize(("ff", "multiple", "width"), [(6656, 256, 4608), (12288, 256, 8192), (200, 32, 160)])
def test_feed_forward_width_rule(ff: int, multiple: int, width: int) -> None:
    assert config(block_ff_dim=ff, block_multiple_of=multiple).feed_forward_width == width
    assert config(intermediate_size=ff, block_multiple_of=multiple).feed_forward_width == width


def test_feed_forward_width_variants() -> None:
    # block_ff_dim wins over intermediate_size, as in transformers
    assert config(block_ff_dim=6656, intermediate_size=4608).feed_forward_width == 4608
    assert config(intermediate_size=2560, block_auto_adjust_ff_dim=False).feed_forward_width == 2560
    # transformers rounds up to the multiple only when a multiplier is given
    assert config(intermediate_size=200, block_ffn_dim_multiplier=None).feed_forward_width == 133
    moe = {"model_type": "lfm2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert config(intermediate_size=7168, **moe).feed_forward_width == 7168


def test_layer_types_from_either_key() -> None:
    assert config(full_attn_idxs=[1, 3]).layer_types == ["conv", "full_attention", "conv", "full_attention"]
    assert config(layer_types=["conv"] * 4).layer_types == ["conv"] * 4
    assert config().layer_types == ["full_attention"] * 4  # neither: transformers makes every layer attention
    with pytest.raises(mlxchat.CheckpointError, match="layer_types"):
        config(layer_types=["conv"] * 3)
    with pytest.raises(mlxchat.CheckpointError, match="layer_types"):
        config(layer_types=["conv", "mamba", "conv", "conv"])


def test_hub_keys_and_defaults() -> None:
    c = config(block_dim=1024, rope_theta=5e5, norm_eps=1e-6, tie_embedding=False)
    assert (c.head_dim, c.rope.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (64, 5e5, 1e-6, False)
    c = config(rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert (c.rope.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.conv_L_cache) == (1e5, 1e-5, True, 3)
    assert config().rope.rope_theta == 1e6
    with pytest.raises(mlxchat.CheckpointError, match="block_dim"):
        config(block_dim=512)
