"""A chat session's state apart from its model and its cache, as one pydantic model.

:meth:`ChatSession.export_state() <mlxchat.session.ChatSession.export_state>` gives a copy of it and
:meth:`~mlxchat.session.ChatSession.import_state` takes one, so that code around a session (saving it,
moving a conversation to another session) never reaches into the session's own fields. Its JSON
(``model_dump(mode="json")``) is what :mod:`mlxchat.persistence` writes beside a saved session's cache: the
fields and layout saved files had before this model existed, so those files load through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, field_serializer, model_validator

from .errors import InvalidInputError
from .generation import GenerationConfig, GenerationReport
from .messages import ChatMessage, ToolCall
from .session_types import DEFAULT_MAX_TOOL_ROUNDS, ContextPolicy
from .tools.schema import ToolSpec

SETTINGS = ("system", "default_config", "tools", "context_policy", "auto_tools", "max_tool_rounds")
"""The fields a session is constructed with (the rest is its conversation so far)."""


class Decision(BaseModel):
    """The user's answer to a call that waits for approval (:meth:`~mlxchat.session.ChatSession.respond_to_approval`),
    kept until the turn goes on and the call is answered."""

    approved: bool
    reason: str | None = None
    arguments: dict[str, Any] | None = None


class SessionState(BaseModel):
    """Everything a session is besides its model and cache: its settings, its conversation, the last reply's
    report and calls, and where automatic tool calling stands. Every field but ``default_config`` defaults to
    a new session's (so files saved before ``auto_tools``, ``max_tool_rounds`` and ``decisions`` were load)."""

    messages: list[ChatMessage] = Field(default_factory=list)
    """The conversation, the system turn first when there is one."""
    system: str | None = None
    default_config: GenerationConfig
    """The session's defaults (the model's, with the session's ``default_config`` over them)."""
    tools: list[ToolSpec] = Field(default_factory=list)
    """The tools offered, as JSON schemas (functions for automatic calls are the session's own, never state)."""
    context_policy: ContextPolicy = "error"
    auto_tools: bool = False
    max_tool_rounds: int = Field(DEFAULT_MAX_TOOL_ROUNDS, ge=0)
    decisions: dict[str, Decision] = Field(default_factory=dict)
    """Approval decisions given while a turn waits, by call id."""
    hidden: int = Field(0, ge=0)
    """How many of the oldest messages after the system turn ``truncate_oldest`` leaves out of the prompt."""
    calls_made: int = Field(0, ge=0)
    """The call-id counter: the next call the model makes is ``call_<calls_made + 1>``."""
    report: GenerationReport | None = None
    """The last reply's report."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """The calls the last reply made, invalid ones included."""

    @model_validator(mode="after")
    def _consistent(self) -> SessionState:
        check_ids(self.messages)
        if self.hidden > len(after_system(self.messages)):
            raise ValueError(f"hidden {self.hidden} is more than the {len(after_system(self.messages))} messages "
                             "after the system turn")
        return self

    @field_serializer("messages")
    def _messages_as_sent(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        return [m.model_dump() for m in messages]  # the OpenAI dicts, unset fields left out

    @field_serializer("tool_calls")
    def _calls_with_status(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        # The wire dump of a call leaves out whether it parsed; the last reply's calls need it back.
        return [{**c.model_dump(), "status": c.status, "raw": c.raw, "error": c.error} for c in calls]


def check_ids(messages: list[ChatMessage]) -> None:
    """Refuse a conversation in which two messages have one id (messages without one yet are skipped)."""
    ids = [m.id for m in messages if m.id is not None]
    if len(set(ids)) != len(ids):
        raise InvalidInputError("the transcript repeats a message id")


def check_tool_answers(messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
    """Refuse a conversation in which a tool result answers no call of the reply before it, or one twice (the model
    would read the result of a call it never made; OpenAI's and Anthropic's APIs refuse it too)."""
    asked: set[str] = set()
    for message in messages:
        fields = message if isinstance(message, dict) else message.model_dump(include={"role", "tool_call_id",
                                                                                         "tool_calls"})
        if fields.get("role") == "assistant":
            asked = {str(call.get("id")) for call in fields.get("tool_calls") or [] if isinstance(call, dict)}
        elif fields.get("role") == "tool":
            call_id = str(fields.get("tool_call_id"))
            if call_id not in asked:
                raise InvalidInputError(f"the tool result {call_id[:64]!r} answers no tool call of the reply before "
                                        "it (or answers one twice)")
            asked.discard(call_id)


def after_system(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation after its system turn (all of it when it has none)."""
    return messages[1:] if messages and messages[0].role == "system" else messages
