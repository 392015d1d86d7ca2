"""The plugin contract. A plugin is a module with ``@hookimpl`` functions, found through the entry-point
group ``mlxchat.plugins`` (the built-in plugins register exactly like a third-party package would)::

    # pyproject.toml of the plugin package
    [project.entry-points."mlxchat.plugins"]
    myarch = "mlxchat_myarch"

    # mlxchat_myarch/__init__.py (plugin code imports from mlxchat.plugin)
    from mlxchat.plugin import Architecture, hookimpl

    @hookimpl
    def mlxchat_architectures():
        return [Architecture("myarch", ("myarch",), MyConfig, MyModel)]

A plugin can also be registered at run time with ``mlxchat.registry().register(module)``. A hook whose
name is none of these, or two plugins claiming one ``model_type`` or format name, is a ``PluginError``.
``examples/mlxchat-llama`` is a complete plugin package, tested with ``mlxchat.testing``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .architecture import Architecture
    from .tools.parsing import ToolCallParser

hookspec = pluggy.HookspecMarker("mlxchat")
hookimpl = pluggy.HookimplMarker("mlxchat")


@hookspec
def mlxchat_architectures() -> list[Architecture]:
    """Return the architectures this plugin serves (see :class:`mlxchat.Architecture`)."""
    raise NotImplementedError


@hookspec
def mlxchat_tool_parsers() -> dict[str, type[ToolCallParser]]:
    """Return tool-call parsers by format name; an architecture names its format in ``ChatQuirks``."""
    raise NotImplementedError
