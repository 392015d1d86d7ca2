"""Every built-in plugin passes the conformance kit (mlxchat.testing) on its fixtures, found by walking
tests/fixtures: a fixture's config.json names its plugin, so a plugin present is a plugin tested.

- parity with the fixture's oracle (transformers in float32; mlx-lm for its own quantized copies): logits,
  prefill in uneven chunks (across sliding windows and DeltaNet chunks), cached decoding, greedy tokens;
- the session contract on every fixture that is no variant of another.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import mlxchat
from mlxchat.testing import (
    SessionContract,
    architecture_of,
    assert_parity,
    batched_decoding_problems,
    fixture_folders,
    load_fixture,
)

from conftest import FIXTURES

PARITY = fixture_folders(FIXTURES)
SESSIONS = fixture_folders(FIXTURES, variants=False)


def built_in_architectures() -> set[str]:
    """The architectures the mlxchat distribution's own plugins register."""
    modules = {entry.value for entry in importlib.metadata.distribution("mlxchat").entry_points
               if entry.group == "mlxchat.plugins"}
    return {name for name, arch in mlxchat.registry().architectures().items()
            if arch.model_class.__module__.split(".")[0] in modules}


def test_every_built_in_plugin_has_fixtures_of_each_of_its_model_types() -> None:
    covered = {architecture_of(folder).name for folder in PARITY}
    assert built_in_architectures() <= covered
    assert {architecture_of(folder).name for folder in SESSIONS} == covered


@pytest.mark.parametrize("folder", PARITY, ids=lambda folder: folder.name)
def test_fixture_matches_its_oracle(folder: Path) -> None:
    assert_parity(folder)


class TestSessions(SessionContract):
    @pytest.fixture(params=SESSIONS, ids=lambda folder: folder.name)
    def fixture_folder(self, request: pytest.FixtureRequest) -> Path:
        return request.param


@pytest.mark.parametrize("folder", SESSIONS, ids=lambda folder: folder.name)
def test_sequences_decoded_together_equal_each_decoded_alone(folder: Path) -> None:
    model = load_fixture(folder)
    prompts = [[1, 5, 9, 13, 2, 7], list(range(20, 47)), [3, 3, 8]]  # different lengths and positions
    assert batched_decoding_problems(model, prompts) == []
