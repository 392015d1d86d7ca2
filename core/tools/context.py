"""What a tool running inside a session can reach: the call it serves, and the user."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SessionStateError
from ..messages import ToolCall

Ask = Callable[[str, ToolCall], str]
"""Puts a tool's question to the user and returns the answer (blocking the tool, not the model)."""


class ToolContext:
    """Given to a tool that declares a parameter annotated ``ToolContext``: which call it is serving, and a
    way to ask the user for input (a :class:`~mlxchat.controller.ChatController` surfaces the question as
    ``state.input_requests`` and resumes the tool with the answer)."""

    def __init__(self, call: ToolCall, ask: Ask | None):
        self.call = call
        self._ask = ask

    @property
    def call_id(self) -> str:
        return self.call.id

    @property
    def name(self) -> str:
        return self.call.name

    def request_input(self, prompt: str) -> str:
        """Ask the user ``prompt`` and wait for the answer."""
        if self._ask is None:
            raise SessionStateError("this tool asks for input, but no one can answer: run it under a ChatController "
                                    "or set the session's input_handler")
        return self._ask(prompt, self.call)
