"""Llama 3.1's JSON tool calls. Offered tools, the model answers a call with the reply itself:
``{"name": "get_weather", "parameters": {"city": "Paris"}}`` and then ``<|eot_id|>``, with no closing
marker (or after ``<|python_tag|>``, as it does when the system prompt says ``Environment: ipython``).
Llama 3.2 and 3.3 sometimes write several calls separated by ``;``; ``arguments`` is read as well as
``parameters``."""

from __future__ import annotations

import json
from typing import Any

from mlxchat.plugin import ParsedCall, TrailingCallParser, guess_name

_SEPARATORS = " \t\r\n;"


class Llama31JsonParser(TrailingCallParser):
    start = "<|python_tag|>"
    openers = ("{",)

    def parse(self, body: str) -> list[ParsedCall]:
        decoder, position = json.JSONDecoder(), 0
        calls: list[ParsedCall] = []
        while True:
            while position < len(body) and body[position] in _SEPARATORS:
                position += 1
            if position == len(body):
                break
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError as exc:
                return [*calls, ParsedCall(guess_name(body[position:]), None, f"invalid JSON: {exc.msg}")]
            calls.append(self._call(value))
        return calls or [ParsedCall("", None, "an empty tool call")]

    def _call(self, value: Any) -> ParsedCall:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ParsedCall("", None, 'expected {"name": ..., "parameters": {...}}')
        arguments = value.get("parameters", value.get("arguments", {}))
        if isinstance(arguments, str):  # some fine-tunes write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ParsedCall(value["name"], None, f"parameters are not JSON: {exc.msg}")
        if not isinstance(arguments, dict):
            return ParsedCall(value["name"], None, "parameters must be a JSON object")
        return ParsedCall(value["name"], arguments)
