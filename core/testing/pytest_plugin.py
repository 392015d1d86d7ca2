"""The ``mlxchat`` pytest plugin, registered by installing mlxchat (entry point ``pytest11``).

It provides the ``mlxchat_fixture`` fixture (a fixture folder's shared float32 model) and stops the
workers of the fixture models a test run loaded when the run ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ..model import GenerativeModel
from . import fixtures

_LOADED_BEFORE = pytest.StashKey[set[Path]]()


@pytest.fixture
def mlxchat_fixture() -> Callable[..., GenerativeModel]:
    """``mlxchat_fixture(folder)``: the model of a fixture folder, loaded once per run."""
    return fixtures.load_fixture


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_LOADED_BEFORE] = fixtures.loaded_folders()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close what this run loaded (a run inside another, as pytester makes, leaves the outer run's)."""
    before: set[Path] = session.stash.get(_LOADED_BEFORE, set())
    fixtures.close_fixtures(keep=before)
