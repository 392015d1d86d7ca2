"""LFM2's tool calls: a Python list of calls between special tokens,
``<|tool_call_start|>[get_weather(city="Tokyo"), calendar.add(day=3)]<|tool_call_end|>``.

The list is read with :mod:`ast` and only literals are accepted (strings, numbers, booleans, ``None``,
lists, tuples, dicts; JSON's ``true``/``false``/``null`` too): nothing is ever evaluated. Before
parsing, the slips models make that Python rejects are repaired (raw newlines inside quotes, integers
with leading zeros, Python keywords as argument names); if the list still does not parse, each call
is parsed on its own, so one broken call does not take the others with it.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
from collections.abc import Callable, Sequence
from typing import Any

from mlxchat.constraints import json_rule, keyword_arguments
from mlxchat.plugin import ParsedCall, TaggedCallParser, guess_name

_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)
_JSON_NAMES = {"true": True, "false": False, "null": None}
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A lexeme: a quoted string (perhaps unterminated), a number, a name, or any other character.
_LEXEME = re.compile(
    r"""(?P<string>'''(?:\\.|(?!''').)*(?:'''|$)|\"\"\"(?:\\.|(?!\"\"\").)*(?:\"\"\"|$)
                   |'(?:\\.|[^'\\])*(?:'|$)|"(?:\\.|[^"\\])*(?:"|$))
       |(?P<number>\d\w*)
       |(?P<name>[^\W\d]\w*)
       |(?P<other>.)""",
    re.DOTALL | re.VERBOSE,
)
_KEYWORD_PREFIX = "__kw_"
_ASSIGNED = re.compile(r"\s*=(?!=)")


def repair(source: str) -> str:
    """``source`` with the model slips Python rejects fixed; a text that parses is returned unchanged
    (keywords used as argument names become ``__kw_<name>``, which :func:`argument_name` undoes). What
    comes before a lexeme is known from the lexemes before it, never by copying the source up to it, which
    would cost the source's length for each lexeme."""
    out = []
    previous = solid = ""  # the lexeme before, and the last one that is not whitespace
    for match in _LEXEME.finditer(source):
        text, kind = match.group(), match.lastgroup
        if kind == "string" and not text.startswith(("'''", '"""')):
            text = re.sub(r"(\\.)|[\n\r\t]", lambda m: m.group(1) or _ESCAPES[m.group()], text,
                          flags=re.DOTALL)
        elif (kind == "number" and text.isdigit() and text.startswith("0") and text.strip("0")
              and not previous.endswith(".")):  # not the fraction of 1.05
            text = text.lstrip("0")
        elif (kind == "name" and keyword.iskeyword(text) and _ASSIGNED.match(source, match.end())
              and not solid.endswith(".")):
            text = _KEYWORD_PREFIX + text
        out.append(text)
        previous = match.group()
        solid = previous if previous.strip() else solid
    return "".join(out)


def argument_name(name: str) -> str:
    original = name.removeprefix(_KEYWORD_PREFIX)
    return original if keyword.iskeyword(original) else name


def split_calls(source: str) -> list[str]:
    """The top-level items of a ``[...]`` list (the whole text when it is not one), split outside strings."""
    if not (source.startswith("[") and source.endswith("]")):
        return [source]
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for match in _LEXEME.finditer(source[1:-1]):
        text = match.group()
        if match.lastgroup == "other":
            depth += (text in "([{") - (text in ")]}")
            if text == "," and depth == 0:
                items.append("".join(current))
                current = []
                continue
        current.append(text)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def literal(node: ast.expr) -> Any:
    """The JSON value a literal expression denotes; ``ValueError`` for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is str:
        # A JSON escape pair such as "\ud83d\ude00" is one character in JSON but two surrogates in Python.
        return node.value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (int, float, bool)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd)
            and isinstance(node.operand, ast.Constant)):
        number = node.operand.value
        if isinstance(number, int | float) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = literal(key) if key is not None else None
            if not isinstance(name, str):
                raise ValueError("dict keys must be strings")
            out[name] = literal(value)
        return out
    text = ast.unparse(node)
    raise ValueError(f"{text if len(text) <= 40 else text[:37] + '...'} is not a literal value")


def dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = dotted_name(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


class PythonicCallsParser(TaggedCallParser):
    """``<|tool_call_start|>[name(arg=value, ...), ...]<|tool_call_end|>`` (LFM2, LFM2.5)."""

    start = "<|tool_call_start|>"
    end = "<|tool_call_end|>"

    def forced_prefix(self, name: str | None = None) -> str | None:
        return f"{self.start}[" + ("" if name is None else f"{name}(")

    def call_grammar(self, tools: Sequence[dict[str, Any]], markup: Callable[[str], str]) -> str | None:
        """A list of calls ``[name(key=value, ...), ...]`` with JSON values (Python literals too, and
        ``true``/``false``/``null`` are read as JSON's)."""
        lines = [f'call: {markup(self.start)} "[" tc_fn (", " tc_fn)* "]" {markup(self.end)}',
                 "tc_fn: " + " | ".join(f"tc_f{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            rules, body = keyword_arguments(tool, i, json_rule, lambda key: f"{key}=", ", ")
            lines += [*rules, f'tc_f{i}: {json.dumps(tool["function"]["name"] + "(")} {body} ")"']
        return "\n".join(lines) + "\n"

    def parse(self, body: str) -> list[ParsedCall]:
        source = repair(body.strip())
        if source in ("", "[]"):
            return []
        try:
            tree = ast.parse(source, mode="eval").body
        except _PARSE_ERRORS:
            return [self._parse_one(item) for item in split_calls(source)]
        nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
        return [self._call(node) for node in nodes]

    def _parse_one(self, source: str) -> ParsedCall:
        try:
            node = ast.parse(source, mode="eval").body
        except _PARSE_ERRORS as exc:
            shown = source.replace(_KEYWORD_PREFIX, "")
            reason = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
            return ParsedCall(guess_name(shown), None, f"not a Python call ({reason}): {shown}")
        return self._call(node)

    def _call(self, node: ast.expr) -> ParsedCall:
        if not isinstance(node, ast.Call):
            return ParsedCall(guess_name(ast.unparse(node)), None, "expected a call like name(arg=value)")
        name = dotted_name(node.func)
        if name is None:
            return ParsedCall("", None, "the function must be a (dotted) name")
        arguments: dict[str, Any] = {}
        positional = list(self.parameters(name))
        if len(node.args) > len(positional):
            return ParsedCall(name, None, "positional arguments need an offered tool with that many "
                                          "parameters (write name=value)")
        pairs = list(zip(positional, node.args, strict=False))
        for item in node.keywords:
            if item.arg is None:
                return ParsedCall(name, None, "**-arguments are not supported")
            pairs.append((argument_name(item.arg), item.value))
        for key, value in pairs:
            if key in arguments:
                return ParsedCall(name, None, f"argument {key!r} is given twice")
            try:
                arguments[key] = literal(value)
            except (ValueError, RecursionError) as exc:
                return ParsedCall(name, None, f"argument {key!r}: {exc}")
        return ParsedCall(name, arguments)
