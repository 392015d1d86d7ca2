"""A step that prefills beside running streams is kept within a slowdown of their own step: the step-cost fit
(:class:`~mlxchat.pacing.StepPace`) on known costs, which steps' times it trusts, the prompt tokens it allows,
and a long prompt that goes in the chunks it allows beside a decoding stream, each stream as alone."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from test_batching import Inline, logged_steps  # noqa: F401 - the fixture

import mlxchat
from mlxchat import pacing
from mlxchat.pacing import PACE_QUANTUM, Load, StepPace
from mlxchat.testing import GREEDY

from conftest import fixture_path


def test_the_fit_recovers_a_steps_fixed_per_token_and_per_prompt_key_costs() -> None:
    pace = StepPace(2.0)
    for tokens, prompt_keys in itertools.product((1, 8, 40, 300), (0, 800, 40_000, 90_000)):
        pace.observe(Load(tokens, prompt_keys), 0.2 + 0.003 * tokens + 4e-6 * prompt_keys)
    assert pace.cost() == pytest.approx((0.2, 0.003, 4e-6), rel=1e-6)


def test_until_prompt_tokens_cost_can_be_told_apart_a_step_takes_one_chunk() -> None:
    pace = StepPace(2.0)
    for _ in range(7):
        pace.observe(Load(40, 0), 0.5)
    assert pace.cost() is None  # too few steps
    pace.observe(Load(40, 0), 0.5)
    assert pace.cost() is None  # eight alike steps: what a token costs cannot be told from the fixed part
    assert pace.allowance(rows=4, depth=0, budget=512) == PACE_QUANTUM  # a probe, not a stall
    assert pace.allowance(rows=4, depth=0, budget=5) == 5


def test_steps_too_alike_to_fit_keep_the_last_fit() -> None:
    """Streams decoding a long while alone leave the window with nothing that tells a prompt token's cost (a fit to
    their steps would give a decode row's, blind to how deep a prompt token attends): the last fit stands."""
    pace = StepPace(2.0)
    for tokens, prompt_keys in itertools.product((9, 17, 65), (0, 5000, 90_000)):
        pace.observe(Load(tokens, prompt_keys), 0.1 + 0.003 * tokens + 2e-6 * prompt_keys)
    fitted = pace.cost()
    assert fitted == pytest.approx((0.1, 0.003, 2e-6))
    for rows in itertools.islice(itertools.cycle((8, 7)), 100):  # streams ending and joining: a row's cost fits
        pace.observe(Load(rows, 0), 0.1 + 0.004 * rows)
    assert pace.cost() == fitted and pace.known == fitted
    assert pace.allowance(rows=8, depth=0, budget=512) == 40  # 0.124 s of spare over 3 ms a token


@pytest.mark.parametrize(("slowdown", "per_key"), [(2.0, 0.0), (2.0, 2e-7), (1.5, 2e-7), (4.0, 5e-7), (2.0, 2e-6)])
def test_a_step_takes_the_most_whole_chunks_whose_predicted_cost_fits_the_slowdown(slowdown: float,
                                                                                  per_key: float) -> None:
    pace = StepPace(slowdown)
    fixed, per_token = 0.6, 0.002
    pace.cost = lambda: (fixed, per_token, per_key)  # type: ignore[method-assign]
    rows, depth = 8, 3000

    def extra(k: int) -> float:  # k prompt tokens from position depth on, each attending over those before it
        return per_token * k + per_key * sum(depth + i + 1 for i in range(k))

    spare = (slowdown - 1) * (fixed + per_token * rows)
    fitting = [k for k in range(PACE_QUANTUM, 4097, PACE_QUANTUM) if extra(k) <= spare]
    k = pace.allowance(rows, depth, budget=4096)
    assert k == max(fitting, default=PACE_QUANTUM)  # at least one chunk, so the prompt goes on
    assert pace.allowance(rows, depth, budget=64) == min(64, k)


def test_the_allowance_keeps_its_precision_however_small_a_per_key_cost() -> None:
    pace = StepPace(2.0)
    for per_key in (0.0, 1e-22, 1e-12):
        pace.cost = lambda per_key=per_key: (0.6, 0.002, per_key)  # type: ignore[method-assign]
        assert pace.allowance(8, 3000, budget=4096) == 304  # (0.6 + 0.016) / 0.002 = 308 tokens, in chunks of 8


class Clock:
    """``time.perf_counter`` for the pace, set by hand; ``step`` plays one decode step of the worker."""

    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(pacing, "time", SimpleNamespace(perf_counter=lambda: self.now))
        self.seen: list[tuple[int, int, float]] = []
        """(tokens, prompt keys, seconds) of each step observed."""

    def pace(self, monkeypatch) -> StepPace:
        pace = StepPace(2.0)
        monkeypatch.setattr(pace, "observe", lambda load, s: self.seen.append((load.tokens, load.prompt_keys,
                                                                               pytest.approx(s))))
        return pace

    def step(self, pace: StepPace, started: float, queued: float, rows: list[object], ready: float,
             tokens: int = 1, keys: int = 0) -> None:
        """A step whose building began at ``started``, queued at ``queued``; then reading its rows' tokens of the
        step before returned at ``ready``."""
        self.now = queued
        pace.queued(Load(tokens, keys), started, rows)
        self.now = ready
        pace.done(rows)


def test_a_steps_time_on_a_backend_that_computes_while_the_next_step_is_built(monkeypatch) -> None:
    clock, a, b = Clock(monkeypatch), object(), object()
    pace = clock.pace(monkeypatch)
    clock.step(pace, 0.0, 0.01, [a], 0.011)  # nothing before it
    clock.step(pace, 0.05, 0.06, [a], 0.30)  # waited for the first step: it ran from 0.0 to 0.30
    clock.step(pace, 0.32, 0.33, [a], 0.80)  # the second began when the first was seen done (0.30), not at 0.05
    assert clock.seen == [(1, 0, 0.30), (1, 0, 0.50)]
    clock.step(pace, 0.85, 0.86, [b], 1.0)  # b was not in a's last step: nothing is known done
    clock.step(pace, 1.05, 1.06, [b], 1.3)  # b's first step is, and so a's before it, whose end is unknown
    clock.step(pace, 1.35, 1.36, [b], 1.6)
    assert clock.seen[2:] == [(1, 0, 0.30)]  # b's first step: from a's (1.3) to 1.6
    fresh = clock.pace(monkeypatch)
    clock.now = 5.0
    fresh.queued(Load(64, 2080), 4.9, [])
    clock.now = 5.25
    fresh.done(None)  # a pass of prompt chunks alone, waited for
    assert clock.seen[3:] == [(64, 2080, 0.35)]


def test_a_steps_time_on_a_backend_that_computes_while_queueing(monkeypatch) -> None:
    """MLX's CPU backend: queueing a step returns when it is computed, so its tokens are ready when asked for."""
    clock, a = Clock(monkeypatch), object()
    pace = clock.pace(monkeypatch)
    clock.step(pace, 0.0, 0.14, [a], 0.1401)
    clock.step(pace, 0.15, 0.29, [a], 0.2901)  # the first step: built and computed from 0.0 to 0.14
    clock.step(pace, 0.30, 0.50, [a], 0.5001)
    clock.step(pace, 3.0, 3.2, [a], 3.2001)  # the worker idled from 0.5 to 3.0 (no reader wanted a token)
    clock.step(pace, 3.25, 3.45, [a], 3.4501)
    assert clock.seen == [(1, 0, 0.14), (1, 0, 0.14), (1, 0, 0.20), (1, 0, 0.20)]


@pytest.mark.parametrize("slowdown", [1.0, 0.5, True, float("nan"), float("inf"), "2"])
def test_a_slowdown_must_be_a_number_above_one(slowdown: object) -> None:
    with pytest.raises(ValueError, match="slowdown"):
        StepPace(slowdown)  # type: ignore[arg-type]


def test_a_long_prompt_goes_in_the_chunks_the_pace_allows_beside_a_decoding_stream(logged_steps,  # noqa: F811
                                                                                   monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    assert model.step_pace is not None and model.step_pace.slowdown == 2.0
    observed: list[tuple[Load, float]] = []
    monkeypatch.setattr(model.step_pace, "observe", lambda load, s: observed.append((load, s)))
    monkeypatch.setattr(pacing, "_WAITED", 0.0)  # this tiny model's steps end before the next is built
    # A decode step costs 1 s, a prompt token 0.01 s: the streams' step may grow by 1.01 s, 101 tokens: 96.
    monkeypatch.setattr(model.step_pace, "cost", lambda: (1.0, 0.01, 0.0))
    short, long = model.encode("Hello there"), [(7 * i) % 300 + 10 for i in range(300)]
    config = {**GREEDY, "max_tokens": 30}
    with mlxchat.load_model(fixture_path("qwen3"), dtype="float32", max_decode_slowdown=None) as unpaced:
        assert unpaced.step_pace is None
        alone = {name: unpaced.generate(prompt, config).tokens for name, prompt in (("short", short), ("long", long))}
    logged_steps.clear()
    run = Inline(model)
    run.start("short", short, config, then={2: lambda: run.start("long", long, config)})
    run.wait()
    assert run.tokens == alone
    a, b = run.caches["short"], run.caches["long"]
    chunks = [(i, n) for i, step in enumerate(logged_steps) for kind, cache, n in step
              if kind == "prefill" and cache is b and n]
    # whole chunks of 8, up to 96 a step; the last 8 are the decode step's tail
    assert [n for _, n in chunks] == [96, 96, 96, 12]
    assert all(("decode", a, 1) in logged_steps[i] for i, _ in chunks)
    assert len(observed) > 20 and {load.tokens for load, _ in observed} >= {1, 97}  # decode steps, and steps beside
    beside = [load for load, _ in observed if load.tokens == 97]  # a chunk: its tokens attend over those before them
    assert [load.prompt_keys for load in beside[:2]] == [96 * 97 // 2, 96 * (2 * 96 + 97) // 2]
    model.close()
