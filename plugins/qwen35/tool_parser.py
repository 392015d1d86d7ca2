"""The XML-style tool calls of Qwen3.5, Qwen3.6 and Qwen3-Coder::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

Values are raw text, so their types come from the offered tool's JSON schema. The templates write mappings
and lists as JSON and everything else with Python's ``str`` (Qwen3.5: ``None``, ``True``) or as JSON
(Qwen3.6: ``null``, ``true``); both spellings are read. A value that does not fit its declared type stays
a string, as does a parameter the schema does not declare.
"""

from __future__ import annotations

import ast
import bisect
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from mlxchat.constraints import json_rule, keyword_arguments, raw_string_rule
from mlxchat.plugin import ParsedCall, TaggedCallParser, guess_name

_FUNCTION = re.compile(r"<function=([^<>\n]*)>")  # no "<": a line of openers without ">" costs its length once
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")
# Where a value whose </parameter> is missing ends: the next parameter at the start of a line, or the end
# of the function when only whitespace, another function or the end of the call follows it.
_NEXT_PARAMETER = re.compile(r"\n<parameter=([^>\n]*)>")
_FUNCTION_END = re.compile(r"\n?</function>\s*(?=<function=|$)")
_PARAMETER_END = "</parameter>"
_FUNCTION_CLOSE = "</function>"


class XmlToolCallParser(TaggedCallParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``: one or
    more functions per call block, values typed by the tool's JSON schema."""

    start = "<tool_call>"
    end = "</tool_call>"

    def forced_prefix(self, name: str | None = None) -> str | None:
        return f"{self.start}\n<function=" + ("" if name is None else f"{name}>\n")

    def call_grammar(self, tools: Sequence[dict[str, Any]], markup: Callable[[str], str]) -> str | None:
        """One function per block; string values raw (:func:`~mlxchat.constraints.raw_string_rule`), the
        others as JSON, each parameter on its own lines."""
        lines = [f'call: {markup(self.start)} "\\n" tc_fn "\\n" {markup(self.end)}',
                 "tc_fn: " + " | ".join(f"tc_f{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            rules, body = keyword_arguments(tool, i, lambda s: raw_string_rule(s) or json_rule(s),
                                            lambda key: f"<parameter={key}>\n", after="\n</parameter>\n")
            name = json.dumps(f"<function={tool['function']['name']}>\n")
            lines += [*rules, f'tc_f{i}: {name} {body} "</function>"']
        return "\n".join(lines) + "\n"

    def parse(self, body: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        closes = [m.start() for m in re.finditer(re.escape(_PARAMETER_END), body)]
        while (match := _FUNCTION.search(body, pos)) is not None:
            call, pos = self._function(body, match, closes)
            calls.append(call)
        if not calls:
            return [ParsedCall(guess_name(body), None, "expected <function=NAME> inside <tool_call>")]
        return calls

    def _function(self, body: str, match: re.Match[str], closes: list[int]) -> tuple[ParsedCall, int]:
        """The call opened by ``match`` and the position after it (``closes``: where ``</parameter>`` is)."""
        name = match.group(1).strip()
        schema = self.parameters(name)
        arguments: dict[str, Any] = {}
        pos = match.end()
        while True:
            pos = _skip_space(body, pos)
            if body.startswith(_FUNCTION_CLOSE, pos):
                pos += len(_FUNCTION_CLOSE)
                break
            if pos == len(body) or body.startswith("<function=", pos):
                break  # </function> missing: the call block (or the next function) still delimits it
            parameter = _PARAMETER.match(body, pos)
            if parameter is None:
                end = body.find(_FUNCTION_CLOSE, pos)
                resume = len(body) if end < 0 else end + len(_FUNCTION_CLOSE)
                error = f"unexpected text in <function={name}>: {body[pos:pos + 40]!r}"
                return ParsedCall(name, None, error), resume
            key = parameter.group(1).strip()
            value_end, pos = _value_end(body, parameter.end(), schema, closes)
            arguments[key] = coerce(_strip_newline(body[parameter.end() : value_end]), schema.get(key))
        if not name:
            return ParsedCall(name, None, "empty function name"), pos
        return ParsedCall(name, arguments), pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _strip_newline(value: str) -> str:
    """The template writes ``\\n`` around each value; only those two characters are markup."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _value_end(body: str, start: int, schema: dict[str, Any], closes: list[int]) -> tuple[int, int]:
    """Where the value starting at ``start`` ends, and where parsing resumes.

    ``</parameter>`` ends it unless a declared parameter (any, for a tool without schema) opens on a
    new line first; without any ``</parameter>`` the structural end of the function ends it. The search for
    that parameter stops at the next ``</parameter>`` (looked up in ``closes``, found once per block), so a
    block of thousands of values costs its length, not its length for each value.
    """
    index = bisect.bisect_left(closes, start)
    close = closes[index] if index < len(closes) else -1
    following = None
    for match in _NEXT_PARAMETER.finditer(body, start, len(body) if close < 0 else close + len(_PARAMETER_END)):
        if not schema or match.group(1).strip() in schema:
            following = match.start()
            break
    if close >= 0 and (following is None or close < following):
        return close, close + len(_PARAMETER_END)
    if following is not None:
        return following, following
    end = _FUNCTION_END.search(body, start)
    return (end.start(), end.start()) if end else (len(body), len(body))


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a schema admits (``type``, ``anyOf``/``oneOf`` members, or its ``enum`` values)."""
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or ())
    for option in (*schema.get("anyOf", ()), *schema.get("oneOf", ())):
        if isinstance(option, dict):
            types |= _schema_types(option)
    if not types and "enum" in schema:
        types = {_json_type(v) for v in schema["enum"]}
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "string"


def coerce(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the type its schema declares (the text itself when it fits none)."""
    types = _schema_types(schema) if isinstance(schema, dict) else set()
    if not types or types == {"string"}:
        return raw
    text = raw.strip()
    if text in ("null", "None") and ("null" in types or "string" not in types):
        return None
    if "boolean" in types and text in ("true", "True", "false", "False"):
        return text.lower() == "true"
    if "integer" in types or "number" in types:
        number = _number(text, integral="number" not in types)
        if number is not None:
            return number
    if "object" in types or "array" in types:
        value = _structure(text)
        if isinstance(value, dict) and "object" in types or isinstance(value, list) and "array" in types:
            return value
    return raw


def _number(text: str, integral: bool) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    if integral:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _structure(text: str) -> Any:
    """A JSON (or Python-literal) mapping or list; a JSON string holding one is decoded twice."""
    try:
        value = json.loads(text)
    except ValueError:
        value = _literal(text)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = _literal(value)
    return value


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
