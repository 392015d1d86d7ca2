"""The training loop: masked next-token cross-entropy, AdamW with warmup and cosine decay, gradient
accumulation, clipping and periodic evaluation, on MLX autograd.

It trains any module a plugin builds (``module(tokens) -> logits``), fresh from
:func:`~mlxchat.train.from_scratch` or loaded (``load_model(...).module``), in place, on the calling thread;
do not generate from the same model while it trains. Runs are reproducible: the batch order comes from
``seed`` and nothing else is random.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map
from pydantic import BaseModel, ConfigDict, Field

from ..model import GenerativeModel
from .data import Batch, Example, bucketed_batches, make_batch


class TrainConfig(BaseModel):
    """Hyperparameters of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(ge=1)
    """Optimizer updates (each of ``accumulation`` batches)."""
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    """Linear warmup from 0 to ``learning_rate``; then a cosine decay to ``min_lr_ratio * learning_rate``."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay on matrices (2-D and larger); none on norm scales and biases."""
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = Field(1.0, gt=0)
    """Global gradient-norm limit (``None``: no clipping)."""
    batch_tokens: int = Field(4096, ge=1)
    """Padded tokens per batch (examples of similar length are batched together)."""
    accumulation: int = Field(1, ge=1)
    """Batches whose gradients are summed into one update (the loss is averaged over all their targets)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate the held-out loss every this many steps (0: only at the end, when there is eval data)."""
    log_every: int = Field(10, ge=1)
    seed: int = 0


@dataclass
class LogRecord:
    """What the loop reports every ``log_every`` steps (train) and at each evaluation (eval)."""

    step: int
    kind: str
    """``"train"`` or ``"eval"``."""
    loss: float
    learning_rate: float
    tokens: int
    """Target tokens trained on so far."""
    elapsed_s: float


def masked_loss(module: nn.Module, batch: Batch) -> mx.array:
    """Summed cross-entropy over the batch's counted targets (the caller divides by the count)."""
    logits = module(batch.inputs).astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, batch.targets, reduction="none")
    return (losses * batch.mask).sum()


def evaluate(module: nn.Module, examples: Sequence[Example], batch_tokens: int = 4096) -> float:
    """Mean cross-entropy per target token over ``examples``."""
    total, count = 0.0, 0
    rng = np.random.default_rng(0)
    for group in bucketed_batches(examples, batch_tokens, rng):
        batch = make_batch(group)
        if batch.tokens:
            total += cast(float, masked_loss(module, batch).item())
            count += batch.tokens
    return total / max(count, 1)


def schedule(config: TrainConfig) -> Callable[[mx.array], mx.array]:
    peak, floor = config.learning_rate, config.learning_rate * config.min_lr_ratio
    decay = optim.cosine_decay(peak, max(config.steps - config.warmup_steps, 1), floor)
    if config.warmup_steps == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, peak, config.warmup_steps), decay],
                                [config.warmup_steps])


def make_optimizer(config: TrainConfig) -> optim.MultiOptimizer:
    lr = schedule(config)
    decayed = optim.AdamW(lr, betas=list(config.betas), weight_decay=config.weight_decay)
    plain = optim.AdamW(lr, betas=list(config.betas), weight_decay=0.0)
    return optim.MultiOptimizer([decayed, plain], [lambda _path, weight: weight.ndim >= 2])


def train(
    model: nn.Module | GenerativeModel,
    examples: Sequence[Example],
    config: TrainConfig,
    *,
    eval_examples: Sequence[Example] = (),
    on_log: Callable[[LogRecord], None] | None = None,
) -> list[LogRecord]:
    """Train ``model`` (a plugin's module, or a loaded model's) on ``examples`` for ``config.steps`` updates,
    cycling through the data in reshuffled epochs. Returns the log (also passed to ``on_log`` as it goes).
    """
    module = cast(nn.Module, model.module) if isinstance(model, GenerativeModel) else model
    if not examples or not any(any(e.mask[1:]) for e in examples):
        raise ValueError("no training targets: every example's loss mask is empty")
    rng = np.random.default_rng(config.seed)
    optimizer = make_optimizer(config)
    grad_fn = nn.value_and_grad(module, masked_loss)
    epoch = bucketed_batches(examples, config.batch_tokens, rng)
    log: list[LogRecord] = []
    start, trained, window_loss, window_tokens = time.perf_counter(), 0, 0.0, 0

    def record(step: int, kind: str, loss: float) -> None:
        lr = optimizer.optimizers[0].learning_rate.item()
        entry = LogRecord(step, kind, loss, lr, trained, time.perf_counter() - start)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (loss {loss}); lower the lr")
        log.append(entry)
        if on_log is not None:
            on_log(entry)

    def next_batch() -> Batch:
        nonlocal epoch
        while True:
            group = next(epoch, None)
            if group is None:
                epoch = bucketed_batches(examples, config.batch_tokens, rng)
                continue
            batch = make_batch(group)
            if batch.tokens:
                return batch

    module.train()
    for step in range(1, config.steps + 1):
        grads, loss_sum, count = None, mx.array(0.0), 0
        for _ in range(config.accumulation):
            batch = next_batch()
            loss, g = grad_fn(module, batch)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            loss_sum, count = loss_sum + loss, count + batch.tokens
        grads = tree_map(lambda g, n=count: g / n, grads)
        if config.grad_clip is not None:
            grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(module, grads)
        mx.eval(module.parameters(), optimizer.state, loss_sum)
        trained += count
        window_loss, window_tokens = window_loss + cast(float, loss_sum.item()), window_tokens + count
        if step % config.log_every == 0 or step == config.steps:
            record(step, "train", window_loss / window_tokens)
            window_loss, window_tokens = 0.0, 0
        if eval_examples and (step == config.steps or (config.eval_every and step % config.eval_every == 0)):
            module.eval()
            record(step, "eval", evaluate(module, eval_examples, config.batch_tokens))
            module.train()
    module.eval()
    return log
