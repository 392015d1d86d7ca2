"""Shared test fixtures: the committed tiny checkpoints (built by tests/fixtures/make_fixtures.py)."""

# mlxchat must be imported before mlx.core anywhere in the process: it puts OpenBLAS under MLX then, and
# pytest imports this file before any test module.
import mlxchat  # noqa: I001

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat.generation

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_path(name: str) -> Path:
    return FIXTURES / name


def reference(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "reference.npz"))


_models: dict[str, mlxchat.GenerativeModel] = {}


def loaded(name: str) -> mlxchat.GenerativeModel:
    """One shared float32 model per fixture for the whole run (loading is cheap, but not free)."""
    if name not in _models:
        _models[name] = mlxchat.load_model(FIXTURES / name, dtype="float32")
    return _models[name]


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
