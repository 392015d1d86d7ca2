"""Incremental tool-call parsing. Two kinds of format:

- tagged (:class:`TaggedCallParser`): each call, or list of calls, sits between a start and an end marker;
- trailing (:class:`TrailingCallParser`): the calls open with a marker, or with the reply itself, and run to
  the end of the reply with no closing marker (Llama 3.1's JSON calls).

A parser is fed the visible text as it streams and returns plain text and whole calls; text that might
be the beginning of a start marker is held back, so call markup never leaks into the visible text. A
call that is cut off or does not parse becomes an *invalid* call that keeps its raw text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import InvalidInputError
from ..limits import check_depth, check_strings, check_text
from .schema import ToolSpec, tool_names


@dataclass
class ParsedCall:
    """One call read from a call block: ``arguments`` is ``None`` when they did not parse."""

    name: str
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass
class CallBlock:
    """A call block as it appeared in the output: its raw text and the calls read from it."""

    raw: str
    calls: list[ParsedCall]


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallParser:
    """Base of every tool-call format: :meth:`feed` and :meth:`finish` turn streamed text into plain text
    and call blocks, :meth:`parse` reads the calls of one block. ``start`` opens a call (a reasoning
    splitter also takes it as the end of reasoning)."""

    start: ClassVar[str]

    def __init__(self, tools: Sequence[ToolSpec] = ()):
        self.tools = tool_names(tools)
        self._buffer = ""
        self._in_call = False

    def parse(self, body: str) -> list[ParsedCall]:
        """The calls in one block's text (between its markers)."""
        raise NotImplementedError

    def forced_prefix(self, name: str | None = None) -> str | None:
        """The start of a reply that must call a tool, in this format's markup: far enough that the model
        can only go on with a call (through the function's name when ``name`` is given). A session makes the
        reply start with it (:attr:`~mlxchat.generation.GenerationConfig.reply_prefix`) and parses the
        whole reply as usual. The base gives the opener for any call and cannot name one (``None``)."""
        return self.start if name is None else None

    def call_grammar(self, tools: Sequence[ToolSpec], markup: Callable[[str], str]) -> str | None:
        """Lark rules (llguidance's dialect, see :mod:`mlxchat.constraints`) defining ``call``: one call
        block of this format calling one of ``tools`` with arguments valid against its schema; rule names
        start with ``tc_``. ``markup(text)`` writes a piece of the format's markup (its control token when
        it is one). ``None``: this format gives no grammar (tool calls are then not constrained)."""
        return None

    def feed(self, text: str) -> list[str | CallBlock]:
        """Plain text pieces and completed call blocks, in order."""
        raise NotImplementedError

    def finish(self) -> list[str | CallBlock]:
        """Flush at the end of the reply."""
        raise NotImplementedError

    def parameters(self, name: str) -> dict[str, Any]:
        """JSON-schema ``properties`` of an offered tool (empty when unknown)."""
        spec = self.tools.get(name, {})
        return ((spec.get("function") or {}).get("parameters") or {}).get("properties") or {}

    def checked(self, call: ParsedCall) -> ParsedCall:
        """Mark a call to a tool that was not offered, or with arguments that are not plain JSON, as invalid:
        nested too deep, or holding what JSON cannot carry (NaN or an infinity, which ``json.loads`` and
        Python literals accept; a lone surrogate from a ``\\ud800`` escape, which UTF-8 cannot encode;
        a Python-only value such as bytes or a set). A name holding a lone surrogate is kept as the model escaped
        it, since no file or wire can carry the character."""
        try:
            check_text(call.name, what="the function name")
        except InvalidInputError as exc:
            call.name, call.error = call.name.encode("utf-8", "backslashreplace").decode(), call.error or str(exc)
        if call.error is None and self.tools and call.name not in self.tools:
            call.error = f"unknown function {call.name!r} (offered: {', '.join(self.tools)})"
        if call.error is None and call.arguments is not None:
            try:
                check_strings(check_depth(call.arguments, what="the arguments"), what="the arguments")
                json.dumps(call.arguments, allow_nan=False)
            except InvalidInputError as exc:
                call.arguments, call.error = None, str(exc)
            except (TypeError, ValueError) as exc:
                call.arguments, call.error = None, f"the arguments are not JSON: {exc}"
        return call

    def read(self, body: str) -> list[ParsedCall]:
        """The checked calls of one block. Whatever the model wrote, a failure is an invalid call that keeps
        its raw text, never an exception (deep nesting exhausts a recursive parser's stack, say)."""
        try:
            calls = self.parse(body)
        except Exception as exc:  # noqa: BLE001 - a parser's failure is the call's, not the turn's
            calls = [ParsedCall(guess_name(body), None, f"could not read the call ({type(exc).__name__}: {exc})")]
        return [self.checked(c) for c in calls]

    def _text_before_start(self, out: list[str | CallBlock]) -> bool:
        """Move buffered text up to ``start`` to ``out`` (holding back what may begin it); ``True`` when the
        marker was found and consumed."""
        index = self._buffer.find(self.start)
        if index < 0:
            cut = len(self._buffer) - held_prefix(self._buffer, self.start)
            ready, self._buffer = self._buffer[:cut], self._buffer[cut:]
            if ready:
                out.append(ready)
            return False
        if index:
            out.append(self._buffer[:index])
        self._buffer = self._buffer[index + len(self.start) :]
        return True


class TaggedCallParser(ToolCallParser):
    """Base of the tagged formats: subclasses set ``start``/``end`` and implement :meth:`parse`."""

    end: ClassVar[str]

    def __init__(self, tools: Sequence[ToolSpec] = ()):
        super().__init__(tools)
        self._searched = 0
        """How much of an open call's text is known not to hold ``end``: each token searches only what it
        added, or a long call would cost its length at every token."""

    def feed(self, text: str) -> list[str | CallBlock]:
        self._buffer += text
        out: list[str | CallBlock] = []
        while True:
            if not self._in_call:
                if not self._text_before_start(out):
                    return out
                self._in_call = True
            else:
                index = self._buffer.find(self.end, self._searched)
                if index < 0:
                    self._searched = max(0, len(self._buffer) - len(self.end) + 1)
                    return out
                body, self._searched = self._buffer[:index], 0
                self._buffer = self._buffer[index + len(self.end) :]
                self._in_call = False
                out.append(CallBlock(self.start + body + self.end, self.read(body)))

    def finish(self) -> list[str | CallBlock]:
        """An unterminated call becomes invalid; held text is released."""
        rest, self._buffer, self._searched = self._buffer, "", 0
        if self._in_call:
            self._in_call = False
            name = guess_name(rest)
            return [CallBlock(self.start + rest, [ParsedCall(name, None, "unterminated tool call (output was cut)")])]
        return [rest] if rest else []


class TrailingCallParser(ToolCallParser):
    """Base of the formats whose calls have no closing marker: they open at ``start`` anywhere, or where
    the reply itself begins (after whitespace) with one of ``openers``, and run to the end of the reply.
    The call text is held until :meth:`finish`, which parses it as one block."""

    openers: ClassVar[tuple[str, ...]] = ()
    """Texts that open the calls when a reply starts with them (e.g. ``{`` for a bare JSON call)."""

    def __init__(self, tools: Sequence[ToolSpec] = ()):
        super().__init__(tools)
        self._at_start = True
        self._opened_by = ""

    def feed(self, text: str) -> list[str | CallBlock]:
        self._buffer += text
        out: list[str | CallBlock] = []
        if self._in_call:
            return out
        if self._at_start:
            head = self._buffer.lstrip()
            if not head or any(opener.startswith(head) and opener != head for opener in self.openers):
                return out  # whitespace so far, or what may still become an opener
            self._at_start = False
            if head.startswith(self.openers):
                self._buffer, self._in_call = head, True
                return out
        if self._text_before_start(out):
            self._in_call, self._opened_by = True, self.start
        return out

    def finish(self) -> list[str | CallBlock]:
        rest, in_call, opened_by = self._buffer, self._in_call, self._opened_by
        self._buffer, self._in_call, self._at_start, self._opened_by = "", False, True, ""
        if in_call:
            return [CallBlock(opened_by + rest, self.read(rest))]
        return [rest] if rest else []


def guess_name(body: str) -> str:
    """A best-effort function name from a broken call body (for reporting only). A bare name is only tried
    where a run of name characters begins, and never given back: from every position of a long run (a
    model repeating itself) the search costs the square of its length."""
    match = re.search(r'"name"\s*:\s*"([^"]+)"', body) or re.search(r"<function=([^>\s]+)", body) or re.search(
        r"(?<![\w.\-])([A-Za-z_][\w.\-]*+)\s*+[({]", body
    )
    return match.group(1) if match else ""


class JsonTagsParser(TaggedCallParser):
    """Qwen3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    start = "<tool_call>"
    end = "</tool_call>"

    def forced_prefix(self, name: str | None = None) -> str | None:
        # Through the name but not its closing quote: tokenizers merge that quote with what follows.
        return f'{self.start}\n{{"name": "' + ("" if name is None else json.dumps(name)[1:-1])

    def call_grammar(self, tools: Sequence[ToolSpec], markup: Callable[[str], str]) -> str | None:
        from ..constraints import json_rule, tool_schema

        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "arguments": tool_schema(t)},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        body = options[0] if len(options) == 1 else {"anyOf": options}
        return (f'call: {markup(self.start)} "\\n" tc_body "\\n" {markup(self.end)}\n'
                f"tc_body: {json_rule(body)}\n")

    def parse(self, body: str) -> list[ParsedCall]:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return [ParsedCall(guess_name(body), None, f"invalid JSON: {exc}")]
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return [ParsedCall(guess_name(body), None, 'expected {"name": ..., "arguments": {...}}')]
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return [ParsedCall(obj["name"], None, f"arguments are not JSON: {exc}")]
        if not isinstance(arguments, dict):
            return [ParsedCall(obj["name"], None, "arguments must be a JSON object")]
        return [ParsedCall(obj["name"], arguments)]
