"""The conformance kit itself, run as a plugin author runs it (in a pytest run of its own, made by
pytester): a deliberately broken copy of the Qwen3 plugin (a LayerNorm where the final RMSNorm belongs)
fails assert_parity with a message that says which checks failed and where; the real plugin passes the
same checks; a SessionContract subclass naming a fixture runs."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import fixture_path

PLUGIN_TESTS = '''
from pathlib import Path

import mlx.nn as nn
import pytest

import mlxchat
from mlxchat.plugin import Architecture, ChatQuirks, hookimpl
from mlxchat.testing import SessionContract, assert_parity
from mlxchat_qwen3 import Qwen3Config, Qwen3ForCausalLM

HERE = Path(__file__).parent


class WrongNormQwen3(Qwen3ForCausalLM):
    """Qwen3 with a LayerNorm (which also removes the mean) where the final RMSNorm belongs."""

    def __init__(self, config):
        super().__init__(config)
        self.model.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps, bias=False)


class BrokenPlugin:
    @hookimpl
    def mlxchat_architectures(self):
        return [Architecture("qwen3_wrong_norm", ("qwen3_wrong_norm",), Qwen3Config, WrongNormQwen3, ChatQuirks())]


@pytest.fixture(autouse=True, scope="module")
def broken_plugin():
    plugin = BrokenPlugin()
    mlxchat.registry().register(plugin, name="broken")
    yield
    mlxchat.registry().unregister(plugin)


def test_broken_copy():
    assert_parity(HERE / "broken")


def test_real_plugin():
    assert_parity(HERE / "qwen3")


class TestSessions(SessionContract):
    fixture = HERE / "qwen3"
'''


def test_a_broken_plugin_fails_parity_with_a_readable_message(pytester: pytest.Pytester) -> None:
    shutil.copytree(fixture_path("qwen3"), pytester.path / "qwen3")
    broken = pytester.path / "broken"
    shutil.copytree(fixture_path("qwen3"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_wrong_norm"}))
    pytester.makepyfile(test_plugin=PLUGIN_TESTS)

    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "copy or real or regenerate")

    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*broken (qwen3_wrong_norm plugin, WrongNormQwen3) does not match its reference (tolerance 1e-04):",
        "*full forward: max abs error * (largest at position *",
        "*prefill in chunks [[]24[]], then one token at a time: max abs error *",
        "*greedy continuation through the caches: token * is *, the reference chose *",
        "*greedy continuation through generate(): token * is *, the reference chose *",
    ])
