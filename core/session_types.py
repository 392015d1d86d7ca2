"""What a chat session's turns give back and what they need: the result of a turn, the events a stream
yields, how a turn may end, and the model a session runs on (a protocol, so a plugin's model can serve)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from .constraints import Constraint
from .generation import GenerationChunk, GenerationConfig, GenerationReport
from .images import ImageSource, ProcessedImage
from .messages import ToolCall
from .multimodal import ImageTokens, MultimodalPrompt
from .prompt_cache import PromptCache
from .reply import TextDelta, ThinkingDelta, ToolCallEvent
from .tools.parsing import ToolCallParser
from .tools.schema import ToolSpec
from .worker import Cancelled, Together, Worker

ContextPolicy = Literal["error", "truncate_oldest"]
TurnFinish = Literal["stop", "length", "tool_calls", "cancelled", "max_tool_rounds", "approval_required"]
"""How a turn ended: a generation's own reasons, or where automatic tool calling stopped (too many
rounds; a call waiting for the user's approval)."""
DEFAULT_MAX_TOOL_ROUNDS = 8


class ChatResult(BaseModel):
    """One reply: visible text, reasoning (``None`` when the model did not reason), calls, and costs. With
    automatic tool calls it is the turn's last reply (the earlier ones and the tool results are in the
    history)."""

    text: str
    """The visible text as streamed, the model's whitespace kept (before a stop string too, as OpenAI's and
    Anthropic's APIs return it). The stored assistant turn holds the same text without whitespace at its
    two ends: there it touches the turn's markup, which chat templates re-render without it."""
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: TurnFinish
    report: GenerationReport
    tokens: list[int] = Field(default_factory=list)
    """The reply's token ids (the stop token excluded)."""
    parsed: Any = None
    """With a JSON ``response_format``: the reply as an instance of the pydantic model given, or as parsed
    JSON; ``None`` when the reply was cut short (``finish_reason="length"``: :attr:`text` keeps it), made
    tool calls, or had no JSON format."""


class ToolResultEvent(BaseModel):
    """A tool the session ran by itself (or a call the user denied), and the result the model will see."""

    type: Literal["tool_result"] = "tool_result"
    call_id: str
    name: str
    content: str


class Done(BaseModel):
    """The last event of a stream, with the turn's result (already committed to the session)."""

    type: Literal["done"] = "done"
    result: ChatResult


StreamEvent = TextDelta | ThinkingDelta | ToolCallEvent | ToolResultEvent | Done


@runtime_checkable
class SessionCapableModel(Protocol):
    """What a :class:`ChatSession` needs from a model (``GenerativeModel`` is one; so can a plugin's)."""

    defaults: GenerationConfig
    worker: Worker
    context_length: int

    @property
    def supports_tools(self) -> bool: ...

    @property
    def reasoning_markers(self) -> tuple[str, str] | None: ...

    @property
    def renders_tool_calls(self) -> bool: ...

    @property
    def supports_images(self) -> bool: ...

    @property
    def image_tokens(self) -> ImageTokens: ...

    def process_image(self, image: ImageSource) -> ProcessedImage: ...

    def render_prompt(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                      add_generation_prompt: bool = True, **template_kwargs: Any) -> tuple[str, list[int]]: ...

    def render_text(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str: ...

    def tool_parser(self, tools: Sequence[ToolSpec]) -> ToolCallParser | None: ...

    def make_prompt_cache(self, max_snapshots: int = ..., *, kv_bits: int | None | Literal["model"] = "model",
                          kv_group_size: int | None = None) -> PromptCache: ...

    def call_markup(self, text: str) -> str: ...

    @property
    def token_table(self) -> Any: ...

    def run_generation(self, prompt: Sequence[int] | MultimodalPrompt, cache: PromptCache, config: GenerationConfig,
                       cancel: Cancelled, snapshot_at: Sequence[int] = (),
                       constraint: Constraint | None = None) -> Iterator[GenerationChunk | Together]:
        ...
