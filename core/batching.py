"""Decoding several sequences together: one forward pass over all of them a step, so that the weights are
read once for every sequence (decode is bound by reading them), while each sequence keeps its own cache,
length, position, sampler and penalties.

A generation decodes through :func:`decode_steps`, which yields its :class:`DecodeRow` before each step;
the model's worker gathers the rows of every generation waiting at that moment and runs them in one pass
(:meth:`DecodeRow.run_together`; see :mod:`mlxchat.worker`), so sequences join and leave between steps
(continuous batching). A row alone runs exactly the single-sequence step. The products of several rows
are summed in another order than one row's, so a batched row's logits are within about 1e-5 (float32) of
its own; :func:`mlxchat.testing.batched_decoding_problems` checks every architecture for equal greedy
tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .architecture import ModelModule
from .cache import RowCaches
from .prompt_cache import PromptCache
from .worker import Together

if TYPE_CHECKING:
    from .sampling import LogitsAdjuster, Sampler


def batched_last_logits(module: ModelModule, tokens: Sequence[int] | mx.array,
                        caches: Sequence[PromptCache]) -> mx.array:
    """Logits ``[B, vocab]`` of one decode step of ``B`` sequences at once: row ``i`` feeds ``tokens[i]`` through
    ``caches[i]`` (each with its own length and position). The weights are read once for all rows; the
    attention and recurrent state of each row stay its own (:class:`~mlxchat.cache.RowCaches`)."""
    layers = [RowCaches([cache.layers[i] for cache in caches]) for i in range(len(caches[0].layers))]
    column = tokens[:, None] if isinstance(tokens, mx.array) else mx.array(list(tokens))[:, None]
    return last_logits_of(module)(column, layers)


def last_logits_of(module: ModelModule) -> Any:
    """The module's logits at the last position: its own ``last_logits`` when it has one (skipping the
    head's work for the other positions)."""
    return getattr(module, "last_logits", None) or (lambda t, c: module(t, c)[:, -1, :])


class DecodeStats:
    """Timings of one generation, filled in while it runs (its report is made from them)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.cached = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0


class DecodeRow(Together):
    """One sequence between decode steps: its cache, how it picks tokens, and its last token (``current``,
    not yet read) whose forward pass the next step runs."""

    def __init__(self, module: ModelModule, cache: PromptCache, sampler: Sampler, adjust: LogitsAdjuster | None):
        self.module, self.cache, self.sampler, self.adjust = module, cache, sampler, adjust
        self.current = mx.array([0])
        self.value = 0

    def pick(self, logits: mx.array) -> mx.array:
        """The next token of this row (lazy) from its logits ``[1, vocab]``."""
        if self.adjust is not None and self.adjust.active:
            logits = self.adjust(logits)
        token = self.sampler(logits)
        if self.adjust is not None:
            self.adjust.record(token)
        return token

    @classmethod
    def run_together(cls, rows: list[Any]) -> None:
        """One step of every row: the forward pass of each row's ``current`` token, the next token picked
        (evaluated asynchronously), then ``current`` read into ``value`` and recorded in the row's cache
        (its forward pass is queued already, so the device never waits on Python)."""
        module = rows[0].module
        if len(rows) == 1:
            logits = last_logits_of(module)(rows[0].current[None], rows[0].cache.layers)
        else:
            tokens = mx.concatenate([row.current for row in rows])
            logits = batched_last_logits(module, tokens, [row.cache for row in rows])
        following = [row.pick(logits[i : i + 1]) for i, row in enumerate(rows)]
        mx.async_eval(following)
        for row, token in zip(rows, following, strict=True):
            row.value = int(row.current.item())  # type: ignore[arg-type]  # a token id array holds ints
            row.cache.feed([row.value])
            row.current = token


def decode_steps(module: ModelModule, cache: PromptCache, pending: Sequence[int], sampler: Sampler,
                 max_tokens: int, *, adjust: LogitsAdjuster | None = None,
                 stats: DecodeStats | None = None) -> Iterator[int | DecodeRow]:
    """Up to ``max_tokens`` sampled ids, each announced by this sequence's :class:`DecodeRow` (the worker
    runs the step, alone or with others' rows, before resuming). The first step runs ``pending`` (the
    prompt's tail :meth:`PromptCache.prefill` left) alone."""
    stats = stats or DecodeStats()
    if not pending:
        raise ValueError("decoding needs at least one prompt token to start from")
    row = DecodeRow(module, cache, sampler, adjust)
    row.current = row.pick(last_logits_of(module)(mx.array(list(pending))[None], cache.layers))
    cache.feed(pending)
    mx.async_eval(row.current)
    for n in range(1, max_tokens + 1):
        if n < max_tokens:
            yield row  # the step that feeds token n runs now; ``value`` is token n
            row.check()
            value = row.value
        else:
            value = int(row.current.item())  # type: ignore[arg-type]  # the last token needs no step
        now = time.perf_counter()
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.last_token_at, stats.tokens = now, n
        yield value
