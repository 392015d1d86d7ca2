"""Tools: definitions (``@tool``), running them for a session, and the tool-call parsers' bases."""

from .context import ToolContext
from .parsing import CallBlock, JsonTagsParser, ParsedCall, TaggedCallParser, ToolCallParser, TrailingCallParser
from .schema import Tool, tool, tool_functions, tool_schemas

__all__ = ["CallBlock", "JsonTagsParser", "ParsedCall", "TaggedCallParser", "Tool", "ToolCallParser",
           "ToolContext", "TrailingCallParser", "tool", "tool_functions", "tool_schemas"]
