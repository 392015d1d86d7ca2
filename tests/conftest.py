"""Shared test fixtures: the committed tiny checkpoints (built by tests/fixtures/make_fixtures.py).

pytest's ``pytester`` serves the tests of the conformance kit itself (tests/test_testing_kit.py)."""

# mlxchat must be imported before mlx.core anywhere in the process: it puts OpenBLAS under MLX then, and
# pytest imports this file before any test module.
import mlxchat  # noqa: I001

import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat.generation
from mlxchat.testing import load_fixture

pytest_plugins = ["pytester"]

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_path(name: str) -> Path:
    return FIXTURES / name


def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def loaded(name: str) -> mlxchat.GenerativeModel:
    """The shared float32 model of a fixture, loaded once for the whole run (see mlxchat.testing)."""
    return load_fixture(FIXTURES / name)


@pytest.fixture
def qwen3() -> mlxchat.GenerativeModel:
    return loaded("qwen3")


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """Token lists the next generations sample instead of choosing (the model still runs every token
    through its cache); once they are used up, sampling is real again. Random-weight models neither call
    tools nor end turns, so session tests script those replies."""
    replies: list[list[int]] = []
    real = mlxchat.generation.make_sampler

    def make_sampler(*args: object, **kwargs: object):
        if not replies:
            return real(*args, **kwargs)
        script = replies.pop(0)
        tokens = iter(script)  # decoding samples one token past the end of turn: repeat the last one
        return lambda logits: mx.array([next(tokens, script[-1])])

    monkeypatch.setattr(mlxchat.generation, "make_sampler", make_sampler)
    yield replies


def hold_worker_until_queued(model: mlxchat.GenerativeModel, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold the model's worker until ``count`` more jobs are queued behind it, so that turns sent from several
    threads reach it together ("at once" by counting, not by timing). Returns once the worker holds: a job
    queued before the hold began would be taken with it and start a step ahead of the others."""
    queued, holding = threading.Semaphore(0), threading.Event()
    start = model.worker.start

    def counted(*args, **kwargs):
        job = start(*args, **kwargs)
        queued.release()
        return job

    def hold() -> None:
        holding.set()
        for _ in range(count):
            queued.acquire()

    monkeypatch.setattr(model.worker, "start", counted)
    model.worker.submit(hold)
    holding.wait()
