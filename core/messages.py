"""Chat messages and tool calls, shaped like the OpenAI chat API (``model_dump()`` is the wire dict)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"
    """The arguments as a JSON string (the OpenAI wire format); a dict given here is serialised."""

    @field_validator("arguments", mode="before")
    @classmethod
    def _serialise(cls, value: Any) -> Any:
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


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


class ChatMessage(BaseModel):
    """One turn. ``reasoning_content`` holds an assistant turn's reasoning, apart from its visible text."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The OpenAI message dict (unset fields left out)."""
        kwargs.setdefault("exclude_none", True)
        return super().model_dump(**kwargs)

    def template_dict(self) -> dict[str, Any]:
        """The dict a chat template sees: tool-call arguments as mappings, as every template expects."""
        data = self.model_dump()
        if self.tool_calls:
            data["tool_calls"] = [
                {**call.model_dump(), "function": {"name": call.name, "arguments": call.arguments}}
                for call in self.tool_calls
            ]
        return data

    @classmethod
    def coerce(cls, message: ChatMessage | dict[str, Any]) -> ChatMessage:
        return message if isinstance(message, ChatMessage) else cls.model_validate(message)
