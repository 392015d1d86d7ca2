"""Checks on values that come from outside (a user, a request, a tool, a checkpoint) before MLX sees them.

MLX does not bounds-check: a token id past the vocabulary in an embedding lookup or a scatter reads or
writes outside the array (a crash at best, silent corruption at worst). So every token id that enters
from outside goes through :func:`check_token_ids`, text through :func:`check_text`, and parsed JSON
through :func:`check_depth` (deep nesting exhausts the interpreter's stack in whatever walks it next).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from numbers import Integral
from typing import Any

from .errors import InvalidInputError

MAX_NESTING = 64
"""Deepest nesting of lists and objects accepted in messages, tool schemas and call arguments."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_token_ids(ids: Iterable[Any], vocab_size: int, what: str = "token id") -> list[int]:
    """``ids`` as plain ints, each in ``[0, vocab_size)``; otherwise :class:`InvalidInputError`."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise InvalidInputError(f"{what}s must be a sequence of integers, got {type(ids).__name__}")
    out = []
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise InvalidInputError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
        value = int(value)
        if not 0 <= value < vocab_size:
            raise InvalidInputError(f"{what} {value} is outside the vocabulary (0 to {vocab_size - 1})")
        out.append(value)
    return out


def check_text(text: str, what: str = "text") -> str:
    """``text`` unchanged when it is valid Unicode; a lone surrogate (which no UTF-8 tokenizer can encode,
    and which JSON's ``\\ud800`` escapes let through) is refused rather than silently replaced, so that
    what the model sees is exactly what was sent."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise InvalidInputError(f"{what} holds a lone surrogate (U+{ord(match.group()):04X}) at character "
                                f"{match.start()}: it is not valid Unicode")
    return text


def check_depth(value: Any, limit: int = MAX_NESTING, what: str = "value") -> Any:
    """``value`` unchanged when its lists and dicts nest at most ``limit`` deep (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > limit:
                raise InvalidInputError(f"{what} nests deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return value


def check_strings(value: Any, what: str = "value") -> Any:
    """:func:`check_text` on every string (keys included) inside JSON-like ``value``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item, what)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return value
