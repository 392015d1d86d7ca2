"""Tool definitions: OpenAI-style dicts, or Python functions turned into them by :func:`tool`."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, get_type_hints

from pydantic import Field, create_model

from .context import ToolContext

ToolSpec = dict[str, Any]


class Tool:
    """A Python function with its OpenAI tool schema (``Tool.schema``); calling it calls the function.

    ``needs_approval``: a session running tools automatically stops before calling it until the user
    approves the call (see :meth:`mlxchat.ChatSession.respond_to_approval`). A parameter annotated
    :class:`~mlxchat.tools.running.ToolContext` is not part of the schema: the session passes the context.
    ``strict``: whenever the model opens a call, its arguments are constrained to the schema (OpenAI's
    ``"strict": true``; see :mod:`mlxchat.constraints`).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, description: str | None = None, *,
                 needs_approval: bool = False, strict: bool = False):
        self.fn = fn
        self.name = name or fn.__name__
        self.needs_approval = needs_approval
        summary, params = _parse_docstring(inspect.getdoc(fn) or "")
        self.description = description if description is not None else summary
        self.context_parameter = _context_parameter(fn)
        """The name of the parameter that receives a ToolContext, if the function declares one."""
        self.schema: ToolSpec = {
            "type": "function",
            "function": {"name": self.name, "description": self.description,
                         "parameters": _parameters_schema(fn, params, skip=self.context_parameter)},
        }
        if strict:
            self.schema["function"]["strict"] = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name})"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         needs_approval: bool = False, strict: bool = False) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., needs_approval=True, strict=True)`` turns a typed, documented
    function (sync or ``async def``) into a :class:`Tool`.

    Parameter types come from the type hints (through pydantic), descriptions from a Google-style
    ``Args:`` section of the docstring, and the tool's description from the docstring's first part.
    """
    if fn is None:
        return lambda f: Tool(f, name, description, needs_approval=needs_approval, strict=strict)
    return Tool(fn, name, description, needs_approval=needs_approval, strict=strict)


def tool_functions(tools: Sequence[Any]) -> dict[str, Tool]:
    """The tools among ``tools`` that have a Python function (``@tool`` objects and plain functions), by
    name: the ones a session can call by itself."""
    found = {}
    for item in tools:
        if isinstance(item, Tool) or (callable(item) and not isinstance(item, dict)):
            runnable = item if isinstance(item, Tool) else Tool(item)
            found[runnable.name] = runnable
    return found


def tool_schemas(tools: Sequence[Any]) -> list[ToolSpec]:
    """OpenAI tool dicts from dicts (``{"type": "function", "function": {...}}`` or the bare function
    part), :class:`Tool` objects and plain functions."""
    out = []
    for item in tools:
        if isinstance(item, Tool):
            out.append(item.schema)
        elif isinstance(item, dict):
            if "function" in item:
                out.append({"type": item.get("type", "function"), **item})
            elif "name" in item:
                out.append({"type": "function", "function": item})
            else:
                raise ValueError(f"a tool dict needs a 'function' or a 'name': {item!r}")
        elif callable(item):
            out.append(Tool(item).schema)
        else:
            raise ValueError(f"tools must be dicts, @tool functions or functions, got {type(item).__name__}")
    return out


def tool_names(schemas: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    return {s["function"]["name"]: s for s in schemas}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    match = re.search(r"^\s*(Args|Arguments|Parameters):\s*$", doc, flags=re.MULTILINE)
    if not match:
        return doc.strip(), {}
    summary, rest = doc[: match.start()].strip(), doc[match.end():]
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if re.match(r"^\s*(Returns|Raises|Yields|Examples?):\s*$", line):
            break
        item = re.match(r"^\s+(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if item:
            current = item.group(1)
            params[current] = item.group(3).strip()
        elif current and line.strip():
            params[current] += " " + line.strip()
    return summary, params


def _context_parameter(fn: Callable[..., Any]) -> str | None:
    hints = get_type_hints(fn)
    return next((name for name, hint in hints.items() if hint is ToolContext and name != "return"), None)


def _parameters_schema(fn: Callable[..., Any], descriptions: dict[str, str], skip: str | None = None) -> dict[str, Any]:
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == skip:
            continue
        if param.name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {param.name!r} needs a type hint")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints[param.name], Field(default, description=descriptions.get(param.name)))
    schema = create_model(f"{fn.__name__}_parameters", **fields).model_json_schema()
    return _strip_titles(schema)


def _strip_titles(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_titles(v) for k, v in value.items() if k != "title" or not isinstance(v, str)}
    if isinstance(value, list):
        return [_strip_titles(v) for v in value]
    return value
