"""Projections that read the same input run as one product (q/k/v, gate/up, DeltaNet's inputs): the same
results as the separate layers, the layers' own names and memory, and the separate layers whenever one
is replaced (adapters, training, sharding)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxchat
from mlxchat.checkpoint import tensor_names
from mlxchat.config import RopeConfig
from mlxchat.layers import Attention, Projections, RoPE, fuse_projections
from mlxchat.layers.quantized import quantize
from mlxchat.registry import registry
from mlxchat.train import lora, save_checkpoint
from mlxchat.train.lora import adapters

FIXTURES = Path(__file__).parent / "fixtures"
IDS = [1, 7, 42, 99, 5, 300, 17, 256, 3, 77]


def groups(module: nn.Module) -> list[Projections]:
    return [v for _, child in module.named_modules() for v in vars(child).values() if isinstance(v, Projections)]


def graph_products(model: mlxchat.GenerativeModel) -> int:
    """Matrix products (float or quantized) in the graph of a forward over ``IDS`` (on the model's worker)."""
    cache = model.make_prompt_cache()
    logits = model.module(mx.array(IDS)[None], cache.layers)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), logits)
        labels = [line.split('label ="')[1] for line in path.read_text().splitlines() if 'label ="' in line]
    return sum(label.startswith(("Matmul", "Addmm", "QuantizedMatmul", "MlxchatQuantizedMatmul")) for label in labels)


def products(model: mlxchat.GenerativeModel) -> int:
    return int(model.worker.run(lambda: graph_products(model)))


def separately(model: mlxchat.GenerativeModel, job):
    """``job()`` on the model's worker with every join set aside (the layers one by one), then put back."""

    def run():
        joined = [(g, g.joined) for g in groups(model.module)]
        for g, _ in joined:
            g.joined = None
        try:
            return job()
        finally:
            for g, j in joined:
                g.joined = j

    return model.worker.run(run)


@pytest.mark.parametrize(("fixture", "joined", "fewer"), [
    ("qwen3", 6, 9),  # 3 layers: q/k/v and gate/up each (3 products fewer a layer)
    ("qwen3_q4", 6, 9),
    ("qwen3_5", 8, None),  # DeltaNet's four inputs, gated attention's q/k/v, the MLPs
    ("lfm2", 8, None),
    ("gemma4", 13, None),  # KV-shared layers project only their queries
])
def test_loaded_models_join_their_projections_with_the_same_results(fixture: str, joined: int,
                                                                     fewer: int | None) -> None:
    with mlxchat.load_model(FIXTURES / fixture) as model:
        assert sum(g.joined is not None for g in groups(model.module)) == joined
        logits = np.array(model.logits(IDS))
        alone = separately(model, lambda: np.array(model.module(mx.array(IDS)[None])[0]))
        np.testing.assert_allclose(logits, alone, atol=5e-5)  # the same sums in another order
        if fewer is not None:
            assert separately(model, lambda: graph_products(model)) - products(model) == fewer


def test_joined_layers_keep_their_names_and_are_views_of_one_buffer() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        names = sorted(k for k, _ in tree_flatten(model.module.parameters()))
        assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names

        def addresses() -> list[tuple[int, int]]:
            attention = model.module.model.layers[0].self_attn
            out = []
            for layer in (attention.q_proj, attention.k_proj, attention.v_proj):
                view = np.asarray(layer.weight)
                out.append((view.__array_interface__["data"][0], view.nbytes))
            return out

        (q, q_bytes), (k, k_bytes), (v, _) = model.worker.run(addresses)
        assert k == q + q_bytes and v == k + k_bytes  # one buffer, q then k then v: nothing was copied


def test_a_saved_checkpoint_has_the_original_names_and_loads_back(tmp_path: Path) -> None:
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        expected = np.array(model.logits(IDS))
        config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
        model.worker.run(lambda: save_checkpoint(tmp_path, model.module, config=config, tokenizer=model.tokenizer))
    assert set(tensor_names(tmp_path)) == set(tensor_names(FIXTURES / "qwen3")) - {"lm_head.weight"}
    with mlxchat.load_model(tmp_path) as saved:
        np.testing.assert_allclose(np.array(saved.logits(IDS)), expected, atol=1e-6)


def test_adapters_apply_per_projection_and_the_join_comes_back_with_the_base() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        base = np.array(model.logits(IDS))
        joined = products(model)
        lora(model, rank=4, targets=("k_proj",))

        def randomize() -> None:
            for layer in adapters(model).values():
                layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape, key=mx.random.key(1))

        model.worker.run(randomize)
        adapted = np.array(model.logits(IDS))
        assert np.abs(adapted - base).max() > 1e-3  # the adapter on k_proj alone is applied
        assert products(model) > joined  # q/k/v one by one; gate/up still joined
        unjoined = separately(model, lambda: np.array(model.module(mx.array(IDS)[None])[0]))
        np.testing.assert_allclose(adapted, unjoined, atol=1e-6)

        model.remove_adapter()
        np.testing.assert_array_equal(np.array(model.logits(IDS)), base)  # the very same joined products
        assert products(model) == joined

        lora(model, rank=4, targets=("k_proj",))
        model.worker.run(randomize)
        adapted = np.array(model.logits(IDS))
        model.fuse_adapter()
        assert products(model) == joined  # joined again, from the fused weights
        np.testing.assert_allclose(np.array(model.logits(IDS)), adapted, atol=1e-4)


def test_a_replaced_weight_is_used_and_its_stale_join_dropped() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        def replace() -> None:
            attention = model.module.model.layers[1].self_attn
            attention.update({"v_proj": {"weight": attention.v_proj.weight * 2}})

        base = np.array(model.logits(IDS))
        model.worker.run(replace)
        doubled = np.array(model.logits(IDS))
        assert model.module.model.layers[1].self_attn._qkv.joined is None
        assert model.module.model.layers[0].self_attn._qkv.joined is not None
        alone = separately(model, lambda: np.array(model.module(mx.array(IDS)[None])[0]))
        assert np.abs(doubled - base).max() > 1e-2
        np.testing.assert_allclose(doubled, alone, atol=1e-5)


def test_layers_quantized_alike_join_and_others_run_alone() -> None:
    """mlx-lm may quantize layers of one module differently: q/k/v join only if their bits, group size and
    mode agree (a joined quantized product keeps the layers' group layout)."""
    config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    arch = registry().architecture_for_config(config)
    module = arch.model_class(arch.config_class.from_hf(config))
    mx.eval(module.parameters())
    x = mx.random.normal((1, 3, config["hidden_size"]), key=mx.random.key(0))

    def options(path: str, layer: nn.Module) -> bool | dict[str, int]:
        if not isinstance(layer, nn.Linear):
            return False
        return {"bits": 8, "group_size": 32} if path.endswith("q_proj") else {"bits": 4, "group_size": 32}

    quantize(module, options)
    expected = module(mx.array(IDS)[None])
    attention, mlp = module.model.layers[0].self_attn, module.model.layers[0].mlp
    reference = [layer(x) for layer in (mlp.gate_proj, mlp.up_proj)]
    assert fuse_projections(module) == 3  # the three MLPs; no q/k/v
    assert attention._qkv.joined is None and mlp._gate_up.joined is not None
    for got, want in zip(mlp._gate_up(mlp, x), reference, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    np.testing.assert_allclose(np.array(module(mx.array(IDS)[None])), np.array(expected), atol=1e-5)


def test_biased_projections_join_with_their_biases() -> None:
    mx.random.seed(0)
    attention = Attention(32, 4, 2, 8, RoPE(8, RopeConfig(), 64), bias=True)
    attention.update({name: {"bias": mx.random.normal((attention[name].weight.shape[0],))}
                      for name in ("q_proj", "k_proj", "v_proj")})
    mx.eval(attention.parameters())
    x = mx.random.normal((2, 5, 32))
    expected = [attention[name](x) for name in ("q_proj", "k_proj", "v_proj")]
    assert fuse_projections(attention) == 1
    for got, want in zip(attention._qkv(attention, x), expected, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
