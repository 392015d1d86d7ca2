"""LoRA adapters: which layers they wrap, training only them (QLoRA on a quantized base), peft's file layout,
loading, swapping and fusing, sessions and batching over an adapted model, and bad adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxchat
from mlxchat import AdapterError, InvalidInputError, TrainingDivergedError
from mlxchat.layers.moe import QuantizedSwitchLinear
from mlxchat.train import (
    Example,
    LoRALinear,
    TrainConfig,
    evaluate,
    load_adapter,
    lora,
    save_adapter,
    save_checkpoint,
    train,
)
from mlxchat.train.lora import DEFAULT_TARGETS, LoRASwitchLinear, adapters, base_weight

FIXTURES = Path(__file__).parent / "fixtures"
IDS = [1, 7, 42, 99, 5, 300, 17, 256, 3, 77]
PEFT_QWEN3 = FIXTURES / "lora" / "qwen3" / "peft"  # a DoRA adapter


def examples() -> list[Example]:
    rng = np.random.default_rng(0)
    return [Example.pretraining(rng.integers(1, 500, 24).tolist()) for _ in range(4)]


def parameters(model: mlxchat.GenerativeModel) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.module.parameters())}


def randomize(model: mlxchat.GenerativeModel, seed: int = 0) -> None:
    def run() -> None:
        mx.random.seed(seed)
        for layer in adapters(model).values():
            layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape)
        mx.eval(model.module.parameters())

    model.worker.run(run)


@pytest.fixture
def qwen3():
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        yield model


def test_lora_wraps_the_targets_by_checkpoint_name(qwen3) -> None:
    names = lora(qwen3, rank=4, targets=("q_proj", "down_proj"))
    assert names == sorted(f"model.layers.{i}.{p}" for i in range(3) for p in ("self_attn.q_proj", "mlp.down_proj"))
    trainable = [k for k, _ in tree_flatten(qwen3.module.trainable_parameters())]
    assert sorted(trainable) == sorted(f"{n}.{ab}" for n in names for ab in ("lora_a", "lora_b"))


def test_lora_uses_checkpoint_names_not_module_names() -> None:
    """LFM2's checkpoint calls its feed-forward w1/w2/w3 and its attention output out_proj (the module renames
    them): peft's default targets adapt only q/k/v there, and so do we; its own names reach the rest."""
    with mlxchat.load_model(FIXTURES / "lfm2") as model:
        assert {n.rsplit(".", 1)[1] for n in lora(model)} == {"q_proj", "k_proj", "v_proj"}
        assert {n.rsplit(".", 1)[1] for n in lora(model, targets=("w1", "out_proj", "in_proj"))} == {
            "w1", "out_proj", "in_proj"}


def test_deltanet_projections_take_adapters() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3_5") as model:
        names = lora(model, targets=("in_proj_qkv", "out_proj"))
    assert names and all(".linear_attn." in n for n in names)
    assert all(n.startswith("model.language_model.layers.") for n in names)


@pytest.mark.parametrize("fixture", ["qwen3_moe", "qwen3_5_moe"])
def test_expert_adapters_keep_to_what_peft_can_load(fixture: str) -> None:
    """Per expert (Qwen3-MoE) or fused (Qwen3.5-MoE) in the checkpoint, the experts are named
    ``...experts.<projection>``; peft adapts them as fused parameters: no dropout or DoRA there, and the gate and
    up projections together."""
    with mlxchat.load_model(FIXTURES / fixture) as model:
        names = lora(model, targets=("experts.gate_proj", "experts.up_proj"))
        assert names and all(n.endswith(("mlp.experts.gate_proj", "mlp.experts.up_proj")) for n in names)
        assert all(isinstance(layer, LoRASwitchLinear) for layer in adapters(model).values())
        assert lora(model, targets=("gate_up_proj",)) == names  # the fused tensor's name targets both
        with pytest.raises(AdapterError, match="no dropout"):
            lora(model, dropout=0.1)
        with pytest.raises(AdapterError, match="no DoRA"):
            lora(model, dora=True)
        with pytest.raises(AdapterError, match="gate and up projections"):
            lora(model, targets=("experts.gate_proj",))
        assert lora(model, dora=True, targets=("q_proj",))  # DoRA where peft has it


def test_a_new_adapter_leaves_the_output_unchanged(qwen3) -> None:
    """Within float rounding: the base runs q/k/v and gate/up as joined products, adapted layers one by one."""
    before = np.array(qwen3.logits(IDS))
    lora(qwen3)
    np.testing.assert_allclose(np.array(qwen3.logits(IDS)), before, atol=1e-5)


def test_no_target_found_is_an_error(qwen3) -> None:
    with pytest.raises(AdapterError, match="no layer.s checkpoint name"):
        lora(qwen3, targets=("w1",))


def targets_for(fixture: str) -> tuple[str, ...]:
    """The default targets, and on Qwen3.5 its DeltaNet layers' projections too, on LFM2 its feed-forward."""
    if fixture.startswith("lfm2"):
        return DEFAULT_TARGETS + ("w1", "w2", "w3")
    return DEFAULT_TARGETS + (("in_proj_qkv", "in_proj_z", "out_proj") if fixture.startswith("qwen3_5") else ())


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3_q4", "qwen3_moe", "qwen3_moe_q4", "qwen3_5_q4", "lfm2_moe",
                                     "gemma4_moe_q4"])
def test_training_updates_only_the_adapters(fixture: str) -> None:
    """Only the adapters train, routed experts' and DeltaNet projections' included; on a quantized base
    (QLoRA) every adapted layer stays quantized."""
    with mlxchat.load_model(FIXTURES / fixture) as model:
        kinds = {path: type(layer) for path, layer in model.module.named_modules()}
        lora(model, rank=4, targets=targets_for(fixture))
        before = parameters(model)
        log = train(model, examples(), TrainConfig(steps=8, learning_rate=1e-2, warmup_steps=0, log_every=1))
        after = parameters(model)
        layers = adapters(model)
    assert log[-1].loss < log[0].loss
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.endswith((".lora_a", ".lora_b")) for k in changed)
    assert {f"{path}.lora_b" for path in layers} <= changed
    if "moe" in fixture:
        assert any(isinstance(layer, LoRASwitchLinear) for layer in layers.values())
    if "qwen3_5" in fixture:
        assert any(".linear_attn." in layer.name for layer in layers.values())
    assert all(type(layer.base) is kinds[path] for path, layer in layers.items())
    if fixture.endswith("q4"):  # QLoRA: the base stays quantized
        assert any(isinstance(layer.base, (nn.QuantizedLinear, QuantizedSwitchLinear)) for layer in layers.values())


def test_gradient_checkpointing_gives_the_same_gradients(qwen3) -> None:
    from mlxchat.train import make_batch, masked_loss
    from mlxchat.train.loop import checkpoint_layers

    lora(qwen3, rank=4)
    randomize(qwen3)
    batch = make_batch(examples())

    def gradients() -> tuple[float, dict[str, np.ndarray]]:
        loss, grads = nn.value_and_grad(qwen3.module, masked_loss)(qwen3.module, batch)
        return loss.item(), {k: np.array(v) for k, v in tree_flatten(grads)}

    loss, plain = qwen3.worker.run(gradients)
    restore = checkpoint_layers(qwen3.module)
    assert all("Checkpointed" in type(layer).__name__ for layer in qwen3.module.model.layers)
    checkpointed_loss, checkpointed = qwen3.worker.run(gradients)
    restore()
    assert not any("Checkpointed" in type(layer).__name__ for _, layer in qwen3.module.named_modules())
    assert checkpointed_loss == pytest.approx(loss, rel=1e-6)
    assert set(checkpointed) == set(plain)
    for name, grad in plain.items():
        np.testing.assert_allclose(checkpointed[name], grad, atol=1e-5 * max(1.0, np.abs(grad).max()))


def test_saved_in_peft_layout(qwen3, tmp_path: Path) -> None:
    lora(qwen3, rank=4, alpha=8, dora=True, targets=("q_proj",))
    save_adapter(qwen3, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["use_dora"] is True and config["bias"] == "none"
    tensors = mx.load(str(tmp_path / "adapter_model.safetensors"))
    assert set(tensors) == {f"base_model.model.model.layers.{i}.self_attn.q_proj.{part}" for i in range(3)
                            for part in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")}
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (128, 4)


@pytest.mark.parametrize("dora", [False, True])
def test_saved_adapter_loads_back(qwen3, tmp_path: Path, dora: bool) -> None:
    lora(qwen3, rank=4, dora=dora)
    randomize(qwen3)
    expected = np.array(qwen3.logits(IDS))
    save_adapter(qwen3, tmp_path)
    with mlxchat.load_model(FIXTURES / "qwen3", adapter=tmp_path) as again:
        assert again.adapter == str(tmp_path)
        np.testing.assert_allclose(np.array(again.logits(IDS)), expected, atol=1e-5)


def test_adapters_swap_and_come_off(qwen3, tmp_path: Path) -> None:
    base = np.array(qwen3.logits(IDS))
    lora(qwen3, rank=4)
    randomize(qwen3, seed=3)
    save_adapter(qwen3, tmp_path / "mine")
    mine = np.array(qwen3.logits(IDS))
    qwen3.load_adapter(PEFT_QWEN3)
    theirs = np.array(qwen3.logits(IDS))
    qwen3.load_adapter(tmp_path / "mine")
    np.testing.assert_allclose(np.array(qwen3.logits(IDS)), mine, atol=1e-5)
    assert np.abs(theirs - mine).max() > 1e-2
    qwen3.remove_adapter()
    assert qwen3.adapter is None and not adapters(qwen3)
    np.testing.assert_allclose(np.array(qwen3.logits(IDS)), base, atol=1e-6)


def test_fused_adapter_gives_the_unfused_logits(tmp_path: Path) -> None:
    with mlxchat.load_model(FIXTURES / "qwen3", adapter=PEFT_QWEN3) as model:
        unfused = np.array(model.logits(IDS))
        assert model.fuse_adapter() == 21
        assert not adapters(model) and model.adapter is None
        np.testing.assert_allclose(np.array(model.logits(IDS)), unfused, atol=1e-4)
        config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
        save_checkpoint(tmp_path, model.module, config=config, tokenizer=model.tokenizer)
    with mlxchat.load_model(tmp_path) as saved:
        np.testing.assert_allclose(np.array(saved.logits(IDS)), unfused, atol=1e-4)


@pytest.mark.parametrize("fixture", ["qwen3_q4", "qwen3_moe_q4", "qwen3_5_q4"])
def test_fusing_on_a_quantized_base_requantizes_the_adapted_weight(fixture: str, tmp_path: Path) -> None:
    """QLoRA fused: each layer (stacked experts too) is the adapted float weight (dequantized base + scale * B @ A)
    quantized with the base's own bits and group size, so the checkpoint stays 4-bit; saved, it loads back with
    the same logits."""
    with mlxchat.load_model(FIXTURES / fixture) as model:
        lora(model, rank=4, targets=targets_for(fixture))
        randomize(model)

        def expected() -> dict[str, list[np.ndarray]]:
            out = {}
            for path, layer in adapters(model).items():
                weight = base_weight(layer.base) + layer.scale * (layer.lora_b @ layer.lora_a)
                out[path] = [np.array(a) for a in mx.quantize(weight, layer.base.group_size, layer.base.bits)]
            return out

        wanted = model.worker.run(expected)
        assert model.fuse_adapter() == len(wanted)
        layers = dict(model.module.named_modules())
        for path, (weight, scales, biases) in wanted.items():
            layer = layers[path]
            assert isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear))
            np.testing.assert_array_equal(np.array(layer["weight"]), weight)
            np.testing.assert_allclose(np.array(layer["scales"]), scales, atol=1e-6)
            np.testing.assert_allclose(np.array(layer["biases"]), biases, atol=1e-6)
        fused = np.array(model.logits(IDS))
        config = json.loads((FIXTURES / fixture / "config.json").read_text())
        save_checkpoint(tmp_path, model.module, config=config, tokenizer=model.tokenizer)
    with mlxchat.load_model(tmp_path) as saved:
        np.testing.assert_allclose(np.array(saved.logits(IDS)), fused, atol=1e-5)


def test_sessions_and_batches_over_an_adapted_model() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
        lora(model, rank=4)
        randomize(model)
        config = {"max_tokens": 6, "temperature": 0.0}
        prompts = [[{"role": "user", "content": text}] for text in ("hello", "what is two and two")]
        alone = [model.generate(p, config).tokens for p in prompts]
        assert [r.tokens for r in model.generate_batch(prompts, config)] == alone
        session = model.chat_session()
        assert session.send("hello", config=config).tokens == alone[0]
        second = session.send("and again", config=config)
        assert second.report.cached_prompt_tokens > 0


def test_prompt_caches_filled_under_one_adapter_are_not_reused_under_another(tmp_path: Path) -> None:
    """After an adapter swap a session's next turn prefills its whole prompt (its cache holds the other adapter's
    keys and values) and answers as a fresh session over the new adapter would; a shared prefix pool gives no
    prefix from caches filled before the swap either."""
    from mlxchat.prefix_cache import PromptCachePool

    config = {"max_tokens": 6, "temperature": 0.0}
    with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
        for seed, folder in ((0, tmp_path / "a"), (1, tmp_path / "b")):
            lora(model, rank=4, seed=seed)
            randomize(model, seed)
            save_adapter(model, folder)
        model.load_adapter(tmp_path / "a")
        model.prefix_cache = PromptCachePool()
        session, other = model.chat_session(), model.chat_session()
        session.send("hello", config=config)
        again = session.send("and again", config=config)
        assert again.report.cached_prompt_tokens > 0  # same adapter: the cache is reused
        other.send("hello", config=config)
        model.load_adapter(tmp_path / "b")
        swapped = session.send("once more", config=config)  # its own cache and the other's are both stale
        assert swapped.report.cached_prompt_tokens == 0
        prompt = session.cache.tokens[: swapped.report.prompt_tokens]  # the turn's prompt, as the session ran it
        assert model.generate(prompt, config).tokens == swapped.tokens


def test_a_session_saved_under_one_adapter_resumes_cold_under_another(tmp_path: Path) -> None:
    """A saved file records the adapter its cache was computed under: loaded under the same adapter the next turn
    reuses the cache; under another (or none) the conversation comes back whole and is prefilled again."""
    config = {"max_tokens": 6, "temperature": 0.0}
    with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
        for seed, folder in ((0, tmp_path / "a"), (1, tmp_path / "b")):
            lora(model, rank=4, seed=seed)
            randomize(model, seed)
            save_adapter(model, folder)
        model.load_adapter(tmp_path / "a")
        session = model.chat_session()
        session.send("hello", config=config)
        session.save(tmp_path / "s.safetensors")
        same = mlxchat.ChatSession.load(model, tmp_path / "s.safetensors")
        assert len(same.cache) > 0 and same.send("again", config=config).report.cached_prompt_tokens > 0
        for change in (lambda: model.load_adapter(tmp_path / "b"), model.remove_adapter):
            change()
            resumed = mlxchat.ChatSession.load(model, tmp_path / "s.safetensors")
            assert len(resumed.cache) == 0 and [m.content for m in resumed.messages] == [
                m.content for m in session.messages]
            reply = resumed.send("again", config=config)
            assert reply.report.cached_prompt_tokens == 0
            fresh = model.chat_session()
            fresh.import_state(session.export_state())
            assert fresh.send("again", config=config).tokens == reply.tokens


def test_an_adapter_for_another_base_is_refused(tmp_path: Path) -> None:
    with mlxchat.load_model(FIXTURES / "lfm2") as other, pytest.raises(AdapterError, match="another model"):
        other.load_adapter(PEFT_QWEN3)


def _copy(tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    out = tmp_path / "adapter"
    shutil.copytree(PEFT_QWEN3, out)
    if edit_config is not None:
        config = json.loads((out / "adapter_config.json").read_text())
        edit_config(config)
        (out / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = dict(mx.load(str(out / "adapter_model.safetensors")))
        edit_tensors(tensors)
        mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors)
    return out


def _wider(tensors: dict) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = mx.zeros((tensors[key].shape[0], 96))


@pytest.mark.parametrize(("edit_config", "edit_tensors", "message"), [
    (lambda c: c.update(r=8), None, "does not match r=8"),
    (None, _wider, "do not fit a layer of 64 inputs"),
    (lambda c: c.update(peft_type="IA3"), None, "only LORA"),
    (lambda c: c.update(use_dora=False), None, "magnitude vector is present"),
    (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save"),
    (None, lambda t: t.update({"base_model.model.lm_head.weight": mx.zeros((2, 2))}), "not peft LoRA weights"),
    (None, lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"), "lora_B missing"),
])
def test_bad_adapters_are_refused_before_mlx_sees_them(qwen3, tmp_path: Path, edit_config, edit_tensors,
                                                       message: str) -> None:
    before = np.array(qwen3.logits(IDS))
    with pytest.raises(AdapterError, match=message):
        load_adapter(qwen3, _copy(tmp_path, edit_config, edit_tensors))
    assert not adapters(qwen3)
    np.testing.assert_allclose(np.array(qwen3.logits(IDS)), before, atol=0)


def _edited(source: Path, out: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(source, out)
    tensors = dict(mx.load(str(out / "adapter_model.safetensors")))
    edit(tensors)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors)
    return out


FUSED = "base_model.model.model.language_model.layers.0.mlp.experts"  # a fused expert tensor's adapter (peft)
PER_EXPERT = "base_model.model.model.layers.0.mlp.experts"


@pytest.mark.parametrize(("fixture", "edit", "message"), [
    ("qwen3_5_moe", lambda t: t.update({f"{FUSED}.lora_A.weight": t[f"{FUSED}.lora_A.weight"][:, :8]}),
     "another model"),
    ("qwen3_5_moe", lambda t: t.update({f"{FUSED}.lora_A.weight": t[f"{FUSED}.lora_A.weight"][:-8]}),
     "another model"),
    ("qwen3_moe", lambda t: [t.pop(f"{PER_EXPERT}.3.down_proj.lora_{ab}.weight") for ab in "AB"],
     "7 of its 8 experts"),
])
def test_bad_expert_adapters_are_refused(tmp_path: Path, fixture: str, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    made_by = "peft" if fixture == "qwen3_5_moe" else "mlxchat"
    adapter = _edited(FIXTURES / "lora" / fixture / made_by, tmp_path / "adapter", edit)
    with mlxchat.load_model(FIXTURES / fixture) as model, pytest.raises(AdapterError, match=message):
        model.load_adapter(adapter)


def test_missing_files_are_clear_errors(qwen3, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="adapter_config.json"):
        qwen3.load_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        qwen3.load_adapter(tmp_path)


def test_lora_on_a_bare_module() -> None:
    """A module from from_scratch has no checkpoint: its own paths are the names (as save_checkpoint writes)."""
    from mlxchat.train import from_scratch

    module = from_scratch({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                           "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": True}, seed=0)
    names = lora(module, rank=2, targets=("v_proj",))
    assert names == ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
    assert isinstance(module.model.layers[0].self_attn.v_proj, LoRALinear)


class Killed(Exception):
    pass


def test_a_run_killed_midway_resumes_where_it_would_have_been(tmp_path: Path) -> None:
    """Six LoRA steps saving every two, killed after step three and started again, end with the weights and
    log of an uninterrupted run (the optimizer state and the data order are restored)."""
    config = TrainConfig(steps=6, learning_rate=1e-2, warmup_steps=2, log_every=1, save_every=2,
                         batch_tokens=48)

    def run(folder: Path, kill_at: int | None = None) -> tuple[list, dict[str, np.ndarray]]:
        with mlxchat.load_model(FIXTURES / "qwen3") as model:
            mx.random.seed(0)
            lora(model, rank=4)

            def on_log(entry) -> None:
                if entry.step == kill_at:
                    raise Killed

            log = train(model, examples(), config, checkpoint_dir=folder, on_log=on_log)
            return log, {k: np.array(v) for k, v in tree_flatten(model.module.trainable_parameters())}

    whole_log, whole = run(tmp_path / "whole")
    with pytest.raises(Killed):
        run(tmp_path / "killed", kill_at=3)
    assert (tmp_path / "killed" / "latest").read_text() == "step-0000002"
    resumed_log, resumed = run(tmp_path / "killed")
    assert [(r.step, r.tokens) for r in resumed_log] == [(r.step, r.tokens) for r in whole_log]
    assert [r.loss for r in resumed_log] == pytest.approx([r.loss for r in whole_log], rel=1e-5)
    for name, value in whole.items():
        np.testing.assert_allclose(resumed[name], value, atol=1e-6)


def test_a_diverging_step_is_never_applied_nor_saved(tmp_path: Path) -> None:
    """A step whose loss or gradients are not finite raises TrainingDivergedError before the update: the adapter in
    memory and the newest checkpoint are those of the last good step (NaN weights were saved as `latest`)."""
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        lora(model, rank=4, seed=0)
        config = TrainConfig(steps=20, learning_rate=1e30, warmup_steps=0, save_every=1, batch_tokens=48)
        with pytest.raises(TrainingDivergedError, match="the step was not applied"):
            train(model, examples(), config, checkpoint_dir=tmp_path)
        weights = [np.array(v) for _, v in tree_flatten(model.module.trainable_parameters())]
        assert all(np.isfinite(w).all() for w in weights)
        saved = mx.load(str(tmp_path / (tmp_path / "latest").read_text() / "state.safetensors"))
        assert all(np.isfinite(np.array(v)).all() for k, v in saved.items() if k.startswith("params."))


def test_examples_from_outside_are_checked_before_mlx_sees_them() -> None:
    """Eval examples' ids too (one past the vocabulary crashed the process), ids that are no ints, examples too
    short for a target or longer than the context, and masks that are no booleans."""
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        lora(model, rank=4, seed=0)
        good = examples()
        config = TrainConfig(steps=1, warmup_steps=0, batch_tokens=48)
        vocab = model.config.vocab_size
        for bad, message in ((Example([vocab] + good[0].ids[1:], good[0].mask), "outside the vocabulary"),
                             (Example([1.7, 2.0, 3.0], [True] * 3), "must be an integer"),
                             (Example([1], [True]), "two or more"),
                             (Example([1] * (model.context_length + 1), [True] * (model.context_length + 1)),
                              "context holds"),
                             (Example([1, 2, 3], [True, float("nan"), True]), "loss mask")):
            with pytest.raises(InvalidInputError, match=message):
                train(model, good, config, eval_examples=[bad])
            with pytest.raises(InvalidInputError, match=message):
                train(model, [*good, bad], config)
        with pytest.raises(InvalidInputError, match="outside the vocabulary"):
            evaluate(model.module, [Example([vocab, 1, 2], [True] * 3)])
        with pytest.raises(InvalidInputError, match="no eval targets"):
            train(model, good, config, eval_examples=[Example([1, 2, 3], [False] * 3)])


def test_an_adapter_with_dropout_is_deterministic_at_inference(qwen3) -> None:
    """peft adapters ship with lora_dropout 0.05-0.1: dropout runs in training only (made adapters were left in
    training mode, so two calls to logits differed)."""
    lora(qwen3, rank=4, dropout=0.5, seed=0)
    randomize(qwen3)
    np.testing.assert_array_equal(np.array(qwen3.logits(IDS)), np.array(qwen3.logits(IDS)))


@pytest.mark.parametrize(("edit_config", "edit_tensors", "message"), [
    (lambda c: c.update(use_rslora="false"), None, "true or false"),
    (lambda c: c.update(lora_dropout=2.0), None, "lora_dropout"),
    (lambda c: c.update(target_modules=5), None, "target_modules"),
    (lambda c: c.update(rank_pattern={"(": 4}), None, "no pattern"),
    (lambda c: c.update(rank_pattern={"(?i)q_proj": 4}), None, "no pattern"),
    (lambda c: c.update(alpha_pattern={"q_proj": float("inf")}), None, "positive numbers"),
    (None, lambda t: t.update({k: mx.full(v.shape, float("nan")) for k, v in t.items() if "lora_B" in k}),
     "NaN or infinite"),
])
def test_adapter_settings_and_weights_that_would_misbehave_are_refused(qwen3, tmp_path: Path, edit_config,
                                                                      edit_tensors, message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        load_adapter(qwen3, _copy(tmp_path, edit_config, edit_tensors))
    assert not adapters(qwen3)


def test_lora_refuses_settings_that_are_no_numbers_or_not_finite(qwen3) -> None:
    for settings in ({"rank": 2.5}, {"alpha": float("nan")}, {"alpha": float("inf")}, {"rank": 10**12}):
        with pytest.raises(InvalidInputError, match="lora needs"):
            lora(qwen3, **settings)
    lora(qwen3, rank=np.int64(4), alpha=np.float32(8.0))  # numpy's numbers are numbers
    assert next(iter(adapters(qwen3).values())).lora_a.shape[0] == 4


def test_a_refused_resume_leaves_the_weights_as_they_were(tmp_path: Path) -> None:
    """Every check of a checkpoint runs before anything is restored: a run refused (fewer steps than the
    checkpoint's, a damaged moment) keeps the adapter it had, so a retry elsewhere starts from it."""
    config = TrainConfig(steps=2, warmup_steps=0, batch_tokens=48)
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        lora(model, rank=4, seed=0)
        train(model, examples(), config, checkpoint_dir=tmp_path / "run")
        for damage in ("moment", None):
            lora(model, rank=4, seed=1)
            before = {k: np.array(v) for k, v in tree_flatten(model.module.trainable_parameters())}
            if damage:
                _spoil_checkpoint(tmp_path / "run", damage)
            with pytest.raises(mlxchat.CheckpointError):
                train(model, examples(), config.model_copy(update={"steps": 1 if damage is None else 3}),
                      checkpoint_dir=tmp_path / "run")
            after = {k: np.array(v) for k, v in tree_flatten(model.module.trainable_parameters())}
            assert all(np.array_equal(before[k], after[k]) for k in before)


def _spoil_checkpoint(folder: Path, damage: str) -> None:
    step = folder / (folder / "latest").read_text()
    if damage == "pointer":
        (folder / "latest").write_bytes(b"\xff\xfe")
    elif damage in ("step", "log", "far step"):
        info = json.loads((step / "state.json").read_text())
        info.update({"step": -4} if damage == "step" else {"log": [{"nothing": 1}]} if damage == "log"
                    else {"step": 10**12})
        (step / "state.json").write_text(json.dumps(info))
    else:
        tensors = dict(mx.load(str(step / "state.safetensors")))
        key = next(k for k in sorted(tensors) if k.startswith("params." if damage == "dtype" else "optimizer.")
                   and tensors[k].ndim == 2)
        tensors[key] = tensors[key].astype(mx.int32) if damage == "dtype" else tensors[key][:1]
        mx.save_safetensors(str(step / "state.safetensors"), tensors)


@pytest.mark.parametrize("damage", ["pointer", "step", "log", "far step", "dtype", "moment"])
def test_a_damaged_training_checkpoint_is_refused_on_resume(tmp_path: Path, damage: str) -> None:
    """Resuming reads the pointer, state.json and the tensors: damage is a CheckpointError, never a raw
    exception, a replay of 10**12 batches, weights of another dtype or an optimizer moment broadcast silently."""
    config = TrainConfig(steps=2, warmup_steps=0, batch_tokens=48)
    with mlxchat.load_model(FIXTURES / "qwen3") as model:
        lora(model, rank=4, seed=0)
        train(model, examples(), config, checkpoint_dir=tmp_path)
        _spoil_checkpoint(tmp_path, damage)
        with pytest.raises(mlxchat.CheckpointError):
            train(model, examples(), config.model_copy(update={"steps": 3}), checkpoint_dir=tmp_path)


def test_writing_where_it_cannot_is_a_clear_error(qwen3, tmp_path: Path) -> None:
    """An adapter, a checkpoint or a training state written over a file (or to an empty path, which meant the
    current folder) is an error of ours naming the place, not a raw OSError after the steps."""
    lora(qwen3, rank=4, seed=0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path in (blocker, ""):
        with pytest.raises(AdapterError):
            save_adapter(qwen3, path)
    with pytest.raises(mlxchat.CheckpointError, match="cannot write the training checkpoint"):
        train(qwen3, examples(), TrainConfig(steps=1, warmup_steps=0, batch_tokens=48), checkpoint_dir=blocker)
    with pytest.raises(mlxchat.CheckpointError, match="cannot write the checkpoint"):
        save_checkpoint(blocker / "inside", qwen3.module, config={}, tokenizer=qwen3.tokenizer)


def test_the_server_serves_an_adapted_model() -> None:
    """A chat completion from a server over a model with an adapter is the model's own greedy reply."""
    import httpx

    from server_support import serving

    with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
        lora(model, rank=4, seed=0)
        randomize(model)
        messages = [{"role": "user", "content": "hello"}]
        expected = model.generate(messages, {"max_tokens": 6, "temperature": 0.0}).text
        with serving("qwen3_chat", model=model) as served:
            reply = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0.0}).json()
    choice = reply["choices"][0]["message"]
    assert choice["content"] == expected
