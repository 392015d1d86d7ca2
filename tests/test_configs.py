"""Named configs and build_model: every released config parses with its plugin and describes a model of
the size its name says; build_model gives a seeded random model of any registered architecture, with or
without a tokenizer."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxchat
from mlxchat import configs

from conftest import fixture_path

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def tiny_qwen3() -> dict:
    return {**configs.get("qwen3-0.6b"), **TINY}


def test_the_families_the_plugins_serve_are_all_named() -> None:
    names = configs.list()
    assert names == sorted(names) and len(names) == 24
    for family in ("qwen3-", "qwen3.5-", "lfm2-", "gemma-4-"):
        assert any(name.startswith(family) for name in names)
    assert configs.source("qwen3-30b-a3b") == "Qwen/Qwen3-30B-A3B"
    assert all(configs.source(name).count("/") == 1 for name in names)


@pytest.mark.parametrize("name", configs.list())
def test_a_named_config_describes_a_model_of_the_size_its_name_says(name: str) -> None:
    """Counted on the module built without evaluating anything (MLX is lazy: no weights are made)."""
    raw = configs.get(name)
    arch = mlxchat.registry().architecture_for_config(raw)
    config = arch.config_class.from_hf(raw)
    params = dict(tree_flatten(arch.model_class(config).parameters()))
    count = sum(v.size for v in params.values())
    if re.match(r"gemma-4-e\d", name):  # "E2B": effective parameters, the per-layer embedding table aside
        count -= sum(v.size for k, v in params.items() if "embed_tokens_per_layer" in k)
    number, unit = re.search(r"(\d+(?:\.\d+)?)([bm])", name.split("-", 2)[-1] if "gemma" in name else name).groups()
    stated = float(number) * (1e9 if unit == "b" else 1e6)
    assert abs(count - stated) / stated < 0.2, f"{name}: {count / 1e9:.2f}B parameters"


def test_get_returns_a_fresh_copy_and_unknown_names_are_listed() -> None:
    configs.get("qwen3-0.6b")["hidden_size"] = 1
    assert configs.get("qwen3-0.6b")["hidden_size"] == 1024
    with pytest.raises(KeyError, match="qwen3-0.6b"):
        configs.get("qwen9")


def test_build_model_is_seeded() -> None:
    with (mlxchat.build_model(tiny_qwen3(), seed=1) as a, mlxchat.build_model(tiny_qwen3(), seed=1) as b,
          mlxchat.build_model(tiny_qwen3(), seed=2) as c):
        logits = [np.array(m.logits([1, 2, 3])) for m in (a, b, c)]
    assert np.array_equal(logits[0], logits[1]) and not np.allclose(logits[0], logits[2])


def test_a_model_without_tokenizer_takes_token_ids() -> None:
    with mlxchat.build_model(tiny_qwen3(), dtype="bfloat16") as model:
        assert model.dtype == mx.bfloat16
        result = model.generate([1, 2, 3], {"max_tokens": 4, "temperature": 0.0})
        assert len(result.tokens) == 4 and result.text == ""
        with pytest.raises(mlxchat.MlxchatError, match="without a tokenizer"):
            model.generate("Hello")
        with pytest.raises(mlxchat.TemplateError, match="no chat template"):
            model.chat_session().send("Hello")


def test_a_tokenizer_folder_brings_text_prompts_and_chat() -> None:
    with mlxchat.build_model(tiny_qwen3(), tokenizer=fixture_path("qwen3")) as model:
        reply = model.chat_session(system="Be brief.").send("Hello", config={"max_tokens": 3, "temperature": 0.0})
        assert reply.report.generated_tokens == 3 and reply.report.prompt_tokens > 5


def test_given_weights_are_checked_like_a_checkpoints() -> None:
    with mlxchat.load_model(fixture_path("qwen3"), dtype="float32") as loaded:
        weights = dict(tree_flatten(loaded.module.parameters()))
        config = loaded.config
        expected = np.array(loaded.logits([5, 6, 7]))
    with mlxchat.build_model(config, weights=weights) as built:
        assert np.array_equal(np.array(built.logits([5, 6, 7])), expected)
    with pytest.raises(mlxchat.CheckpointError, match="missing tensors: model.norm.weight"):
        mlxchat.build_model(config, weights={k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="random"):
        mlxchat.build_model(config, weights="zeros")  # type: ignore[arg-type]
