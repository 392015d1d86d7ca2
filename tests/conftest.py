"""Shared test fixtures: the committed tiny checkpoints (built by tests/fixtures/make_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mlxchat

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
