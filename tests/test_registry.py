"""The plugin registry refuses plugins that cannot work together, naming them: two that claim one
model_type or one tool-call format, a hook that does not exist (a misspelling), a plugin package that does
not import. A plugin that claims nothing new registers."""

from __future__ import annotations

import pytest

from mlxchat.errors import PluginError
from mlxchat.plugin import Architecture, ChatQuirks, JsonTagsParser, hookimpl
from mlxchat.registry import Registry
from mlxchat_qwen3 import Qwen3Config, Qwen3ForCausalLM


class Plugin:
    """A plugin object whose hooks return what it is given."""

    def __init__(self, architectures=(), parsers=None):
        self.architectures, self.parsers = architectures, parsers or {}

    @hookimpl
    def mlxchat_architectures(self):
        return self.architectures

    @hookimpl
    def mlxchat_tool_parsers(self):
        return self.parsers


def architecture(name: str, *model_types: str) -> Architecture:
    return Architecture(name, model_types, Qwen3Config, Qwen3ForCausalLM, ChatQuirks())


def test_a_plugin_that_claims_nothing_taken_registers() -> None:
    registry = Registry()
    registry.register(Plugin([architecture("mine", "my_type")], {"my_format": JsonTagsParser}), name="mine")
    assert registry.architecture_for("my_type").name == "mine"
    assert registry.tool_parsers()["my_format"] is JsonTagsParser


def test_two_plugins_claiming_one_model_type_are_named() -> None:
    registry = Registry()
    registry.register(Plugin([architecture("qwen3_again", "qwen3_moe")]), name="impostor")
    with pytest.raises(PluginError, match=r"plugins 'qwen3' and 'impostor' both claim model_type 'qwen3_moe'"):
        registry.architectures()


def test_two_architectures_of_one_name_are_named() -> None:
    registry = Registry()
    registry.register(Plugin([architecture("gemma4", "other_type")]), name="impostor")
    with pytest.raises(PluginError, match=r"'gemma4' and 'impostor' both claim an architecture named 'gemma4'"):
        registry.architectures()


def test_two_plugins_registering_one_parser_name_are_named() -> None:
    registry = Registry()
    registry.register(Plugin(parsers={"pythonic": JsonTagsParser}), name="impostor")
    with pytest.raises(PluginError, match=r"plugins 'lfm2' and 'impostor' both register a tool-call parser "
                                          r"named 'pythonic'"):
        registry.tool_parsers()


def test_a_misspelled_hook_is_an_error_naming_the_plugin() -> None:
    class Misspelled:
        @hookimpl
        def mlxchat_architecture(self):  # the hook is mlxchat_architectures
            return []

    registry = Registry()
    with pytest.raises(PluginError, match=r"plugin 'typo' cannot be registered: .*mlxchat_architecture.*"
                                          r"hooks: mlxchat_architectures, mlxchat_tool_parsers"):
        registry.register(Misspelled(), name="typo")
    assert "typo" not in dict(registry.manager.list_name_plugin())


def test_a_hook_returning_the_wrong_kind_is_named() -> None:
    registry = Registry()
    registry.register(Plugin(architectures=architecture("single", "single_type")), name="careless")
    with pytest.raises(PluginError, match="plugin 'careless': mlxchat_architectures returned Architecture"):
        registry.architectures()


def test_a_plugin_package_that_fails_to_import_is_named(tmp_path, monkeypatch) -> None:
    site = tmp_path / "site"
    info = site / "broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "broken_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mlxchat.plugins]\nbroken = broken_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(PluginError, match=r"plugin 'broken' \(broken_plugin, from broken-plugin\) failed to "
                                          r"import: ImportError: needs a library"):
        Registry()
