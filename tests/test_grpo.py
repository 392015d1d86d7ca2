"""GRPO: the objective's arithmetic, an update moving the policy toward the better completions on LoRA adapters
(QLoRA too), gradient checkpointing, rewards that fail, the built-in rewards, silence unless asked, and a run
killed midway (by an exception, or a SIGKILL of ``mlxchat train grpo``) resuming to the uninterrupted result."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from pydantic import ValidationError
from test_lora_cli import killed_after_its_first_checkpoint

import mlxchat
from mlxchat import RewardError
from mlxchat.train import GRPOConfig, TrainConfig, grpo, lora, rewards
from mlxchat.train.grpo import _advantages, clipped_objective

FIXTURES = Path(__file__).parent / "fixtures"
grpo_module = importlib.import_module("mlxchat.train.grpo")  # the package exports its function by that name
PROMPTS = [[{"role": "user", "content": w}] for w in ("hello", "hi there", "good day", "hey")]


def vowels(prompt, completion: str) -> float:
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


@pytest.fixture
def chat():
    mx.random.seed(0)  # lora's A
    with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
        yield model


def trainable(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.module.trainable_parameters())}


def test_group_normalised_advantages() -> None:
    totals = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    scaled = _advantages(totals, scale=True)
    np.testing.assert_allclose(scaled[0], [1, -1, -1, 1], atol=1e-3)
    np.testing.assert_allclose(scaled[1], 0.0)  # a group that agrees teaches nothing
    np.testing.assert_allclose(_advantages(totals, scale=False)[0], [0.5, -0.5, -0.5, 0.5])  # Dr. GRPO


def test_clipped_objective_and_kl() -> None:
    logp = mx.array([[-1.0, -2.0, -0.5]])
    old = mx.array([[-1.5, -2.0, -0.1]])
    ref = mx.array([[-1.2, -1.0, -0.5]])
    mask = mx.array([[1.0, 1.0, 0.0]])
    for advantage in (1.0, -1.0):
        loss, kl = clipped_objective(logp, old, ref, mx.array([advantage]), mask, clip_eps=0.2, beta=0.1)
        ratio = np.exp(np.array(logp) - np.array(old))[0]
        clipped = np.clip(ratio, 0.8, 1.2)
        objective = np.minimum(ratio * advantage, clipped * advantage)
        delta = (np.array(ref) - np.array(logp))[0]
        k3 = np.exp(delta) - delta - 1
        expected = -((objective - 0.1 * k3)[:2]).mean()
        assert loss.item() == pytest.approx(expected, rel=1e-6)
        assert kl.item() == pytest.approx(k3[:2].mean(), rel=1e-6)
    no_kl_loss, no_kl = clipped_objective(logp, old, None, mx.array([1.0]), mask, clip_eps=0.2, beta=0.0)
    assert no_kl.item() == 0.0


def test_an_update_moves_the_policy_toward_the_better_completions_and_trains_only_the_adapters(
        chat, monkeypatch) -> None:
    """An update raises the log-probability of the completions that scored above their group's mean against those
    below it: the policy gradient's direction, certain to first order at a small learning rate. (How much the
    sampled reward rises over a short run is not: at temperature 1 a float summed in another order on another
    CPU draws other samples; experiments/grpo_arithmetic.py measures the reward.)"""
    lora(chat, rank=8)
    before = {k: np.array(v) for k, v in tree_flatten(chat.module.parameters())}
    sampled, real_batch = [], grpo_module._batch

    def batch(*args):  # on the worker, before the update: the rollout and its log-probabilities then
        rollout = real_batch(*args)
        old = grpo_module._token_logprobs(chat.module, rollout.inputs, rollout.targets)
        mx.eval(old)
        sampled.append((rollout, old))
        return rollout

    monkeypatch.setattr(grpo_module, "_batch", batch)
    log = grpo(chat, PROMPTS, [vowels], GRPOConfig(steps=3, group_size=4, prompts_per_step=2, max_tokens=12,
                                                   learning_rate=1e-4, beta=0.0))
    assert [r.step for r in log] == [1, 2, 3] and len(sampled) == 3
    rollout, old = sampled[-1]

    def gain() -> np.ndarray:  # per completion, on the worker (the thread with the model's stream)
        new = grpo_module._token_logprobs(chat.module, rollout.inputs, rollout.targets)
        return np.array(((new - old) * rollout.mask).sum(axis=1))

    gains, advantages = chat.worker.run(gain), chat.worker.run(lambda: np.array(rollout.advantages))
    assert np.any(advantages > 0) and np.any(advantages < 0)
    assert float(advantages @ gains) > 0
    assert gains[advantages > 0].mean() > gains[advantages < 0].mean()
    after = {k: np.array(v) for k, v in tree_flatten(chat.module.parameters())}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.endswith((".lora_a", ".lora_b")) for k in changed)
    assert all(r.kl == 0.0 and r.completion_length > 0 and math.isfinite(r.loss) for r in log)
    assert set(log[0].rewards) == {"vowels"}


def test_grpo_trains_a_qlora_adapter_and_leaves_the_base_quantized() -> None:
    with mlxchat.load_model(FIXTURES / "qwen3_q4") as model:
        lora(model, rank=4, seed=0)
        before = {k: np.array(v) for k, v in tree_flatten(model.module.parameters())}
        log = grpo(model, PROMPTS, [vowels], GRPOConfig(steps=2, group_size=4, prompts_per_step=2, max_tokens=8,
                                                        learning_rate=1e-3, beta=0.1))
        after = {k: np.array(v) for k, v in tree_flatten(model.module.parameters())}
        layers = [layer for _, layer in model.module.named_modules() if isinstance(layer, nn.QuantizedLinear)]
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(k.endswith((".lora_a", ".lora_b")) for k in changed)
    assert layers and all(math.isfinite(r.loss) and r.tokens > 0 for r in log) and log[1].kl > 0


def test_gradient_checkpointing_gives_the_same_update(chat) -> None:
    """One step with ``grad_checkpoint`` samples the same completions (same weights, same seeds) and makes the same
    update; the decoder layers are plain again afterwards."""
    config = GRPOConfig(steps=1, group_size=4, prompts_per_step=2, max_tokens=8, learning_rate=1e-3, beta=0.1)
    lora(chat, rank=4, seed=0)
    start = chat.worker.run(lambda: {k: mx.array(v) for k, v in tree_flatten(chat.module.trainable_parameters())})
    results = []
    for checkpointed in (False, True):
        chat.worker.run(lambda: chat.module.update(tree_unflatten(list(start.items()))))
        log = grpo(chat, PROMPTS, [vowels], config.model_copy(update={"grad_checkpoint": checkpointed}))
        results.append((log[0], trainable(chat)))
    (plain_record, plain), (checkpointed_record, checkpointed) = results
    assert checkpointed_record.reward == plain_record.reward and checkpointed_record.tokens == plain_record.tokens
    assert checkpointed_record.loss == pytest.approx(plain_record.loss, rel=1e-5, abs=1e-7)
    for name, value in plain.items():
        np.testing.assert_allclose(checkpointed[name], value, atol=1e-6)
    assert not any("Checkpointed" in type(layer).__name__ for _, layer in chat.module.named_modules())


def test_grpo_trains_the_whole_model_without_adapters(chat) -> None:
    before = trainable(chat)
    log = grpo(chat, PROMPTS, [vowels], GRPOConfig(steps=2, group_size=4, prompts_per_step=2, max_tokens=6,
                                                   learning_rate=1e-3, beta=0.1))
    after = trainable(chat)
    assert "model.embed_tokens.weight" in after
    assert sum(not np.array_equal(before[k], after[k]) for k in before) > len(before) // 2
    assert log[0].kl == pytest.approx(0.0, abs=1e-6) and log[1].kl > 0


def test_kl_to_the_reference_is_reported_and_bounded(chat) -> None:
    lora(chat, rank=8)
    log = grpo(chat, PROMPTS, [vowels], GRPOConfig(steps=4, group_size=4, prompts_per_step=2, max_tokens=8,
                                                   learning_rate=1e-3, beta=0.5))
    assert log[0].kl == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference
    assert all(r.kl >= 0 for r in log) and 0 < log[-1].kl < 1


def test_several_iterations_per_batch_move_the_ratio(chat) -> None:
    """From the second update on a batch the policy is not the sampling one: the loss then differs from the
    first update's (clipping and the ratio at work), and stays finite."""
    lora(chat, rank=8)
    one = grpo(chat, PROMPTS, [vowels], GRPOConfig(steps=2, group_size=4, prompts_per_step=2, max_tokens=8,
                                                   learning_rate=5e-3, beta=0.0, iterations=3))
    assert all(math.isfinite(r.loss) for r in one)


def test_a_diverging_batch_leaves_the_policy_as_before_it_whatever_its_iterations(chat) -> None:
    """With several updates a batch, one that diverges undoes the batch's earlier ones too (they were left
    applied, around 1e30, under an error saying the step was not applied)."""
    lora(chat, rank=8)
    before = trainable(chat)
    with pytest.raises(mlxchat.TrainingDivergedError, match="not applied"):
        grpo(chat, PROMPTS, [vowels], GRPOConfig(steps=2, group_size=4, prompts_per_step=2, max_tokens=8,
                                                 learning_rate=1e30, beta=0.0, iterations=3, grad_clip=None))
    after = trainable(chat)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_samples_differ_within_a_group(chat) -> None:
    """Each row has its own seed: a group is G different draws, not one repeated."""
    seen: list[str] = []

    def record(prompt, completion: str) -> float:
        seen.append(completion)
        return 0.0

    grpo(chat, PROMPTS[:1], [record], GRPOConfig(steps=1, group_size=4, prompts_per_step=1, max_tokens=8))
    assert len(seen) == 4 and len(set(seen)) > 1


@pytest.mark.parametrize(("reward", "message"), [
    (lambda p, c: 1 / 0, "raised on prompt"),
    (lambda p, c: float("nan"), "must be finite"),
    (lambda p, c: "1.0", "must return a number"),
])
def test_a_failing_reward_is_a_clear_error(chat, reward, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        grpo(chat, PROMPTS, [reward], GRPOConfig(steps=1, group_size=2, prompts_per_step=1, max_tokens=4))


def test_the_api_prints_nothing_unless_asked(chat, capsys) -> None:
    config = GRPOConfig(steps=1, group_size=2, prompts_per_step=1, max_tokens=4)
    grpo(chat, PROMPTS, [vowels], config)
    assert capsys.readouterr().out == ""
    grpo(chat, PROMPTS, [vowels], config, verbose=True)
    printed = capsys.readouterr().out
    assert "step 1/1" in printed and "tok/s" in printed


class Killed(Exception):
    pass


def test_a_run_killed_midway_resumes_where_it_would_have_been(tmp_path: Path) -> None:
    config = GRPOConfig(steps=4, group_size=2, prompts_per_step=2, max_tokens=6, learning_rate=2e-2, beta=0.1,
                        save_every=2)

    def run(folder: Path, kill_at: int | None = None):
        with mlxchat.load_model(FIXTURES / "qwen3_chat") as model:
            mx.random.seed(0)
            lora(model, rank=4)

            def on_step(record) -> None:
                if record.step == kill_at:
                    raise Killed

            log = grpo(model, PROMPTS, [vowels], config, checkpoint_dir=folder, on_step=on_step)
            return log, trainable(model)

    whole_log, whole = run(tmp_path / "whole")
    with pytest.raises(Killed):
        run(tmp_path / "killed", kill_at=3)
    resumed_log, resumed = run(tmp_path / "killed")
    assert [(r.step, r.reward, r.completion_length) for r in resumed_log] == [
        (r.step, r.reward, r.completion_length) for r in whole_log]
    for name, value in whole.items():
        np.testing.assert_allclose(resumed[name], value, atol=1e-5)


def test_reference_weights_that_are_not_the_trainable_ones_are_refused(chat, tmp_path: Path) -> None:
    """A run's reference weights are swapped into the model to score the reference policy: a file naming a base
    weight (it stayed in the model: the embedding zeroed for good) or of another shape is a CheckpointError."""
    lora(chat, rank=4)
    mine = dict(tree_flatten(chat.module.trainable_parameters()))
    folder = tmp_path / "step-0000001"
    folder.mkdir()
    first = sorted(mine)[0]
    for saved in ({**mine, "model.embed_tokens.weight": mx.zeros((4, 4))}, {**mine, first: mine[first][:1]}):
        mx.save_safetensors(str(folder / "reference.safetensors"), saved)
        with pytest.raises(mlxchat.CheckpointError, match="not the trainable weights"):
            grpo_module._load_reference(tmp_path, {"step": 1}, chat.module)
    mx.save_safetensors(str(folder / "reference.safetensors"), mine)
    assert set(dict(tree_flatten(grpo_module._load_reference(tmp_path, {"step": 1}, chat.module)))) == set(mine)


def test_exact_match() -> None:
    reward = rewards.exact_match(pattern=r"(-?\d+)\.?$")
    prompt = {"messages": [], "answer": 68}
    assert reward(prompt, "<think>\n23 + 45 = 67? no\n</think>\n\n23 + 45 = 68.") == 1.0
    assert reward(prompt, "<think>68</think> It is 67.") == 0.0
    assert reward(prompt, "no number") == 0.0
    assert rewards.exact_match()({"answer": "Paris"}, " Paris ") == 1.0
    with pytest.raises(KeyError, match="answer"):
        rewards.exact_match()([{"role": "user", "content": "x"}], "y")


def test_json_schema() -> None:
    reward = rewards.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert reward(None, '<think>ok</think>{"n": 3}') == 1.0
    assert reward(None, '{"n": "3"}') == 0.0
    assert reward(None, "{not json") == 0.0


def test_tool_call(chat) -> None:
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        return "sunny"

    reward = rewards.tool_call(chat, [get_weather])
    assert reward(None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == 1.0
    assert reward(None, '<tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}\n</tool_call>') == 0.0
    assert reward(None, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>') == 0.0
    assert reward(None, "It is sunny.") == 0.0


def write_grpo_run(folder: Path, steps: int, **grpo_options) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text("".join(
        json.dumps({"messages": p, "answer": "hi"}) + "\n" for p in PROMPTS))
    (folder / "my_rewards.py").write_text(
        "def vowels(prompt, completion):\n"
        "    return sum(c in 'aeiou' for c in completion) / max(len(completion), 1)\n")
    config = {"model": str(FIXTURES / "qwen3_chat"), "data": "prompts.jsonl", "output": "out", "lora": {"rank": 4},
              "grpo": {"steps": steps, "group_size": 2, "prompts_per_step": 2, "max_tokens": 4, **grpo_options},
              "rewards": [{"exact_match": {"key": "answer"}}, {"python": "my_rewards:vowels"}]}
    (folder / "run.yaml").write_text(json.dumps(config))
    return folder / "run.yaml"


def test_cli_grpo_run(tmp_path: Path, capsys) -> None:
    """``mlxchat train grpo``: prompts from JSONL, a built-in and a Python reward, a LoRA adapter out, a progress
    bar with the reward, KL, length and tokens/s."""
    from mlxchat.cli import main

    assert main(["train", "grpo", str(write_grpo_run(tmp_path, steps=2))]) == 0
    bar = capsys.readouterr().err
    assert all(part in bar for part in ("2/2", "reward", "kl", "len", "tok/s"))
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-0000002" / "state.json").read_text())
    assert [r["step"] for r in state["log"]] == [1, 2]
    assert set(state["log"][0]["rewards"]) == {"exact_match[answer]", "vowels"}
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_a_cli_run_killed_midway_resumes(tmp_path: Path) -> None:
    """SIGKILL ``mlxchat train grpo`` once its first checkpoint is written, then run the same command again: the
    adapter and the log equal an uninterrupted run's."""
    from mlxchat.cli import main

    steps = 12
    assert main(["train", "grpo", str(write_grpo_run(tmp_path / "whole", steps, save_every=2)), "--no-progress"]) == 0
    config = write_grpo_run(tmp_path / "killed", steps, save_every=2)
    saved = killed_after_its_first_checkpoint("grpo", config)
    assert saved != f"step-{steps:07d}", "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "out" / "adapter_model.safetensors").exists()
    assert main(["train", "grpo", str(config), "--no-progress"]) == 0

    def final(folder: Path) -> tuple[list, dict[str, np.ndarray]]:
        out = folder / "out"
        state = json.loads((out / "checkpoints" / f"step-{steps:07d}" / "state.json").read_text())
        tensors = {k: np.array(v) for k, v in mx.load(str(out / "adapter_model.safetensors")).items()}
        return [(r["step"], r["reward"], r["tokens"]) for r in state["log"]], tensors

    (whole_log, whole), (resumed_log, resumed) = final(tmp_path / "whole"), final(tmp_path / "killed")
    assert resumed_log == whole_log
    for name, value in whole.items():
        np.testing.assert_allclose(resumed[name], value, atol=1e-5)


@pytest.mark.parametrize("settings", [
    {"learning_rate": float("inf")}, {"steps": 10**20}, {"prompts_per_step": 10**7}, {"temperature": 1000.0},
    {"reward_weights": (float("nan"),)}, {"seed": -1},
])
def test_run_settings_out_of_range_are_refused_when_made(settings: dict) -> None:
    """Each once failed late and raw (a std::bad_cast at the schedule, 2e7 rows built, NaN totals) or hung."""
    with pytest.raises(ValidationError):
        GRPOConfig(**{"steps": 1, **settings})
    if set(settings) <= {"learning_rate", "steps", "seed"}:
        with pytest.raises(ValidationError):
            TrainConfig(**{"steps": 1, **settings})
