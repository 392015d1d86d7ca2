"""Chat messages and tool calls, shaped like the OpenAI chat API (``model_dump()`` is the wire dict)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .generation import GenerationReport
from .limits import check_depth, check_strings

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"
    """The arguments as a JSON string (the OpenAI wire format); a dict given here is serialised."""

    @field_validator("arguments", mode="before")
    @classmethod
    def _serialise(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return json.dumps(check_depth(value, what="tool-call arguments"), ensure_ascii=False)
        return value


class ToolCall(BaseModel):
    """A call the model made. ``status`` says whether it parsed; an invalid call keeps its raw text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    status: Literal["ok", "invalid"] = Field("ok", exclude=True)
    raw: str = Field("", exclude=True)
    """The call exactly as the model wrote it, markers included."""
    error: str | None = Field(None, exclude=True)

    @property
    def name(self) -> str:
        return self.function.name

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments as a dict (empty for an invalid call whose arguments did not parse)."""
        try:
            value = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


class ReplyVersion(BaseModel):
    """One of the replies an assistant message has had (a regenerate adds one): its text, reasoning, calls
    and what it cost."""

    content: str | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    report: GenerationReport | None = None


SESSION_FIELDS = ("id", "created_at", "versions", "selected_version")
"""What a session keeps on a message besides the chat format (a template never sees these)."""


class ChatMessage(BaseModel):
    """One turn. ``reasoning_content`` holds an assistant turn's reasoning, apart from its visible text.

    A session gives every message an ``id`` (stable across copies and transcripts) and a ``created_at``
    time. An assistant message it produced holds its ``versions`` (every reply a regenerate gave it,
    ``selected_version`` the one the conversation shows); ``content``, ``reasoning_content`` and
    ``tool_calls`` are the selected version's.

    Content is checked on the way in: valid Unicode only, nesting within :data:`mlxchat.limits.MAX_NESTING`.
    A list of text parts becomes one string (parts joined by newlines, as vLLM joins them), since
    templates render a list as nothing; other parts (images) keep the list. The ``developer`` role of
    OpenAI's newer models is the system role here.
    """

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    id: str | None = None
    created_at: float | None = None
    versions: list[ReplyVersion] | None = None
    selected_version: int | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _developer_is_system(cls, value: Any) -> Any:
        return "system" if value == "developer" else value

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            check_depth(value, what="message content")
            if all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in value):
                return "\n".join(part["text"] for part in value)
        return value

    @model_validator(mode="after")
    def _valid_versions(self) -> ChatMessage:
        if self.versions is not None:
            if self.role != "assistant" or not self.versions:
                raise ValueError("only assistant messages have reply versions, and then at least one")
            if self.selected_version is None or not 0 <= self.selected_version < len(self.versions):
                raise ValueError(f"selected_version must index the {len(self.versions)} versions")
        return self

    @model_validator(mode="after")
    def _valid_text(self) -> ChatMessage:
        check_strings([self.content, self.reasoning_content, self.tool_call_id, self.name,
                       [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or []],
                       check_depth(self.model_extra, what="a message's extra fields")],
                      f"a {self.role} message")
        return self

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The OpenAI message dict (unset fields left out)."""
        kwargs.setdefault("exclude_none", True)
        return super().model_dump(**kwargs)

    def template_dict(self) -> dict[str, Any]:
        """The dict a chat template is given: the chat format without the session's own fields (the
        template layer turns JSON arguments into mappings)."""
        return self.model_dump(exclude=set(SESSION_FIELDS))

    def select(self, index: int) -> None:
        """Show reply version ``index``: its text, reasoning and calls become the message's."""
        if not self.versions or not 0 <= index < len(self.versions):
            raise IndexError(f"no reply version {index} (this message has {len(self.versions or [])})")
        version = self.versions[index]
        self.selected_version = index
        self.content = version.content
        self.reasoning_content = version.thinking
        self.tool_calls = [c.model_copy(deep=True) for c in version.tool_calls] or None

    @classmethod
    def coerce(cls, message: ChatMessage | dict[str, Any]) -> ChatMessage:
        return message if isinstance(message, ChatMessage) else cls.model_validate(message)
