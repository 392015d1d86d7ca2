"""Gemma 4's tool-call format, e.g.
``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:2,on:true,more:{...},list:[...]}<tool_call|>``.

Keys are bare, strings sit between ``<|"|>`` delimiters (no escapes inside), numbers, ``true``/``false``
and ``null`` are bare, objects and arrays nest. Several calls follow each other with no separator; the
model then stops with ``<|tool_response>``. The reader also takes what Gemma models are seen to write
besides: JSON- or single-quoted strings, ``none``/``nil``, ``call:NAME(...)`` and a call whose end
marker never came (when the call itself is complete).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from mlxchat.constraints import json_rule, keyword_arguments, raw_string_rule
from mlxchat.plugin import CallBlock, ParsedCall, TaggedCallParser

STRING = '<|"|>'
_NAME = re.compile(r"\s*(?:call\s*:\s*)?([\w.\-]++)(?!\s*:)\s*")  # "call:" itself is no name
_KEY = re.compile(r"[^\s:{}\[\](),<>\"'][^:{}\[\](),<>\"']*")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WORD = re.compile(r"[A-Za-z_]\w*")
_VALUE_END = re.compile(r"\s*(?:[,}\])]|\Z)")
_WORDS = {"true": True, "false": False, "null": None, "none": None, "nil": None}
_CLOSERS = {"{": "}", "(": ")"}


class Malformed(ValueError):
    """The call text does not follow the format (the message says where)."""


class Gemma4ToolParser(TaggedCallParser):
    """Reads Gemma 4 call blocks; see the module docstring for the format."""

    start = "<|tool_call>"
    end = "<tool_call|>"

    def forced_prefix(self, name: str | None = None) -> str | None:
        return f"{self.start}call:" + ("" if name is None else f"{name}{{")

    def call_grammar(self, tools: Sequence[dict[str, Any]], markup: Callable[[str], str]) -> str | None:
        """One call per block: ``call:NAME{key:value,...}``, string values between ``<|"|>`` (raw), the
        others as JSON (which the reader takes too)."""
        quote = markup(STRING)

        def value(schema: Any) -> str:
            raw = raw_string_rule(schema)
            return f"{quote} ({raw}) {quote}" if raw is not None else json_rule(schema)

        lines = [f'call: {markup(self.start)} "call:" tc_fn {markup(self.end)}',
                 "tc_fn: " + " | ".join(f"tc_f{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            rules, body = keyword_arguments(tool, i, value, lambda key: f"{key}:", ",")
            lines += [*rules, f'tc_f{i}: {json.dumps(tool["function"]["name"] + "{")} {body} "}}"']
        return "\n".join(lines) + "\n"

    def parse(self, body: str) -> list[ParsedCall]:
        reader = Reader(body)
        calls: list[ParsedCall] = []
        while not calls or not reader.at_end():
            begin = reader.pos
            try:
                name, members = reader.call()
            except Malformed as exc:
                match = _NAME.match(body, begin)
                calls.append(ParsedCall(match.group(1) if match else "", None, f"malformed tool call: {exc}"))
                break
            calls.append(ParsedCall(name, self._arguments(name, members)))
        return calls

    def finish(self) -> list[str | CallBlock]:
        """An unterminated block still counts when it holds complete calls (the model stopped on
        ``<|tool_response>`` without closing); otherwise it is an invalid call, as for every format."""
        out = super().finish()
        if out and isinstance(out[0], CallBlock):
            calls = self.read(out[0].raw[len(self.start) :])
            if all(c.error is None for c in calls):
                out[0] = CallBlock(out[0].raw, calls)
        return out

    def _arguments(self, name: str, members: dict[str, tuple[Any, str]]) -> dict[str, Any]:
        schema = self.parameters(name)
        return {key: coerce(value, raw, (schema.get(key) or {}).get("type"))
                for key, (value, raw) in members.items()}


def coerce(value: Any, raw: str, kind: str | list[str] | None) -> Any:
    """Fit a top-level argument to its declared JSON-schema type where the model's literal says otherwise:
    a bare number for a string parameter keeps its text (``zip:02139``); a delimited number or boolean
    for a numeric or boolean one becomes that value."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return raw if "string" in kinds and not kinds & {"integer", "number"} else value
    if isinstance(value, str) and "string" not in kinds:
        text = value.strip()
        if kinds & {"integer", "number"} and _NUMBER.fullmatch(text):
            number = float(text)
            return int(number) if "integer" in kinds and number.is_integer() else number
        if "boolean" in kinds and text.lower() in ("true", "false"):
            return text.lower() == "true"
    return value


class Reader:
    """A recursive-descent reader over one call block's text."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def at_end(self) -> bool:
        self._skip()
        return self.pos >= len(self.text)

    def call(self) -> tuple[str, dict[str, tuple[Any, str]]]:
        """``call:NAME{members}``: the name and each member's value with its source text."""
        match = _NAME.match(self.text, self.pos)
        if not match:
            raise Malformed(f"expected call:NAME at {self._here()}")
        self.pos = match.end()
        close = _CLOSERS.get(self.text[self.pos : self.pos + 1])
        if close is None:
            raise Malformed(f"expected '{{' after the function name at {self._here()}")
        self.pos += 1
        return match.group(1), self._members(close)

    def _members(self, close: str) -> dict[str, tuple[Any, str]]:
        members: dict[str, tuple[Any, str]] = {}
        while not self._sees(close):
            key = self._key()
            self._expect(":")
            self._skip()
            begin = self.pos
            members[key] = (self._value(), self.text[begin : self.pos])
            if not self._sees(close):
                self._expect(",")
        self._expect(close)
        return members

    def _key(self) -> str:
        self._skip()
        if self.text.startswith(STRING, self.pos) or self.text.startswith(('"', "'"), self.pos):
            return self._string()
        match = _KEY.match(self.text, self.pos)
        if not match:
            raise Malformed(f"expected a key at {self._here()}")
        self.pos = match.end()
        return match.group().strip()

    def _value(self) -> Any:
        self._skip()
        char = self.text[self.pos : self.pos + 1]
        if self.text.startswith(STRING, self.pos) or char in ('"', "'"):
            return self._string()
        if char == "{":
            self.pos += 1
            return {key: value for key, (value, _) in self._members("}").items()}
        if char == "[":
            self.pos += 1
            items = []
            while not self._sees("]"):
                items.append(self._value())
                if not self._sees("]"):
                    self._expect(",")
            self._expect("]")
            return items
        return self._literal()

    def _string(self) -> str:
        if self.text.startswith(STRING, self.pos):
            end = self.text.find(STRING, self.pos + len(STRING))
            if end < 0:
                raise Malformed(f"unterminated {STRING} string at {self._here()}")
            value, self.pos = self.text[self.pos + len(STRING) : end], end + len(STRING)
            return value
        if self.text[self.pos] == '"':
            try:
                value, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                raise Malformed(f"bad quoted string at {self._here()}: {exc.msg}") from exc
            return value
        end = self.text.find("'", self.pos + 1)
        if end < 0:
            raise Malformed(f"unterminated quoted string at {self._here()}")
        value, self.pos = self.text[self.pos + 1 : end], end + 1
        return value

    def _literal(self) -> Any:
        for pattern in (_NUMBER, _WORD):
            match = pattern.match(self.text, self.pos)
            if match and self._ends_value(match.end()):
                token = match.group()
                if pattern is _NUMBER:
                    self.pos = match.end()
                    return float(token) if any(c in token for c in ".eE") else int(token)
                if token.lower() in _WORDS:
                    self.pos = match.end()
                    return _WORDS[token.lower()]
        raise Malformed(f"expected a value (strings go between {STRING}) at {self._here()}")

    def _ends_value(self, index: int) -> bool:
        """Whether a value may end at ``index``; matched in place, since a copy of the rest for every value
        of a long list would cost its length each time."""
        return _VALUE_END.match(self.text, index) is not None

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _sees(self, token: str) -> bool:
        self._skip()
        return self.text.startswith(token, self.pos)

    def _expect(self, token: str) -> None:
        if not self._sees(token):
            raise Malformed(f"expected {token!r} at {self._here()}")
        self.pos += len(token)

    def _here(self) -> str:
        if self.pos >= len(self.text):
            return "the end"
        return f"offset {self.pos} ({self.text[self.pos : self.pos + 24]!r})"
