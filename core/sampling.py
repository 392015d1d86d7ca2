"""Turning logits into the next token: penalties and biases, then greedy or filtered sampling."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .limits import check_token_ids

Sampler = Callable[[mx.array], mx.array]


@dataclass
class LogitsAdjuster:
    """Penalties and biases: HF's repetition penalty over prompt and reply, OpenAI's presence and frequency
    penalties over the reply, and a fixed bias per token id."""

    vocab_size: int
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._bias: mx.array | None = None
        if self.logit_bias:
            # The ids index a scatter, which MLX does not bounds-check.
            ids = mx.array(check_token_ids(self.logit_bias.keys(), self.vocab_size, "logit_bias token id"))
            values = mx.array(list(self.logit_bias.values()), dtype=mx.float32)
            self._bias = mx.zeros((self.vocab_size,), dtype=mx.float32).at[ids].add(values)
        self._seen = mx.zeros((self.vocab_size,), dtype=mx.bool_)
        self._counts = mx.zeros((self.vocab_size,), dtype=mx.float32)

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self._bias is not None
        )

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """What the tokens recorded so far left (to return to after a speculative round)."""
        return self._seen, self._counts

    @state.setter
    def state(self, value: tuple[mx.array, mx.array]) -> None:
        self._seen, self._counts = value

    def start(self, prompt: Sequence[int]) -> None:
        if self.repetition_penalty != 1.0 and prompt:
            self._seen = self._seen.at[mx.array(list(prompt))].add(True)

    def record(self, token: mx.array) -> None:
        """Count a sampled (possibly not yet evaluated) token."""
        if self.repetition_penalty != 1.0:
            self._seen = self._seen.at[token].add(True)
        if self.presence_penalty or self.frequency_penalty:
            self._counts = self._counts.at[token].add(1.0)

    def __call__(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.repetition_penalty != 1.0:
            penalised = mx.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = mx.where(self._seen, penalised, logits)
        if self.presence_penalty:
            logits = logits - self.presence_penalty * (self._counts > 0)
        if self.frequency_penalty:
            logits = logits - self.frequency_penalty * self._counts
        if self._bias is not None:
            logits = logits + self._bias
        return logits


def make_filter(temperature: float, top_p: float = 1.0, top_k: int = 0,
                min_p: float = 0.0) -> Callable[[mx.array], mx.array]:
    """A function from logits ``[..., vocab]`` to the logits sampling draws from (temperature > 0): scaled
    by the temperature, with the tokens top-k, min-p and top-p rule out at ``-inf``. Row by row, so a
    speculative round filters all its positions at once."""

    def filtered(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32) / temperature
        if top_k and top_k < logits.shape[-1]:
            kth = mx.sort(logits, axis=-1)[..., -top_k][..., None]
            logits = mx.where(logits < kth, -mx.inf, logits)
        if min_p > 0:
            probs = mx.softmax(logits, axis=-1)
            floor = min_p * probs.max(axis=-1, keepdims=True)
            logits = mx.where(probs < floor, -mx.inf, logits)
        if top_p < 1.0:
            order = mx.argsort(-logits, axis=-1)
            sorted_probs = mx.take_along_axis(mx.softmax(logits, axis=-1), order, axis=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) >= top_p
            drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
            logits = mx.where(drop, -mx.inf, logits)
        return logits

    return filtered


class RandomKeys:
    """Keys for MLX's random draws: split from ``seed`` one after another (reproducible), or MLX's global
    generator's when there is no seed."""

    def __init__(self, seed: int | None):
        self._key = mx.random.key(seed) if seed is not None else None

    def next(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key


def make_sampler(
    temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None
) -> Sampler:
    """A function from logits ``[1, vocab]`` to a token id ``[1]``. Temperature 0 is greedy."""
    if temperature <= 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    filtered, keys = make_filter(temperature, top_p, top_k, min_p), RandomKeys(seed)
    return lambda logits: mx.random.categorical(filtered(logits), key=keys.next())
