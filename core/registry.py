"""The plugin registry: pluggy over the ``mlxchat.plugins`` entry points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pluggy

from . import hookspecs
from .architecture import Architecture
from .errors import CheckpointError, UnknownModelTypeError

ENTRY_POINT_GROUP = "mlxchat.plugins"


class Registry:
    """Architectures and tool-call parsers contributed by the registered plugins."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager("mlxchat")
        self.manager.add_hookspecs(hookspecs)
        from .tools import formats

        self.manager.register(formats, name="mlxchat.tools.formats")
        self.manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        self._architectures: dict[str, Architecture] | None = None
        self._parsers: dict[str, Any] | None = None

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object or module at run time."""
        self.manager.register(plugin, name=name)
        self._architectures = self._parsers = None

    def unregister(self, plugin: Any) -> None:
        self.manager.unregister(plugin)
        self._architectures = self._parsers = None

    def architectures(self) -> dict[str, Architecture]:
        if self._architectures is None:
            found: dict[str, Architecture] = {}
            for batch in self.manager.hook.mlxchat_architectures():
                for arch in batch:
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
            f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"] table (see mlxchat.hookspecs)."
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
            for batch in self.manager.hook.mlxchat_tool_parsers():
                found.update(batch)
            self._parsers = found
        return self._parsers


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
