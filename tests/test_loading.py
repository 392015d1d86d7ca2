"""Loading checkpoints: dialects, layouts, the Hub cache, plugins, and a clear error for every bad input."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat import CheckpointError, UnknownModelTypeError, UnsupportedQuantizationError
from mlxchat.config import RopeConfig, normalize_rope
from mlxchat.testing import assert_close, full_logits

from conftest import fixture_path, loaded, reference

registry_module = importlib.import_module("mlxchat.registry")  # the module, not the function


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3"
    shutil.copytree(fixture_path("qwen3"), folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_weights(folder: Path, edit) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def test_missing_config_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        mlxchat.load_model(checkpoint)


def test_malformed_json_names_the_file(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        mlxchat.load_model(checkpoint)


def test_no_weights(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        mlxchat.load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        mlxchat.load_model(checkpoint)


def test_extra_tensor_is_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda w: w.update({"model.layers.0.extra.weight": mx.zeros((2,))}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
        mlxchat.load_model(checkpoint)


def test_wrong_shape_is_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda w: w.update({"model.norm.weight": mx.zeros((63,))}))
    with pytest.raises(CheckpointError, match=r"wrong shapes: model\.norm\.weight \(63,\) \(expected \(64,\)\)"):
        mlxchat.load_model(checkpoint)


def test_integer_weights_where_the_model_computes_in_floats_are_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda w: w.update({"model.norm.weight": w["model.norm.weight"].astype(mx.int8)}))
    with pytest.raises(CheckpointError, match=r"wrong dtypes: model\.norm\.weight int8 \(expected float32\)"):
        mlxchat.load_model(checkpoint)


def test_config_that_does_not_fit_the_weights(checkpoint: Path) -> None:
    edit_config(checkpoint, num_hidden_layers=4)
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.3\."):
        mlxchat.load_model(checkpoint)


def test_corrupt_safetensors_is_named(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors file \(truncated"):
        mlxchat.load_model(checkpoint)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors file"):
        mlxchat.load_model(checkpoint)


def test_a_safetensors_header_that_is_no_object_or_nests_too_deep_is_named(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    for header in (b"[1, 2]", b"[" * 100_000 + b"]" * 100_000):
        path.write_bytes(len(header).to_bytes(8, "little") + header)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors file"):
            mlxchat.load_model(checkpoint)


def test_tensors_whose_bytes_overlap_are_refused(checkpoint: Path) -> None:
    # Two tensors of one shape and dtype made to read the same bytes loaded, each as the other's values.
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    first, second = sorted(k for k in header if k.endswith("input_layernorm.weight"))[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    with pytest.raises(CheckpointError, match=r"corrupt safetensors file \(a tensor's data_offsets .* overlap"):
        mlxchat.load_model(checkpoint)


def test_weights_that_cannot_be_read_are_named(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    path.unlink()
    path.symlink_to(checkpoint / "gone.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read \(No such file"):
        mlxchat.load_model(checkpoint)
    path.unlink()
    path.mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read \(Is a directory"):
        mlxchat.load_model(checkpoint)


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/passwd", 5, ""])
def test_a_shard_index_may_name_only_files_inside_the_checkpoint(checkpoint: Path, shard) -> None:
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    with pytest.raises(CheckpointError, match=r"index\.json: shard .* is not the name of a file in the checkpoint"):
        mlxchat.load_model(checkpoint)


def test_json_files_that_are_folders_nest_too_deep_or_are_not_utf8_are_named(checkpoint: Path) -> None:
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(config.rstrip()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON \(maximum recursion depth"):
        mlxchat.load_model(checkpoint)
    (checkpoint / "config.json").write_text(config)
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "generation_config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not a regular file"):
        mlxchat.load_model(checkpoint)
    (checkpoint / "generation_config.json").rmdir()
    os.mkfifo(checkpoint / "generation_config.json")  # (reading it would wait for a writer for ever)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not a regular file"):
        mlxchat.load_model(checkpoint)
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: cannot read the chat template"):
        mlxchat.load_model(checkpoint)


@pytest.mark.parametrize("changes, problem", [
    ({"text_config": "qwen3"}, "text_config must be a JSON object"),
    ({"rope_scaling": ["linear", 2]}, "rope_scaling must be a JSON object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 1e308}}, "stretches max_position_embeddings .* past any"),
    ({"hidden_size": 10**12}, "cannot be built \\(OverflowError"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, but the weights hold"),
])
def test_config_values_that_break_the_loader_are_checkpoint_errors(checkpoint: Path, changes, problem) -> None:
    edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=problem):
        mlxchat.load_model(checkpoint)


@pytest.mark.parametrize("changes", [
    {"rope_parameters": {"rope_theta": 0}}, {"rope_parameters": {"rope_theta": -1.0}},
    {"rope_parameters": {"rope_theta": float("inf")}}, {"rms_norm_eps": float("nan")}, {"rms_norm_eps": -1e-6},
    {"max_position_embeddings": 0}, {"partial_rotary_factor": 2.0}, {"rope_parameters": {"factor": 0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": -4}},
])
def test_config_values_that_give_nan_logits_or_no_context_are_refused_at_load(checkpoint: Path, changes) -> None:
    edit_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match="does not describe a valid Qwen3Config"):
        mlxchat.load_model(checkpoint)


@pytest.mark.parametrize("eos", [99999, -1, [2, 512], "2", [[2]], True])
def test_an_eos_token_id_outside_the_vocabulary_is_named_at_load(checkpoint: Path, eos) -> None:
    edit_config(checkpoint, eos_token_id=eos)
    with pytest.raises(CheckpointError, match=r"config\.json: eos_token_id .* is not a token id of this model"):
        mlxchat.load_model(checkpoint)


def test_generation_config_settings_out_of_range_name_the_file(checkpoint: Path) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": -1, "do_sample": True}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: .*temperature"):
        mlxchat.load_model(checkpoint)


def test_unsupported_quantization(checkpoint: Path) -> None:
    edit_config(checkpoint, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedQuantizationError, match="'gptq' is not supported"):
        mlxchat.load_model(checkpoint)
    edit_config(checkpoint, quantization_config=None, quantization={"group_size": 64, "bits": 7})
    with pytest.raises(UnsupportedQuantizationError, match="7 bits is not supported"):
        mlxchat.load_model(checkpoint)


def test_unknown_model_type_lists_the_known_ones_and_how_to_add_one(checkpoint: Path) -> None:
    edit_config(checkpoint, model_type="mamba9")
    with pytest.raises(UnknownModelTypeError) as info:
        mlxchat.load_model(checkpoint)
    message = str(info.value)
    assert "'mamba9'" in message and "mlxchat.plugins" in message
    assert all(t in message for t in ("qwen3", "qwen3_moe"))


def test_missing_tokenizer_is_named(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        mlxchat.load_model(checkpoint)


def test_detect_model_type_reads_top_level_or_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"model_type": "qwen3_5_text"}}))
    assert mlxchat.detect_model_type(tmp_path) == "qwen3_5_text"
    assert mlxchat.detect_model_type(fixture_path("qwen3_moe")) == "qwen3_moe"


def test_sharded_checkpoint_loads_identically(checkpoint: Path) -> None:
    weights = mx.load(str(checkpoint / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        mx.save_safetensors(str(checkpoint / file), {k: weights[k] for k in keys})
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    ref = reference("qwen3")
    assert_close(full_logits(mlxchat.load_model(checkpoint), ref["input_ids"]), ref["logits"])
    (checkpoint / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard listed"):
        mlxchat.load_model(checkpoint)


def test_rope_dialects_agree() -> None:
    v4 = normalize_rope({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768}})
    v5 = normalize_rope({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                             "original_max_position_embeddings": 32768}})
    assert RopeConfig.model_validate(v4) == RopeConfig.model_validate(v5)
    assert RopeConfig.model_validate(normalize_rope({})).rope_theta == 10000.0


def test_dtype_policy_and_override() -> None:
    default = loaded("qwen3")
    assert default.dtype == mx.float32  # CPU default: float32 compute
    half = mlxchat.load_model(fixture_path("qwen3"), dtype="bfloat16")
    assert half.dtype == mx.bfloat16
    assert half.module.model.embed_tokens.weight.dtype == mx.bfloat16
    ref = reference("qwen3")
    assert np.abs(full_logits(half, ref["input_ids"]) - ref["logits"]).max() < 0.1


def test_hub_repo_id_from_the_offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-qwen3" / "snapshots" / ("0" * 40)
    shutil.copytree(fixture_path("qwen3"), snapshot)
    (cache / "models--acme--tiny-qwen3" / "refs").mkdir()
    (cache / "models--acme--tiny-qwen3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    model = mlxchat.load_model("acme/tiny-qwen3")
    assert model.path == snapshot
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        mlxchat.load_model("acme/missing")
    with pytest.raises(CheckpointError, match="no such folder"):
        mlxchat.load_model("./does/not/exist")


TOY_PLUGIN = '''
"""A third-party plugin: a tiny pre-norm decoder with a plain MLP, built from mlxchat's layers."""
import mlx.core as mx
import mlx.nn as nn
from mlxchat import Architecture, ChatQuirks, ModelConfig, RopeConfig, hookimpl
from mlxchat.layers import Attention, CausalLM, Decoder, RMSNorm, RoPE


class ToyConfig(ModelConfig):
    num_attention_heads: int
    intermediate_size: int
    rope: RopeConfig


class ToyBlock(nn.Module):
    def __init__(self, c, rope):
        super().__init__()
        d = c.hidden_size // c.num_attention_heads
        self.norm = RMSNorm(c.hidden_size)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.num_attention_heads, d, rope)
        self.fc = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, x, cache):
        h = x + self.attn(self.norm(x), cache)
        return h + self.fc(nn.gelu(h))


class ToyLM(CausalLM):
    def __init__(self, c):
        rope = RoPE(c.hidden_size // c.num_attention_heads, c.rope)
        blocks = [ToyBlock(c, rope) for _ in range(c.num_hidden_layers)]
        super().__init__(c, Decoder(c.vocab_size, c.hidden_size, blocks, RMSNorm(c.hidden_size)))


@hookimpl
def mlxchat_architectures():
    return [Architecture("toy", ("toy_lm",), ToyConfig, ToyLM, ChatQuirks(tool_format=None))]
'''


def test_a_third_party_plugin_registers_through_the_entry_point_group(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    (site / "toy_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "toy_plugin.py").write_text(textwrap.dedent(TOY_PLUGIN))
    metadata = "Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n"
    (site / "toy_plugin-0.1.dist-info" / "METADATA").write_text(metadata)
    (site / "toy_plugin-0.1.dist-info" / "entry_points.txt").write_text("[mlxchat.plugins]\ntoy = toy_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    fresh = registry_module.Registry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    assert "toy" in fresh.architectures() and "qwen3" in fresh.architectures()

    folder = tmp_path / "toy"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture_path("qwen3") / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": "toy_lm", "vocab_size": 512, "hidden_size": 32,
                                                    "num_hidden_layers": 2, "num_attention_heads": 2,
                                                    "intermediate_size": 64, "tie_word_embeddings": True}))
    toy = sys.modules["toy_plugin"]
    module = toy.ToyLM(toy.ToyConfig.from_hf(json.loads((folder / "config.json").read_text())))
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(module.parameters())))
    model = mlxchat.load_model(folder)
    assert model.architecture.name == "toy"
    assert_close(full_logits(model, np.arange(10)), np.array(module(mx.arange(10)[None])[0]))
    session = model.chat_session()
    assert session.send("Hi", config={"max_tokens": 3, "temperature": 0.0}).report.generated_tokens <= 3
