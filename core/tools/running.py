"""Running the Python function behind a tool call, for sessions that call tools automatically.

A tool's failure is the model's to see: an exception becomes the tool result ``"Error: ..."``, never a
crash of the turn. Sync tools run on the reader's thread (never on the model's worker, so a tool may use
the model itself); in ``asend``/``astream`` async tools are awaited on the event loop and sync ones run in
a worker thread of asyncio's. A tool that declares a parameter annotated :class:`ToolContext` receives
one, and can ask the user something in the middle of its work.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

from ..limits import check_text
from ..messages import ToolCall
from .context import Ask, ToolContext
from .schema import Tool


def _arguments(tool: Tool, call: ToolCall, arguments: dict[str, Any], ask: Ask | None) -> dict[str, Any]:
    context = tool.context_parameter
    return {**arguments, context: ToolContext(call, ask)} if context else dict(arguments)


def _as_text(value: Any) -> str:
    """The result as the text the model reads (checked: a lone surrogate is no text a tokenizer encodes, and would
    fail the turn where the result is recorded)."""
    return check_text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str),
                      "the tool's result")


def _failure(exc: BaseException) -> str:
    return f"Error: {type(exc).__name__}: {exc}".encode("utf-8", "replace").decode()


def run_tool(tool: Tool, call: ToolCall, arguments: dict[str, Any], ask: Ask | None = None) -> str:
    """The tool's result as text (an exception's as ``Error: ...``), run on this thread."""
    try:
        value = tool.fn(**_arguments(tool, call, arguments, ask))
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return _as_text(value)
    except Exception as exc:  # noqa: BLE001 - the model sees the failure and can recover
        return _failure(exc)


async def arun_tool(tool: Tool, call: ToolCall, arguments: dict[str, Any], ask: Ask | None = None) -> str:
    """:func:`run_tool` for asyncio: async tools are awaited here, sync ones run in a thread."""
    try:
        if inspect.iscoroutinefunction(tool.fn):
            value = await tool.fn(**_arguments(tool, call, arguments, ask))
        else:
            value = await asyncio.to_thread(tool.fn, **_arguments(tool, call, arguments, ask))
            if inspect.isawaitable(value):
                value = await value
        return _as_text(value)
    except Exception as exc:  # noqa: BLE001 - the model sees the failure and can recover
        return _failure(exc)


async def _awaited(value: Any) -> Any:
    return await value
