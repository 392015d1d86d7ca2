"""How many prompt tokens a worker step may prefill beside running streams without slowing them more than a
set factor (Sarathi-Serve's stall-free batching, whose token budget comes from a latency target).

What a prompt token costs beside a decode step depends on the machine: on a GPU, hundreds of them ride along
with the weights' read almost for free; on a 2-core CPU one 512-token chunk costs seconds where a decode step
costs a tenth of one. So :class:`StepPace` learns it as the worker runs: each step's time, from the moment
its pass begins to be built to the moment its results are ready (when the next step waits for them, or when
queueing it returned on a backend that computes while queueing; an idle worker between steps is not
counted), is fitted by weighted least squares, the newest steps weighing most, to

    seconds = fixed + per_token * tokens + per_prompt_key * prompt_keys

where ``tokens`` are the pass's query tokens (decode rows and prompt spans) and ``prompt_keys`` the cached
positions its prompt tokens attend over (each over the ones before it): a prompt chunk is bound by the arithmetic
of every such pair (on Qwen3-0.6B shapes on a 2-core CPU a prompt token 4k tokens deep costs twice one at the
start). What the decode rows' own attention costs changes slowly, step by step as their caches grow, so the fixed
part takes it in (a coefficient of its own fitted to absurd values beside it: keys that grow with time fit
whatever else drifts). A step with streams running then takes the prompt tokens whose predicted cost is at most
``slowdown - 1`` times the predicted cost of the rows alone.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

PACE_QUANTUM = 8
"""Prompt tokens in the chunks a paced prefill is planned in (:meth:`StepPace.allowance` gives whole ones):
small enough to fit beside a decode step on a CPU (where a prompt token deep in a long context costs about a
tenth of a one-row decode step), and merged into one span a pass wherever more fit."""

DEFAULT_DECODE_SLOWDOWN = 2.0
"""A step that prefills beside running streams costs them at most this many times their own step by default
(issue 25's goal: the chats' inter-token latency while a long prompt goes in within 2x)."""

_KEPT = 64
_DECAY = 0.95
_FITTED_FROM = 8
_WAITED = 1e-3


class Load(NamedTuple):
    """What a step computes: its query tokens, and the keys its prompt tokens attend over (see the module
    docstring)."""
    tokens: int
    prompt_keys: int


class _Step(NamedTuple):
    load: Load
    started: float
    queued: float
    rows: set[int]


class StepPace:
    """The step-cost model of one model's worker (used on its thread only; see the module docstring).

    ``slowdown``: the most a step that prefills beside running streams may cost, as a multiple of the step of
    the streams alone."""

    def __init__(self, slowdown: float):
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not slowdown > 1 \
                or not math.isfinite(slowdown):
            raise ValueError(f"max_decode_slowdown must be a number above 1 (or None for off), got {slowdown!r}")
        self.slowdown = float(slowdown)
        self._steps: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=_KEPT)
        self._queued: collections.deque[_Step] = collections.deque(maxlen=_KEPT)
        self._done_at = 0.0
        self._fit: tuple[float, float, float] | None = None
        self._tried = False  # whether the steps seen so far were fitted (or found unfit)
        self.known: tuple[float, float, float] | None = None
        """The last costs fitted (:meth:`cost`), for any thread to read (the worker's own fit may be newer)."""

    def queued(self, load: Load, started: float, rows: Sequence[object]) -> None:
        """A step computing ``load``, decoding ``rows``, whose building began at ``started``
        (``time.perf_counter``), was just queued."""
        self._queued.append(_Step(load, started, time.perf_counter(), {id(row) for row in rows}))

    def done(self, waited_on: Sequence[object] | None) -> None:
        """The worker just waited for the tokens of the decode rows ``waited_on`` (``None``: for everything
        queued), right after queueing its last step. Steps run in the order queued, so the last earlier step
        that decoded one of them, and every step before it, are done: when the wait was real, now; when the
        tokens were ready at once, when queueing it returned (a backend that computes while queueing, as MLX's
        CPU one does). Its time, from when its building began (or the step before it ended) to then, is an
        observation when no other step was queued ahead of it."""
        now = time.perf_counter()
        ready = {id(row) for row in waited_on} if waited_on is not None else None
        candidates = len(self._queued) - (0 if ready is None else 1)
        last = next((i for i in range(candidates - 1, -1, -1) if ready is None or self._queued[i].rows & ready),
                    None)
        if last is None:
            return
        ended = now if ready is None or now - self._queued[-1].queued >= _WAITED else self._queued[last].queued
        began = max(self._queued[0].started, self._done_at)
        if last == 0 and ended > began:
            self.observe(self._queued[0].load, ended - began)
        for _ in range(last + 1):
            self._queued.popleft()
        self._done_at = ended

    def observe(self, load: Load, seconds: float) -> None:
        """Record a step computing ``load`` that took ``seconds``."""
        self._steps.append((float(load.tokens), float(load.prompt_keys), seconds))
        self._fit, self._tried = None, False

    def cost(self) -> tuple[float, float, float] | None:
        """The fitted ``(fixed, per_token, per_prompt_key)`` seconds (a per-key cost that fits as negative is left
        out). Where the recent steps cannot tell a prompt token's cost apart (none computed prompt tokens: streams
        decoding alone a while, however many; a per-token cost fitted to them would be a decode row's, and ignore
        how deep a prompt token attends), the last fit that could; ``None`` until one could."""
        if not self._tried and len(self._steps) >= _FITTED_FROM:
            self._tried = True
            steps = np.array(self._steps)
            if not steps[:, 1].any():
                return self.known
            weights = np.sqrt(_DECAY ** np.arange(len(steps) - 1, -1, -1))
            features = np.column_stack([np.ones(len(steps)), steps[:, 0], steps[:, 1]]) * weights[:, None]
            seconds = steps[:, 2] * weights
            for used in (3, 2):
                if np.linalg.matrix_rank(features[:, :used]) < used:
                    continue
                fit = np.linalg.lstsq(features[:, :used], seconds, rcond=None)[0]
                if fit[1] > 0 and (used == 2 or fit[2] >= 0):
                    self._fit = (max(float(fit[0]), 0.0), float(fit[1]), float(fit[2]) if used == 3 else 0.0)
                    self.known = self._fit
                    break
        return self._fit if self._fit is not None else self.known

    def allowance(self, rows: int, depth: int, budget: int) -> int:
        """Prompt tokens (whole :data:`PACE_QUANTUM` chunks, at least one, at most ``budget``) a step of ``rows``
        decode rows may add for a prompt whose next token is at position ``depth``; one chunk until the cost is
        known (a step of a chunk beside the rows is one the rows alone are not: a few of them tell a prompt
        token's cost apart, where the whole budget would stall the streams for seconds on a CPU)."""
        fit = self.cost()
        if fit is None:
            return min(budget, PACE_QUANTUM)
        fixed, per_token, per_key = fit
        spare = (self.slowdown - 1) * (fixed + per_token * rows)
        # k prompt tokens cost per_token * k + per_key * k * (depth + (k + 1) / 2): the largest k within spare (the
        # quadratic's root in the form that keeps its precision however small per_key, 0 included).
        linear = per_token + per_key * (depth + 0.5)
        tokens = 2 * spare / (linear + math.sqrt(linear * linear + 2 * per_key * spare))
        return min(budget, max(PACE_QUANTUM, int(tokens) // PACE_QUANTUM * PACE_QUANTUM))
