"""Reading a reply as it streams: reasoning apart from visible text, tool calls out of the text.

Two layers, as the parsers in vLLM, llama.cpp and Ollama have them: a reasoning splitter first, then the
tool-call parser on the visible part. A tool-call opener inside reasoning ends the reasoning (Qwen3.5
sometimes skips ``</think>``). Both channels are trimmed the way chat templates trim them when they
re-render the turn, and the stream never emits whitespace the final text will not have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel

from .messages import FunctionCall, ToolCall
from .tools.parsing import CallBlock, ToolCallParser, held_prefix


class TextDelta(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking"] = "thinking"
    text: str


class ToolCallEvent(BaseModel):
    type: Literal["tool_call"] = "tool_call"
    call: ToolCall
    opens_block: bool = True
    """Whether the call is the first of its call block. The calls of a block share its raw text, which a
    reader showing malformed calls as text shows once, with the first."""


ReplyEvent = TextDelta | ThinkingDelta | ToolCallEvent


class ReasoningSplitter:
    """Splits text into ``("thinking" | "text", piece)`` at the reasoning markers, incrementally.

    ``inside`` says the prompt already opened the reasoning (the template prefilled the start marker).
    ``implicit_ends`` are markers that end reasoning without being consumed (they belong to the text).
    """

    def __init__(self, start: str, end: str, inside: bool = False, implicit_ends: Sequence[str] = ()):
        self.start, self.end = start, end
        self.inside = inside
        self.implicit_ends = [m for m in implicit_ends if m]
        self._buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self.inside:
                found = [(self._buffer.find(m), m) for m in [self.end, *self.implicit_ends] if m in self._buffer]
                if not found:
                    keep = max(held_prefix(self._buffer, m) for m in [self.end, *self.implicit_ends])
                    self._emit(out, "thinking", len(self._buffer) - keep)
                    return out
                index, marker = min(found)
                self._emit(out, "thinking", index)
                # the explicit end marker is consumed; an implicit one stays for the text channel
                self._buffer = self._buffer[len(marker) :] if marker == self.end else self._buffer
                self.inside = False
            else:
                index = self._buffer.find(self.start)
                if index < 0:
                    self._emit(out, "text", len(self._buffer) - held_prefix(self._buffer, self.start))
                    return out
                self._emit(out, "text", index)
                self._buffer = self._buffer[len(self.start) :]
                self.inside = True

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, "thinking" if self.inside else "text", len(self._buffer))
        return out

    def _emit(self, out: list[tuple[str, str]], channel: str, size: int) -> None:
        if size > 0:
            out.append((channel, self._buffer[:size]))
        self._buffer = self._buffer[size:]


class Channel:
    """A streamed channel of the reply (visible text or reasoning).

    Whitespace that touches markup (the reasoning block, a tool call) belongs to the markup and is dropped,
    as chat templates drop it when they re-render the turn; other whitespace is the model's and is kept, so
    the stored turn re-renders into the tokens the model produced. Trailing whitespace is held back until
    it is known not to touch markup, so the stream never emits what the final text will not have.
    """

    def __init__(self, after_markup: bool = False):
        self.value = ""
        self._pending = ""
        self._after_markup = after_markup

    def feed(self, text: str) -> str:
        if self._after_markup:
            text = text.lstrip()
            if not text:
                return ""
            self._after_markup = False
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept) :]
        self.value += kept
        return kept

    def markup(self) -> None:
        """Markup comes here: whitespace on either side of it is dropped."""
        self._pending = ""
        self._after_markup = True

    def finish(self) -> str:
        """The reply ended: held-back whitespace was the model's after all."""
        out, self._pending = self._pending, ""
        self.value += out
        return out


class ReplyParser:
    """Turns streamed reply text into events, and keeps the reply's text, reasoning and calls."""

    def __init__(
        self,
        reasoning: tuple[str, str] | None,
        in_reasoning: bool,
        tool_parser: ToolCallParser | None,
        new_call_id: Callable[[], str],
    ):
        implicit = [tool_parser.start] if tool_parser is not None else []
        self._splitter = ReasoningSplitter(*reasoning, in_reasoning, implicit) if reasoning else None
        self._tools = tool_parser
        self._new_call_id = new_call_id
        self._text = Channel()
        self._thinking = Channel(after_markup=True)  # reasoning always sits between its markers
        self._channel = "thinking" if in_reasoning else "text"
        self.saw_reasoning = in_reasoning
        self.calls: list[ToolCall] = []
        self._visible: list[str | CallBlock] = []

    @property
    def text(self) -> str:
        return self._text.value

    @property
    def thinking(self) -> str | None:
        return self._thinking.value if self.saw_reasoning else None

    def content(self, with_calls: bool) -> str:
        """The visible text with the raw markup of malformed call blocks where the model wrote them (so
        the next render shows the model what it wrote), and of the well-formed ones too when
        ``with_calls`` (for templates that do not render ``tool_calls``)."""
        return "".join(item if isinstance(item, str) else item.raw for item in self._visible
                       if isinstance(item, str) or with_calls or not _well_formed(item)).strip()

    def feed(self, text: str) -> list[ReplyEvent]:
        pieces = self._splitter.feed(text) if self._splitter else [("text", text)]
        return self._route(pieces)

    def finish(self) -> list[ReplyEvent]:
        events = self._route(self._splitter.finish()) if self._splitter else []
        if self._tools is not None:
            events += self._visible_events(self._tools.finish())
        if tail := self._text.finish():
            events.append(TextDelta(text=tail))
        return events

    def _route(self, pieces: list[tuple[str, str]]) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for channel, piece in pieces:
            if channel != self._channel:  # a reasoning marker stands between the two channels
                self._channel = channel
                self._text.markup()
                self._thinking.markup()
            if channel == "thinking":
                self.saw_reasoning = True
                if delta := self._thinking.feed(piece):
                    events.append(ThinkingDelta(text=delta))
            elif self._tools is not None:
                events += self._visible_events(self._tools.feed(piece))
            else:
                events += self._visible_events([piece])
        return events

    def _visible_events(self, items: list[str | CallBlock]) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for item in items:
            if isinstance(item, str):
                self._visible.append(item)
                if delta := self._text.feed(item):
                    events.append(TextDelta(text=delta))
                continue
            self._visible.append(item)
            self._text.markup()
            # A block is answered as a whole: one malformed call makes its well-formed neighbours invalid
            # too, so that its raw text, kept in the turn, never repeats a call the history also holds.
            block_error = None if _well_formed(item) else "in a tool-call block with a malformed call"
            for index, parsed in enumerate(item.calls):
                error = parsed.error or block_error
                call = ToolCall(
                    id=self._new_call_id(),
                    function=FunctionCall(name=parsed.name, arguments=json.dumps(parsed.arguments or {},
                                                                                 ensure_ascii=False)),
                    status="ok" if error is None else "invalid",
                    raw=item.raw,
                    error=error,
                )
                self.calls.append(call)
                events.append(ToolCallEvent(call=call, opens_block=index == 0))
        return events


def _well_formed(block: CallBlock) -> bool:
    return all(call.error is None for call in block.calls)
