"""What a turn does next: reply, answer the calls the session runs itself, or stop.

A turn is a series of steps. Without automatic tool calls it is one reply. With them (``auto_tools``) the
session runs the calls it has a Python function for and replies again, until a reply makes no calls, a
call is the application's to answer, or a call waits for the user's approval. A turn that starts on calls
the user has decided runs them first (approved, with any edited arguments) or answers them with the denial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SessionStateError
from .history import History
from .messages import ToolCall
from .session_types import ChatResult, TurnFinish
from .tools.schema import Tool


@dataclass
class ToolWork:
    """A call the session answers by itself: run ``tool`` with ``arguments``, or record ``denial``."""

    call: ToolCall
    tool: Tool
    arguments: dict[str, Any]
    denial: str | None = None


@dataclass
class Generate:
    """Step: reply to the conversation as it stands."""


@dataclass
class Run:
    """Step: answer these calls, then go on."""

    works: list[ToolWork]


@dataclass
class Stop:
    """Step: the turn ends here (``finish`` overrides the last reply's own reason when set)."""

    finish: TurnFinish | None = None


Step = Generate | Run | Stop


def next_step(history: History, result: ChatResult | None, functions: dict[str, Tool], auto: bool) -> Step:
    """What a turn does next, after its last reply's ``result`` (``None``: it has just started)."""
    if result is not None and (not auto or result.finish_reason == "cancelled"):
        return Stop()
    pending = history.pending_calls()
    if not pending:
        return Generate() if history.messages and history.messages[-1].role != "assistant" else Stop()
    works, waiting = [], False
    for call in pending:
        tool, decision = functions.get(call.name), history.state.decisions.get(call.id)
        if tool is None:
            continue  # the application answers it
        if decision is not None:
            denial = None if decision.approved else (decision.reason or "The user denied this call.")
            works.append(ToolWork(call, tool, decision.arguments or call.arguments, denial))
        elif tool.needs_approval:
            waiting = True
        elif auto:
            works.append(ToolWork(call, tool, call.arguments))
    if waiting:
        return Stop("approval_required")  # nothing runs before every waiting call is decided
    return Run(works) if works else Stop("tool_calls")


def check_can_respond(history: History, functions: dict[str, Tool], auto: bool) -> None:
    """A reply needs a user turn or tool results to answer, or calls the session can answer itself."""
    if history.pending_calls():
        if not isinstance(next_step(history, None, functions, auto), Run):
            history.check_no_pending_calls()
    elif not history.messages or history.messages[-1].role not in ("user", "tool"):
        raise SessionStateError("respond() needs the conversation to end with a user turn or a tool result")
