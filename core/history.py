"""A session's conversation and the edits that change what it is.

The messages carry ids and times (kept from a transcript, made for new ones), an assistant message every
reply a regenerate gave it, and tool results in the order of their calls. An edit that cuts the history
back (a version chosen, a checkpoint, a rewind) also drops what referred to the old end: the last reply's
calls, approval decisions, and a hidden count past the new end. None of this touches the cache: the next
turn reuses whatever still agrees with it (:mod:`mlxchat.session`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from .errors import InvalidInputError, SessionStateError
from .messages import ChatMessage, FunctionCall, ReplyVersion, ToolCall
from .session_state import Decision, SessionState, after_system, check_ids, check_tool_answers


class History:
    """The conversation in a :class:`~mlxchat.session_state.SessionState`, edited in place; ``new_id`` and
    ``clock`` give new messages their ids and times."""

    def __init__(self, state: SessionState, new_id: Callable[[], str], clock: Callable[[], float]):
        self.state = state
        self._new_id = new_id
        self._clock = clock

    @property
    def messages(self) -> list[ChatMessage]:
        return self.state.messages

    def stamped(self, message: ChatMessage) -> ChatMessage:
        """``message`` with an id and a time (kept if it has them)."""
        if message.id is None:
            message.id = self._new_id()
        if message.created_at is None:
            message.created_at = self._clock()
        return message

    def rest(self) -> list[ChatMessage]:
        return after_system(self.messages)

    def take_over(self, state: SessionState) -> None:
        """Take ``state`` over (a copy no one else holds): messages without an id or a time get them, and the
        call counter never falls behind the calls the messages hold."""
        check_ids([self.stamped(m) for m in state.messages])
        state.calls_made = max(state.calls_made, _numbered_calls(state.messages))
        self.state = state

    def prime(self, messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
        """Load a transcript into a conversation that has not spoken yet (see
        :meth:`~mlxchat.session.ChatSession.prime_history`)."""
        if any(m.role != "system" for m in self.messages):
            raise SessionStateError("prime_history() is for a session that has not spoken yet; reset() it first")
        primed = [self.stamped(ChatMessage.coerce(m).model_copy(deep=True)) for m in messages]
        system = self.state.system
        if system and not (primed and primed[0].role == "system"):
            primed.insert(0, self.messages[0] if self.messages else self.stamped(
                ChatMessage(role="system", content=system)))
        check_ids(primed)
        check_tool_answers(primed)
        self.state.messages = primed
        self.state.hidden = 0
        self.state.calls_made = _numbered_calls(primed)

    # -- a turn's own changes -------------------------------------------------------------------------

    def add(self, message: ChatMessage) -> None:
        self.messages.append(self.stamped(message))

    def pop_reply(self) -> ChatMessage:
        """Take the last reply off to reply again (a regenerate); it comes back as a version of the new one."""
        self.check_ends_with_reply()
        self.state.tool_calls = []
        return self.messages.pop()

    def add_reply(self, version: ReplyVersion, calls: list[ToolCall], replaces: ChatMessage | None) -> None:
        """Add a reply (as the newest version of ``replaces``, for a regenerate) and make it the last one."""
        if replaces is not None:
            message = replaces
            message.versions = (message.versions or [_version_of(message)]) + [version]
        else:
            message = self.stamped(ChatMessage(role="assistant", versions=[version], selected_version=0))
        message.select(len(message.versions or []) - 1)
        self.messages.append(message)
        self.state.report = version.report
        self.state.tool_calls = calls

    def take_back(self, start: int, replaced: ChatMessage | None) -> None:
        """Undo what a turn that started at message ``start`` did (``replaced``: the reply it took off)."""
        del self.messages[start:]
        if replaced is not None:
            self.messages.append(replaced)

    def new_call_id(self) -> str:
        self.state.calls_made += 1
        return f"call_{self.state.calls_made}"

    # -- tool calls -----------------------------------------------------------------------------------

    def pending_calls(self) -> list[ToolCall]:
        """The last reply's calls that no tool result answers yet."""
        for index in range(len(self.messages) - 1, -1, -1):
            message = self.messages[index]
            if message.role == "assistant":
                answered = {m.tool_call_id for m in self.messages[index + 1 :] if m.role == "tool"}
                return [c for c in message.tool_calls or [] if c.id not in answered]
            if message.role == "user":
                return []
        return []

    def answer(self, call: ToolCall, content: str, name: str = "") -> None:
        """Record ``content`` as the result of ``call``, after the results of the calls made before it
        (templates that match results to calls by position need that, whatever order they come in)."""
        self.state.decisions.pop(call.id, None)
        result = self.stamped(ChatMessage(role="tool", tool_call_id=call.id, name=name or call.name, content=content))
        index = max(i for i, m in enumerate(self.messages) if m.role == "assistant")
        order = [c.id for c in self.messages[index].tool_calls or []]
        position = index + 1
        while (position < len(self.messages) and self.messages[position].role == "tool"
               and order.index(self.messages[position].tool_call_id or "") < order.index(call.id)):
            position += 1
        self.messages.insert(position, result)

    def decide(self, call_id: str, decision: Decision) -> None:
        """Keep the user's approval decision on a pending call; an approval's ``arguments`` become the call's, in
        the history and in the version the call belongs to."""
        if decision.arguments is not None:
            message = next(m for m in reversed(self.messages) if m.role == "assistant")
            text = json.dumps(decision.arguments, ensure_ascii=False)
            versions = message.versions or []
            selected = versions[message.selected_version or 0].tool_calls if versions else []
            for call in (*(message.tool_calls or []), *selected):
                if call.id == call_id:
                    call.function = FunctionCall(name=call.name, arguments=text)
        self.state.decisions[call_id] = decision

    def check_no_pending_calls(self) -> None:
        pending = self.pending_calls()
        if pending:
            raise SessionStateError(
                f"the last reply's tool calls {', '.join(c.id for c in pending)} are unanswered: answer each "
                "with add_tool_result() (or respond_to_approval()) and then respond()"
            )

    def check_ends_with_reply(self) -> None:
        if not self.messages or self.messages[-1].role != "assistant":
            raise SessionStateError("regenerate() needs the conversation to end with a reply")

    # -- edits ----------------------------------------------------------------------------------------

    def select_version(self, message_id: str, index: int) -> None:
        position = self._position(message_id)
        message = self.messages[position]
        if message.role != "assistant" or not message.versions:
            raise SessionStateError(f"message {message_id!r} has no reply versions")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(message.versions):
            raise InvalidInputError(f"no reply version {index!r} (message {message_id!r} has "
                                    f"{len(message.versions)})")
        message.select(index)
        self._cut(position + 1)

    def keep_through(self, message_id: str) -> None:
        self._cut(self._position(message_id) + 1)

    def rewind(self, keep: int) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= len(self.messages):
            raise InvalidInputError(f"keep must be an integer from 0 to {len(self.messages)}, got {keep!r}")
        self._cut(keep)

    def set_system(self, system: str | None) -> None:
        self.state.system = system
        head = [self.stamped(ChatMessage(role="system", content=system))] if system else []
        self.state.messages = head + self.rest()

    def reset(self, keep_system: bool) -> None:
        self.state.messages = [m for m in self.messages[:1] if m.role == "system"] if keep_system else []
        self.state.hidden = 0
        self.state.report = None
        self.state.tool_calls = []
        self.state.decisions = {}

    def _position(self, message_id: str) -> int:
        for index, message in enumerate(self.messages):
            if message.id == message_id:
                return index
        raise SessionStateError(f"no message with id {message_id!r} in this conversation")

    def _cut(self, keep: int) -> None:
        """Keep the first ``keep`` messages; what referred to the old end goes."""
        del self.messages[keep:]
        self.state.hidden = min(self.state.hidden, len(self.rest()))
        self.state.tool_calls = []
        self.state.decisions = {}


def _numbered_calls(messages: list[ChatMessage]) -> int:
    """The highest ``call_<n>`` id the messages' calls have (0 when none): where a call counter goes on."""
    return max((int(m.group(1)) for message in messages for c in message.tool_calls or []
                if (m := re.fullmatch(r"call_(\d+)", c.id))), default=0)


def _version_of(message: ChatMessage) -> ReplyVersion:
    """The reply a message shows, as a version (for a message that has no versions yet: a primed one)."""
    return ReplyVersion(content=message.content if isinstance(message.content, str) else None,
                        thinking=message.reasoning_content, tool_calls=message.tool_calls or [])
