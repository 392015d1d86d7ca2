"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx or
5xx status, or, on Anthropic's routes, as Anthropic does: ``{"type": "error", "error": {"type", "message"}}``.
Messages are ours and say what to change; internal exception text never reaches a client (it goes to the
server log)."""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ContextLengthError, InvalidInputError, MlxchatError, SessionStateError, TemplateError

log = logging.getLogger("mlxchat.server")
M = TypeVar("M", bound=BaseModel)
ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error types for ours (and for statuses no kind of ours maps).
_ANTHROPIC_KINDS = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                    "not_found_error": "not_found_error", "rate_limit_error": "rate_limit_error",
                    "server_busy": "overloaded_error", "server_error": "api_error"}


class ApiError(Exception):
    """A request the server refuses, with the status and the OpenAI error fields to send."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *,
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self, path: str = "") -> dict[str, Any]:
        """The JSON body, shaped for the API that ``path`` belongs to."""
        if path.startswith(ANTHROPIC_PATHS):
            kind = "request_too_large" if self.status == 413 else _ANTHROPIC_KINDS.get(self.kind, "api_error")
            if self.status == 404:
                kind = "not_found_error"
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(exc: ValidationError, prefix: str = "") -> ApiError:
    """A 400 naming each field pydantic refused (without echoing the values sent)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    first = exc.errors(include_url=False, include_input=False)[0]["loc"] if exc.errors() else ()
    param = ".".join(str(p) for p in (prefix, *first) if p != "") or None
    return ApiError(400, "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""),
                    param=param)


def validated(model: type[M], body: dict[str, Any]) -> M:
    """A request body as its pydantic model, or a 400 naming what is wrong (see :func:`invalid`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from None


def request_error(exc: MlxchatError) -> ApiError:
    """The API error for a failure found before any reply text: the request's fault, or ours (500)."""
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, InvalidInputError | TemplateError | SessionStateError):
        return ApiError(400, str(exc))
    log.error("generation failed", exc_info=exc)
    return ApiError(500, "the model failed while generating; see the server log", "server_error")


class RefusalLog:
    """Logs refused requests one line per burst: the first refusal of a kind is logged, later ones within
    ``window`` seconds are only counted and summed up in one line when the next burst starts."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._since: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def refused(self, reason: str, detail: str = "") -> None:
        now = time.monotonic()
        since = self._since.get(reason)
        if since is not None and now - since < self.window:
            self._muted[reason] = self._muted.get(reason, 0) + 1
            return
        muted = self._muted.pop(reason, 0)
        if muted:
            log.warning("refused %d more requests (%s) in the %.0f s before", muted, reason, now - (since or now))
        self._since[reason] = now
        log.warning("refused a request (%s)%s", reason, f": {detail}" if detail else "")


class RateLimitedFilter(logging.Filter):
    """A logging filter that lets one record of each message through per ``window`` seconds (uvicorn logs
    every malformed request it drops; a client must not be able to flood the log)."""

    def __init__(self, window: float = 10.0):
        super().__init__()
        self.window = window
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.msg}{_raised_at(record)}"
        now = time.monotonic()
        if now - self._last.get(key, -self.window) < self.window:
            return False
        self._last[key] = now
        if len(self._last) > 1024:
            self._last.clear()
        return True


def _raised_at(record: logging.LogRecord) -> str:
    """Where a record's exception was raised (its type, file and line): each failure has its own allowance, so a
    flood of one does not hide another's traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:
        return ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f":{type(exc).__name__}" + (f"@{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "")
