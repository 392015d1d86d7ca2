"""Tools: definitions (``@tool``), and the registry of tool-call parsers."""

from .parsing import CallBlock, JsonTagsParser, ParsedCall, ToolCallParser
from .schema import Tool, tool, tool_schemas

__all__ = ["CallBlock", "JsonTagsParser", "ParsedCall", "Tool", "ToolCallParser", "tool", "tool_schemas"]
