"""GRPO (Shao et al. 2024, DeepSeekMath): reinforcement learning from reward functions, with no value model.

Each step takes a few prompts, samples a group of ``group_size`` completions for each with the model's own
batched decoding (one temperature and seed per row), scores them with the reward functions, and turns the
rewards into advantages normalised within each group: ``(r - mean) / std`` (``scale_rewards=False``: only
``r - mean``, as Dr. GRPO). The update maximises the clipped objective
``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * KL`` per completion token, where ``ratio`` is the
policy's probability of the token over the sampling policy's and ``KL`` the k3 estimate
``exp(ref - logp) - (ref - logp) - 1`` to the frozen reference (the model as the run began; ``beta=0``: none).

It trains whatever is trainable: after :func:`mlxchat.train.lora` only the adapters, otherwise the whole model.
Sampling and updates run on the model's worker, one after the other.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from pydantic import BaseModel, ConfigDict, Field

from ..errors import CheckpointError, InvalidInputError, RewardError, TrainingDivergedError
from ..limits import check_depth, check_strings
from ..model import GenerativeModel
from .checkpoints import arrays_fit, load_state, save_state
from .loop import MAX_STEPS, TrainConfig, check_finite, checkpoint_layers, make_optimizer
from .rewards import Reward


class GRPOConfig(BaseModel):
    """Hyperparameters of a GRPO run."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    steps: int = Field(ge=1, le=MAX_STEPS)
    group_size: int = Field(4, ge=2, le=1024)
    """Completions sampled per prompt (the group its advantages are normalised in)."""
    prompts_per_step: int = Field(4, ge=1, le=1024)
    max_tokens: int = Field(256, ge=1, le=2**20)
    learning_rate: float = Field(1e-5, gt=0)
    temperature: float = Field(1.0, gt=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    beta: float = Field(0.04, ge=0)
    """Weight of the KL penalty to the reference (0: no reference is kept or run)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    iterations: int = Field(1, ge=1)
    """Updates per sampled batch (GRPO's mu); the ratio moves away from 1 only from the second on."""
    scale_rewards: bool = True
    """Divide advantages by their group's standard deviation (False: Dr. GRPO's unscaled advantages)."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function (default: all 1)."""
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    save_every: int = Field(0, ge=0)
    """With a ``checkpoint_dir``: save the resumable state every this many steps (0: only at the end)."""
    seed: int = Field(0, ge=0, lt=2**63)
    enable_thinking: bool | None = None
    grad_checkpoint: bool = False
    """Recompute each decoder layer's activations in the backward pass (as :class:`TrainConfig`'s): less memory
    for long completions and large groups, more compute in the update."""


@dataclass
class GRPORecord:
    """One step of a run."""

    step: int
    reward: float
    """Mean total (weighted) reward of the step's completions."""
    reward_std: float
    rewards: dict[str, float]
    """Mean of each reward function, by its name."""
    kl: float
    """Mean per-token KL estimate to the reference (0 when ``beta`` is 0)."""
    completion_length: float
    """Mean completion length in tokens."""
    loss: float
    learning_rate: float
    elapsed_s: float
    tokens: int = 0
    """Completion tokens sampled (and trained on) so far, this step's included."""

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens sampled and trained on per second of the run so far."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class _Rollout:
    inputs: mx.array
    targets: mx.array
    mask: mx.array
    """1 on completion tokens (the ones trained), 0 on the prompt and padding."""
    advantages: mx.array


def grpo(
    model: GenerativeModel,
    prompts: Sequence[Any],
    rewards: Sequence[Reward],
    config: GRPOConfig,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[GRPORecord], None] | None = None,
    verbose: bool = False,
) -> list[GRPORecord]:
    """Train ``model`` with GRPO on ``prompts`` (conversations: lists of messages, or dicts with ``"messages"``
    and fields the rewards read) scored by ``rewards`` (``reward(prompt, completion) -> float``; see
    :mod:`mlxchat.train.rewards`). Returns one record per step (also passed to ``on_step``; printed when
    ``verbose``). ``checkpoint_dir``: save there every ``config.save_every`` steps and at the end, and resume
    from the newest checkpoint found there (the same prompts and seeds follow, so the run ends as one that was
    never stopped would).
    """
    if not isinstance(model, GenerativeModel):
        raise TypeError("grpo needs a loaded model (mlxchat.load_model): it samples with the model's decoding")
    if not prompts:
        raise InvalidInputError("grpo needs at least one prompt")
    if not rewards or not all(callable(r) for r in rewards):
        raise InvalidInputError("grpo needs one or more reward functions: reward(prompt, completion) -> float")
    weights = config.reward_weights or (1.0,) * len(rewards)
    if len(weights) != len(rewards):
        raise InvalidInputError(f"{len(weights)} reward weights for {len(rewards)} reward functions")
    encoded = [_prompt_ids(model, p, config) for p in prompts]
    module = cast(nn.Module, model.module)
    stop = _stop_token(model)
    optimizer = make_optimizer(TrainConfig(steps=config.steps, learning_rate=config.learning_rate,
                                           warmup_steps=config.warmup_steps, weight_decay=config.weight_decay,
                                           min_lr_ratio=1.0, betas=(0.9, 0.99)))
    rng = np.random.default_rng(config.seed)
    order: list[int] = []
    log: list[GRPORecord] = []
    done, sampled, start = 0, 0, time.perf_counter()
    reference = None if config.beta == 0 else model.worker.run(lambda: tree_map(lambda a: a,
                                                                              module.trainable_parameters()))
    if checkpoint_dir is not None:
        before = module.trainable_parameters()
        resumed = model.worker.run(lambda: load_state(checkpoint_dir, module, optimizer, config.steps, GRPORecord))
        if resumed is not None:
            state, saved_log = resumed
            done = state["step"]
            log.extend(saved_log)
            start -= log[-1].elapsed_s if log else 0.0
            sampled = log[-1].tokens if log else 0
            if reference is not None:
                try:
                    reference = model.worker.run(lambda: _load_reference(checkpoint_dir, state, module))
                except CheckpointError:
                    model.worker.run(module.update, before)  # a refused resume leaves the policy as it was
                    raise
            for _ in range(done):  # the prompts already used, drawn again
                _take(order, rng, len(prompts), config.prompts_per_step)

    def loss_fn(policy: nn.Module, rollout: _Rollout, old: mx.array, ref: mx.array | None) -> tuple[mx.array, mx.array]:
        logp = _token_logprobs(policy, rollout.inputs, rollout.targets)
        return clipped_objective(logp, old, ref, rollout.advantages, rollout.mask, config.clip_eps, config.beta)

    grad_fn = nn.value_and_grad(module, loss_fn)

    def update(step: int, rollout: _Rollout) -> tuple[float, float]:
        restore = checkpoint_layers(module) if config.grad_checkpoint else None
        module.train()
        try:
            old = mx.stop_gradient(_token_logprobs(module, rollout.inputs, rollout.targets))
            ref = None
            if reference is not None:
                current = module.trainable_parameters()
                module.update(reference)
                try:
                    ref = mx.stop_gradient(_token_logprobs(module, rollout.inputs, rollout.targets))
                    mx.eval(ref)
                finally:  # the policy's weights back, whatever happened with the reference's
                    module.update(current)
            mx.eval(old, ref)
            loss = kl = mx.array(0.0)
            kept = module.trainable_parameters(), tree_map(lambda a: a, optimizer.state)
            for _ in range(config.iterations):
                (loss, kl), grads = grad_fn(module, rollout, old, ref)
                try:
                    check_finite(step, loss, grads)  # before the update: a diverged step is never applied
                except TrainingDivergedError:  # nor its earlier iterations'
                    module.update(kept[0])
                    optimizer.state = kept[1]
                    raise
                if config.grad_clip is not None:
                    grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
                optimizer.update(module, grads)
                mx.eval(module.parameters(), optimizer.state, loss, kl)
            return cast(float, loss.item()), cast(float, kl.item())
        finally:
            if restore is not None:
                restore()
            module.eval()

    model.weights_version += 1  # prompt caches filled before the run hold the old weights' keys and values
    for step in range(done + 1, config.steps + 1):
        chosen = _take(order, rng, len(prompts), config.prompts_per_step)
        rows = [(i, g) for i in chosen for g in range(config.group_size)]
        configs = [{"max_tokens": config.max_tokens, "temperature": config.temperature, "top_p": config.top_p,
                    "seed": _row_seed(config.seed, step, n)} for n in range(len(rows))]
        results = model.generate_batch([encoded[i] for i, _ in rows], configs)
        completions = [list(r.tokens) + ([stop] if r.finish_reason == "stop" and stop is not None else [])
                       for r in results]
        scores = np.array([[_score(fn, prompts[i], r.text, i) for fn in rewards] for (i, _), r in zip(rows, results,
                                                                                                        strict=True)])
        totals = scores @ np.array(weights)
        advantages = _advantages(totals.reshape(len(chosen), config.group_size), config.scale_rewards).reshape(-1)
        rollout = model.worker.run(_batch, [encoded[i] for i, _ in rows], completions, advantages)
        loss, kl = model.worker.run(update, step, rollout)
        sampled += sum(len(c) for c in completions)
        record = GRPORecord(
            step=step, reward=float(totals.mean()), reward_std=float(totals.std()),
            rewards={_name(fn, k): float(scores[:, k].mean()) for k, fn in enumerate(rewards)}, kl=kl,
            completion_length=float(np.mean([len(c) for c in completions])), loss=loss,
            learning_rate=float(optimizer.optimizers[0].learning_rate.item()), elapsed_s=time.perf_counter() - start,
            tokens=sampled)
        log.append(record)
        if on_step is not None:
            on_step(record)
        if verbose:
            print(f"step {step}/{config.steps}  reward {record.reward:.3f}  kl {record.kl:.4f}  "
                  f"length {record.completion_length:.1f}  loss {record.loss:.4f}  {record.tokens_per_s:,.0f} tok/s",
                  flush=True)
        if checkpoint_dir is not None and (step == config.steps or (config.save_every and
                                                                    step % config.save_every == 0)):
            extra = {"log": [dataclasses.asdict(r) for r in log]}
            model.worker.run(lambda s=step, e=extra: _save(checkpoint_dir, module, optimizer, s, e, reference))
    return log


def clipped_objective(logp: mx.array, old: mx.array, ref: mx.array | None, advantages: mx.array, mask: mx.array,
                      clip_eps: float, beta: float) -> tuple[mx.array, mx.array]:
    """GRPO's loss (the negated objective, averaged over the masked tokens) and the mean KL estimate, from
    per-token log-probabilities ``[rows, tokens]`` of the policy, the sampling policy and the reference."""
    ratio = mx.exp(logp - old)
    scaled = advantages[:, None]
    objective = mx.minimum(ratio * scaled, mx.clip(ratio, 1 - clip_eps, 1 + clip_eps) * scaled)
    kl = mx.zeros_like(logp)
    if ref is not None:
        delta = ref - logp
        kl = mx.exp(delta) - delta - 1
        objective = objective - beta * kl
    count = mx.maximum(mask.sum(), 1)
    return -(objective * mask).sum() / count, (kl * mask).sum() / count


def _prompt_ids(model: GenerativeModel, prompt: Any, config: GRPOConfig) -> list[int]:
    messages = prompt.get("messages") if isinstance(prompt, Mapping) else prompt
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidInputError("each GRPO prompt is a conversation (a list of messages) or a dict with "
                                f"'messages', got {type(prompt).__name__}")
    check_strings(check_depth(list(messages), what="a GRPO prompt"), "a GRPO prompt")
    kwargs: dict[str, Any] = {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}
    return model.render_prompt(list(messages), **kwargs)[1]


def _stop_token(model: GenerativeModel) -> int | None:
    """The end-of-turn token the template closes an assistant reply with (decoding stops on it and leaves it
    out of the reply's tokens; the policy is trained on it, so it learns when to stop)."""
    try:
        ids = model.render_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                  add_generation_prompt=False)[1]
    except Exception:  # a template that needs more than this to render: train without the stop token
        return None
    return next((t for t in reversed(ids) if t in model.eos_ids), None)


def _take(order: list[int], rng: np.random.Generator, count: int, wanted: int) -> list[int]:
    """The next ``wanted`` prompt indices of a reshuffled-every-epoch order."""
    chosen: list[int] = []
    while len(chosen) < wanted:
        if not order:
            order.extend(rng.permutation(count).tolist())
        chosen.append(order.pop(0))
    return chosen


def _row_seed(seed: int, step: int, row: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + row) % 2**63


def _score(fn: Reward, prompt: Any, completion: str, index: int) -> float:
    try:
        value = fn(prompt, completion)
    except Exception as exc:
        raise RewardError(f"reward {_name(fn, 0)} raised on prompt {index}: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise RewardError(f"reward {_name(fn, 0)} returned {value!r} on prompt {index}; it must return a number")
    if not math.isfinite(float(value)):
        raise RewardError(f"reward {_name(fn, 0)} returned {value!r} on prompt {index}; it must be finite")
    return float(value)


def _name(fn: Reward, index: int) -> str:
    return getattr(fn, "__name__", None) or f"reward_{index}"


def _advantages(totals: np.ndarray, scale: bool) -> np.ndarray:
    centred = totals - totals.mean(axis=1, keepdims=True)
    if not scale:
        return centred
    return centred / (totals.std(axis=1, keepdims=True) + 1e-4)


def _batch(prompts: Sequence[list[int]], completions: Sequence[list[int]], advantages: np.ndarray) -> _Rollout:
    """Prompt + completion sequences, right-padded (a causal model's outputs before the padding do not see
    it), with a mask over the completion targets."""
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences)
    inputs = np.zeros((len(sequences), width - 1), np.int32)
    targets = np.zeros_like(inputs)
    mask = np.zeros(inputs.shape, np.float32)
    for row, (sequence, prompt) in enumerate(zip(sequences, prompts, strict=True)):
        n = len(sequence) - 1
        inputs[row, :n], targets[row, :n] = sequence[:-1], sequence[1:]
        mask[row, len(prompt) - 1:n] = 1.0
    return _Rollout(mx.array(inputs), mx.array(targets), mx.array(mask), mx.array(advantages.astype(np.float32)))


def _token_logprobs(module: nn.Module, inputs: mx.array, targets: mx.array) -> mx.array:
    logits = module(inputs).astype(mx.float32)
    return -nn.losses.cross_entropy(logits, targets, reduction="none")


def _save(folder: str | os.PathLike[str], module: nn.Module, optimizer: optim.Optimizer, step: int,
          extra: dict[str, Any], reference: Any) -> None:
    files = None if reference is None else {"reference.safetensors": dict(tree_flatten(reference))}
    save_state(folder, module, optimizer, step, extra, files)


def _load_reference(folder: str | os.PathLike[str], state: dict[str, Any], module: nn.Module) -> Any:
    """The run's reference weights, each a trainable weight of ``module`` by name, shape and dtype (they are
    swapped into it to score the reference policy: anything else would change the model itself)."""
    path = Path(folder) / f"step-{state['step']:07d}" / "reference.safetensors"
    try:
        saved = cast(dict[str, mx.array], mx.load(str(path)))
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the run's reference weights: {exc}") from exc
    if not arrays_fit(saved, dict(tree_flatten(module.trainable_parameters()))):
        raise CheckpointError(f"{path}: the reference weights are not the trainable weights of this model and "
                              "adapter (damaged, or from another run)")
    return tree_unflatten(list(saved.items()))
