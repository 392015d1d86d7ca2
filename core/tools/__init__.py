"""Tools: definitions (``@tool``), and the tool-call parsers' bases."""

from .parsing import CallBlock, JsonTagsParser, ParsedCall, TaggedCallParser, ToolCallParser, TrailingCallParser
from .schema import Tool, tool, tool_schemas

__all__ = ["CallBlock", "JsonTagsParser", "ParsedCall", "TaggedCallParser", "Tool", "ToolCallParser",
           "TrailingCallParser", "tool", "tool_schemas"]
