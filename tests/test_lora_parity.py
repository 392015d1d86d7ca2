"""LoRA adapters against peft (the oracle), on the tiny fixtures of all eight model types (routed experts
included), and QLoRA on their 4-bit copies against the dequantized base.

tests/fixtures/make_lora_fixtures.py made, for each, an adapter with peft (A and B random) and one with mlxchat,
and stored peft's logits with each loaded in transformers: a peft adapter read here must give peft's logits,
and ours, read by peft, gave the logits we give (the script refuses to write the fixture otherwise). That last
check needs torch; here, mlxchat's adapter read and written again must give the very files peft read, so a
change to the writer cannot quietly break peft's loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlxchat
from mlxchat.layers.moe import QuantizedSwitchLinear, SwitchLinear
from mlxchat.train import save_adapter
from mlxchat.train.lora import LoRASwitchLinear, adapters, base_weight

FIXTURES = Path(__file__).parent / "fixtures"
MODEL_TYPES = ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma4_moe", "lfm2", "lfm2_moe"]
MOE = [name for name in MODEL_TYPES if name.endswith("_moe")]
QUANTIZED = sorted(p.name for p in FIXTURES.glob("*_q4") if (FIXTURES / "lora" / p.name.removesuffix("_q4")).is_dir())
TOLERANCE = 1e-4


def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "lora" / name / "logits.npz"))


@pytest.mark.parametrize("name", MODEL_TYPES)
@pytest.mark.parametrize("made_by", ["peft", "mlxchat"])
def test_adapter_gives_peft_logits(name: str, made_by: str) -> None:
    expected = reference(name)
    with mlxchat.load_model(FIXTURES / name, dtype="float32", adapter=FIXTURES / "lora" / name / made_by) as model:
        assert adapters(model), "no layer was adapted"
        got = np.array(model.logits(expected["ids"].tolist()))
    np.testing.assert_allclose(got, expected[made_by], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("made_by", ["peft", "mlxchat"])
def test_routed_experts_take_adapters_that_matter(name: str, made_by: str) -> None:
    """Every stacked expert layer is adapted, and without those adapters the logits are not peft's."""
    expected = reference(name)
    with mlxchat.load_model(FIXTURES / name, dtype="float32", adapter=FIXTURES / "lora" / name / made_by) as model:
        stacked = {p for p, layer in model.module.named_modules() if isinstance(layer, SwitchLinear)}
        wrapped = {p for p, layer in adapters(model).items() if isinstance(layer, LoRASwitchLinear)}
        assert wrapped and {f"{p}.base" for p in wrapped} == stacked

        def drop_experts() -> None:
            for layer in adapters(model).values():
                if isinstance(layer, LoRASwitchLinear):
                    layer.lora_b = mx.zeros_like(layer.lora_b)

        model.worker.run(drop_experts)
        without = np.array(model.logits(expected["ids"].tolist()))
    assert np.abs(without - expected[made_by]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_our_adapter_saves_again_as_the_files_peft_read(name: str, tmp_path: Path) -> None:
    folder = FIXTURES / "lora" / name / "mlxchat"
    with mlxchat.load_model(FIXTURES / name, dtype="float32", adapter=folder) as model:
        save_adapter(model, tmp_path)
    stored = json.loads((folder / "adapter_config.json").read_text())
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: v for k, v in written.items() if k != "base_model_name_or_path"} == {
        k: v for k, v in stored.items() if k != "base_model_name_or_path"}
    theirs = mx.load(str(folder / "adapter_model.safetensors"))
    ours = mx.load(str(tmp_path / "adapter_model.safetensors"))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and mx.array_equal(ours[key], value).item(), key


@pytest.mark.parametrize("name", ["qwen3", "lfm2"])
def test_adapter_changes_the_logits(name: str) -> None:
    """The fixture adapters are not near zero: the parity above would not hold by accident."""
    expected = reference(name)
    with mlxchat.load_model(FIXTURES / name, dtype="float32") as model:
        base = np.array(model.logits(expected["ids"].tolist()))
    assert np.abs(base - expected["peft"]).max() > 100 * TOLERANCE


def _dequantized(model: mlxchat.GenerativeModel) -> None:
    """Replace the model's quantized layers (linear and stacked experts) by float ones holding the same
    (dequantized) weights."""

    def swap() -> None:
        from mlx.utils import tree_unflatten

        pairs: list[tuple[str, nn.Module]] = []
        for path, layer in model.module.named_modules():
            if isinstance(layer, nn.QuantizedLinear):
                weight = base_weight(layer)
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
                linear.weight = weight
                if "bias" in layer:
                    linear.bias = layer["bias"]
                pairs.append((path, linear))
            elif isinstance(layer, QuantizedSwitchLinear):
                weight = base_weight(layer)
                experts = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0])
                experts.weight = weight
                pairs.append((path, experts))
        model.module.update_modules(tree_unflatten(pairs))
        mx.eval(model.module.parameters())

    model.worker.run(swap)


@pytest.mark.parametrize("quantized", QUANTIZED)
def test_qlora_matches_the_dequantized_base(quantized: str) -> None:
    """peft's adapter for the float fixture on its 4-bit copy (quantized layers stay quantized: QLoRA) gives the
    logits of the same adapter on the dequantized float weights."""
    name = quantized.removesuffix("_q4")
    ids = reference(name)["ids"].tolist()
    adapter = FIXTURES / "lora" / name / "peft"
    with mlxchat.load_model(FIXTURES / quantized, adapter=adapter) as model:
        layers = adapters(model)
        assert any(isinstance(lay.base, nn.QuantizedLinear) for lay in layers.values())
        if name in MOE:  # QLoRA on the experts too
            assert any(isinstance(lay.base, QuantizedSwitchLinear) for lay in layers.values())
        got = np.array(model.logits(ids))
    with mlxchat.load_model(FIXTURES / quantized) as plain:
        _dequantized(plain)
        assert plain.load_adapter(adapter) == sorted(lay.name for lay in layers.values())
        assert not any(isinstance(lay.base, (nn.QuantizedLinear, QuantizedSwitchLinear))
                       for lay in adapters(plain).values())
        expected = np.array(plain.logits(ids))
    np.testing.assert_allclose(got, expected, atol=3e-4, rtol=0)
