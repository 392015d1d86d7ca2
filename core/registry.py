"""The plugin registry: pluggy over the ``mlxchat.plugins`` entry points.

Plugins must agree: two plugins that claim one ``model_type`` or one tool-call format name, or a
``@hookimpl`` whose name is no hook (a misspelling would otherwise be silently ignored), are a
:class:`~mlxchat.errors.PluginError` that names the plugins.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pluggy

from . import hookspecs
from .architecture import Architecture
from .errors import CheckpointError, PluginError, UnknownModelTypeError

ENTRY_POINT_GROUP = "mlxchat.plugins"
T = TypeVar("T")


class Registry:
    """Architectures and tool-call parsers contributed by the registered plugins."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager("mlxchat")
        self.manager.add_hookspecs(hookspecs)
        from .tools import formats

        self._architectures: dict[str, Architecture] | None = None
        self._parsers: dict[str, Any] | None = None
        self.register(formats, name="mlxchat.tools.formats")
        for name, plugin in _entry_point_plugins():
            self.register(plugin, name=name)

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object or module at run time."""
        label = name or getattr(plugin, "__name__", repr(plugin))
        try:
            self.manager.register(plugin, name=name)
            self.manager.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            raise PluginError(f"plugin {label!r} cannot be registered: {exc} (hooks: "
                              f"{', '.join(h for h in dir(hookspecs) if h.startswith('mlxchat_'))})") from exc
        self._architectures = self._parsers = None

    def unregister(self, plugin: Any) -> None:
        self.manager.unregister(plugin)
        self._architectures = self._parsers = None

    def architectures(self) -> dict[str, Architecture]:
        if self._architectures is None:
            found: dict[str, Architecture] = {}
            owners: dict[tuple[str, str], str] = {}  # (what, name) -> the plugin that claims it
            for plugin, batch in self._results("mlxchat_architectures", list):
                for arch in batch:
                    for claim in [("an architecture named", arch.name), *(("model_type", t) for t in arch.model_types)]:
                        if claim in owners:
                            raise PluginError(f"plugins {owners[claim]!r} and {plugin!r} both claim {claim[0]} "
                                              f"{claim[1]!r}; uninstall one of them")
                        owners[claim] = plugin
                    found[arch.name] = arch
            self._architectures = found
        return self._architectures

    def known_model_types(self) -> list[str]:
        return sorted({t for arch in self.architectures().values() for t in arch.model_types})

    def architecture_for(self, model_type: str) -> Architecture:
        for arch in self.architectures().values():
            if model_type in arch.model_types:
                return arch
        raise UnknownModelTypeError(
            f"no plugin serves model_type {model_type!r}. Known model types: "
            f"{', '.join(self.known_model_types()) or '(none)'}. To add one, write a plugin package that "
            f"implements the `mlxchat_architectures` hook and declares it under the "
            f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"] table (see mlxchat.plugin)."
        )

    def architecture_for_config(self, raw: dict[str, Any]) -> Architecture:
        """The architecture for a ``config.json`` dict: top-level ``model_type`` first, then the nested one."""
        types = model_types_of(raw)
        if not types:
            raise CheckpointError("config.json has no model_type (neither top level nor in text_config)")
        for model_type in types:
            try:
                return self.architecture_for(model_type)
            except UnknownModelTypeError:
                continue
        return self.architecture_for(types[0])

    def tool_parsers(self) -> dict[str, Any]:
        if self._parsers is None:
            found: dict[str, Any] = {}
            owners: dict[str, str] = {}
            for plugin, batch in self._results("mlxchat_tool_parsers", dict):
                for name, parser in batch.items():
                    if name in owners:
                        raise PluginError(f"plugins {owners[name]!r} and {plugin!r} both register a tool-call "
                                          f"parser named {name!r}; uninstall one of them")
                    owners[name], found[name] = plugin, parser
            self._parsers = found
        return self._parsers

    def _results(self, hook: str, kind: type[T]) -> Iterator[tuple[str, T]]:
        """Each plugin's result of a hook, with the plugin's name, in registration order."""
        for impl in getattr(self.manager.hook, hook).get_hookimpls():
            result = impl.function()
            if not isinstance(result, kind):
                raise PluginError(f"plugin {impl.plugin_name!r}: {hook} returned {type(result).__name__}, "
                                  f"expected a {kind.__name__}")
            yield impl.plugin_name, result


def _entry_point_plugins() -> Iterator[tuple[str, Any]]:
    """The plugin modules declared under the entry-point group, each imported once; a name declared by two
    distributions, or a module that fails to import, is a :class:`PluginError`."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points:
            if entry.group != ENTRY_POINT_GROUP:
                continue
            owner = dist.metadata["Name"]
            if entry.name in seen:
                if seen[entry.name] == owner:
                    continue  # one distribution found twice on the path
                raise PluginError(f"the distributions {seen[entry.name]!r} and {owner!r} both declare a plugin "
                                  f"named {entry.name!r} under {ENTRY_POINT_GROUP!r}; uninstall one of them")
            seen[entry.name] = owner
            try:
                plugin = entry.load()
            except Exception as exc:  # a broken plugin package: say which one
                raise PluginError(f"plugin {entry.name!r} ({entry.value}, from {owner}) failed to import: "
                                  f"{type(exc).__name__}: {exc}") from exc
            yield entry.name, plugin


def model_types_of(raw: dict[str, Any]) -> list[str]:
    types = [raw.get("model_type")]
    text = raw.get("text_config")
    if isinstance(text, dict):
        types.append(text.get("model_type"))
    return [t for t in types if isinstance(t, str) and t]


def detect_model_type(path: str | Path) -> str:
    """The ``model_type`` a checkpoint folder declares: top level, or nested in ``text_config``."""
    from .checkpoint import read_json

    raw = read_json(Path(path) / "config.json")
    types = model_types_of(raw)
    if not types:
        raise CheckpointError(f"{Path(path) / 'config.json'}: no model_type (neither top level nor in text_config)")
    return types[0]


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry (plugins are loaded on first use)."""
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry
