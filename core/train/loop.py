"""The training loop: masked next-token cross-entropy, AdamW with warmup and cosine decay, gradient
accumulation, clipping and periodic evaluation, on MLX autograd.

It trains any module a plugin builds (``module(tokens) -> logits``), fresh from
:func:`~mlxchat.train.from_scratch` or loaded (``load_model(...).module``), in place, on the calling thread;
do not generate from the same model while it trains. Runs are reproducible: the batch order comes from
``seed`` and nothing else is random.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Annotated, Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ContextLengthError, InvalidInputError, TrainingDivergedError
from ..limits import check_token_ids
from ..model import GenerativeModel
from .checkpoints import load_state, save_state
from .data import Batch, Example, bucketed_batches, make_batch

MAX_STEPS = 2**31 - 1
"""The most steps (and warmup steps) a run takes (MLX's schedules count them in 32 bits)."""


class TrainConfig(BaseModel):
    """Hyperparameters of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    steps: int = Field(ge=1, le=MAX_STEPS)
    """Optimizer updates (each of ``accumulation`` batches)."""
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0, le=MAX_STEPS)
    """Linear warmup from 0 to ``learning_rate``; then a cosine decay to ``min_lr_ratio * learning_rate``."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay on matrices (2-D and larger); none on norm scales and biases."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    grad_clip: float | None = Field(1.0, gt=0)
    """Global gradient-norm limit (``None``: no clipping)."""
    batch_tokens: int = Field(4096, ge=1)
    """Padded tokens per batch (examples of similar length are batched together)."""
    accumulation: int = Field(1, ge=1)
    """Batches whose gradients are summed into one update (the loss is averaged over all their targets)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate the held-out loss every this many steps (0: only at the end, when there is eval data)."""
    log_every: int = Field(10, ge=1)
    seed: int = Field(0, ge=0, lt=2**63)
    save_every: int = Field(0, ge=0)
    """With a ``checkpoint_dir``: save the resumable state every this many steps (0: only at the end)."""
    grad_checkpoint: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory for
    long examples, more compute (demo model, 4 x 1024 tokens: 0.55 GB peak instead of 0.91, 1.6x the time)."""


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

    @property
    def tokens_per_s(self) -> float:
        """Target tokens trained on per second of the run so far."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def masked_loss(module: nn.Module, batch: Batch) -> mx.array:
    """Summed cross-entropy over the batch's counted targets (the caller divides by the count)."""
    logits = module(batch.inputs).astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, batch.targets, reduction="none")
    return (losses * batch.mask).sum()


def evaluate(module: nn.Module, examples: Sequence[Example], batch_tokens: int = 4096) -> float:
    """Mean cross-entropy per target token over ``examples``."""
    check_examples(module, examples, "eval example")
    return _evaluate(module, examples, batch_tokens)


def _evaluate(module: nn.Module, examples: Sequence[Example], batch_tokens: int) -> float:
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
    checkpoint_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> list[LogRecord]:
    """Train ``model`` (a plugin's module, or a loaded model's) on ``examples`` for ``config.steps`` updates,
    cycling through the data in reshuffled epochs. Returns the log (also passed to ``on_log`` as it goes;
    printed when ``verbose``, otherwise nothing is printed).

    ``checkpoint_dir``: save the trainable weights, optimizer state and log there every ``config.save_every``
    steps and at the end, and resume from the newest checkpoint found there: a run killed midway and started
    again with the same arguments ends where the uninterrupted run would (the data order is replayed).
    """
    module = cast(nn.Module, model.module) if isinstance(model, GenerativeModel) else model
    context = model.context_length if isinstance(model, GenerativeModel) else None
    check_examples(module, examples, "example", context)
    check_examples(module, eval_examples, "eval example", context)
    if not examples or not any(any(e.mask[1:]) for e in examples):
        raise InvalidInputError("no training targets: every example's loss mask is empty")
    if eval_examples and not any(any(e.mask[1:]) for e in eval_examples):
        raise InvalidInputError("no eval targets: every eval example's loss mask is empty (its loss would read 0)")
    rng = np.random.default_rng(config.seed)
    optimizer = make_optimizer(config)
    grad_fn = nn.value_and_grad(module, masked_loss)
    epoch = bucketed_batches(examples, config.batch_tokens, rng)
    log: list[LogRecord] = []
    start, trained, window_loss, window_tokens = time.perf_counter(), 0, 0.0, 0

    def record(step: int, kind: str, loss: float) -> None:
        lr = optimizer.optimizers[0].learning_rate.item()
        entry = LogRecord(step, kind, loss, lr, trained, time.perf_counter() - start)
        if not math.isfinite(loss):  # a held-out loss (the steps' own are checked before their updates)
            raise TrainingDivergedError(f"the {kind} loss at step {step} is {loss}: lower the learning rate")
        log.append(entry)
        if on_log is not None:
            on_log(entry)
        if verbose:
            print(f"step {step}/{config.steps}  {kind} loss {loss:.4f}  lr {lr:.2e}  {entry.tokens_per_s:,.0f} tok/s",
                  flush=True)

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

    done = 0
    if checkpoint_dir is not None:
        resumed = load_state(checkpoint_dir, module, optimizer, config.steps, LogRecord)
        if resumed is not None:
            state, saved_log = resumed
            done, trained = state["step"], state.get("trained", 0)
            log.extend(saved_log)
            start -= log[-1].elapsed_s if log else 0.0
            for _ in range(done * config.accumulation):  # the batches already trained on, drawn again
                next_batch()
    restore = checkpoint_layers(module) if config.grad_checkpoint else None
    module.train()
    try:
        for step in range(done + 1, config.steps + 1):
            grads, loss_sum, count = None, mx.array(0.0), 0
            for _ in range(config.accumulation):
                batch = next_batch()
                loss, g = grad_fn(module, batch)
                grads = g if grads is None else tree_map(mx.add, grads, g)
                loss_sum, count = loss_sum + loss, count + batch.tokens
            grads = tree_map(lambda g, n=count: g / n, grads)
            check_finite(step, loss_sum, grads)  # before the update: a diverged step is never applied or saved
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
                record(step, "eval", _evaluate(module, eval_examples, config.batch_tokens))
                module.train()
            if checkpoint_dir is not None and (step == config.steps or (config.save_every and
                                                                        step % config.save_every == 0)):
                save_state(checkpoint_dir, module, optimizer, step,
                           {"trained": trained, "log": [dataclasses.asdict(e) for e in log]})
    finally:
        if restore is not None:
            restore()
        module.eval()
        if isinstance(model, GenerativeModel):
            model.weights_version += 1  # its prompt caches hold the old weights' keys and values
    return log


def check_examples(module: nn.Module, examples: Sequence[Example], what: str, context: int | None = None) -> None:
    """Every example two token ids or more, each an int inside the module's vocabulary (MLX reads an embedding
    row past the end unchecked), at most ``context`` of them, and a loss mask of booleans (0 and 1)."""
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    for index, example in enumerate(examples):
        if not isinstance(example, Example):
            raise InvalidInputError(f"{what} {index} is a {type(example).__name__}, not an Example")
        check_token_ids(example.ids, vocab if isinstance(vocab, int) else 2**31, f"{what} {index}'s token id")
        if len(example.ids) < 2:
            raise InvalidInputError(f"{what} {index} has {len(example.ids)} token ids: it needs two or more (an "
                                    "input and its target)")
        if context is not None and len(example.ids) > context:
            raise ContextLengthError(f"{what} {index} has {len(example.ids)} tokens, but the model's context holds "
                                     f"{context}: shorten or split it")
        if not all(isinstance(m, bool | Integral | np.bool_) and m in (0, 1) for m in example.mask):
            raise InvalidInputError(f"{what} {index}'s loss mask holds something other than true and false")


def check_finite(step: int, loss: mx.array, grads: Any) -> None:
    """A :class:`TrainingDivergedError` when a step's loss or gradients are not finite (NaN or infinite)."""
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(grads))
    squares = [mx.sum(mx.square(g.astype(mx.float32))) for _, g in leaves]
    norm = mx.sqrt(sum(squares, mx.array(0.0)))
    mx.eval(loss, norm)
    if not (math.isfinite(cast(float, loss.item())) and math.isfinite(cast(float, norm.item()))):
        raise TrainingDivergedError(f"training diverged at step {step} (loss {loss.item()}, gradient norm "
                                    f"{norm.item()}); the step was not applied: lower the learning rate")


def checkpoint_layers(module: nn.Module) -> Callable[[], None]:
    """Make every decoder layer (``...layers.N``) recompute its activations in the backward pass; returns what
    undoes it. Each layer gets a subclass of its own class whose call goes through ``mx.checkpoint``, so
    parameter names and every other instance stay as they are."""
    layers = [layer for name, layer in module.named_modules() if re.search(r"(^|\.)layers\.\d+$", name)]
    originals = [type(layer) for layer in layers]
    for layer, cls in zip(layers, originals, strict=True):
        layer.__class__ = _checkpointed(cls)

    def restore() -> None:
        for layer, cls in zip(layers, originals, strict=True):
            layer.__class__ = cls

    return restore


def _checkpointed(cls: type) -> type:
    call = cls.__call__

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        def inner(params: Any, *args: Any, **kwargs: Any) -> Any:
            self.update(params)
            return call(self, *args, **kwargs)

        return mx.checkpoint(inner)(self.trainable_parameters(), *args, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})
