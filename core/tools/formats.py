"""The tool-call formats core ships, registered through the same hook plugins use."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .parsing import JsonTagsParser, ToolCallParser


@hookimpl
def mlxchat_tool_parsers() -> dict[str, type[ToolCallParser]]:
    return {"json_tags": JsonTagsParser}
