"""Reward functions for :func:`mlxchat.train.grpo`: ``reward(prompt, completion) -> float``, where ``prompt`` is
the item given to GRPO (a conversation, or a dict with ``"messages"`` and fields of its own such as
``"answer"``) and ``completion`` the reply's text. The built-ins score what follows the reasoning block."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..tools.parsing import CallBlock
from ..tools.schema import tool_schemas

Reward = Callable[[Any, str], float]
_THINK_END = "</think>"


def final_text(completion: str, reasoning_end: str = _THINK_END) -> str:
    """The reply after its reasoning block (all of it when there is none), stripped."""
    return completion.rsplit(reasoning_end, 1)[-1].strip()


def exact_match(key: str = "answer", pattern: str | None = None, reasoning_end: str = _THINK_END) -> Reward:
    """1.0 when the reply equals ``prompt[key]`` (both stripped), else 0.0. ``pattern``: a regex whose first
    group (or whole match) is the answer in the reply, the last match counting (``r"(-?\\d+)\\.?$"``, say)."""
    compiled = re.compile(pattern) if pattern is not None else None

    def reward(prompt: Any, completion: str) -> float:
        if not isinstance(prompt, Mapping) or key not in prompt:
            raise KeyError(f"exact_match needs prompts that are dicts with an {key!r} field")
        text = final_text(completion, reasoning_end)
        if compiled is not None:
            found = list(compiled.finditer(text))
            if not found:
                return 0.0
            last = found[-1]
            text = last.group(1) if compiled.groups else last.group(0)
        return 1.0 if text.strip() == str(prompt[key]).strip() else 0.0

    reward.__name__ = f"exact_match[{key}]"
    return reward


def json_schema(schema: Mapping[str, Any], reasoning_end: str = _THINK_END) -> Reward:
    """1.0 when the reply (after reasoning) is one JSON value valid under ``schema``, else 0.0."""
    import jsonschema

    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)

    def reward(prompt: Any, completion: str) -> float:
        try:
            value = json.loads(final_text(completion, reasoning_end))
        except ValueError:
            return 0.0
        return 1.0 if validator.is_valid(value) else 0.0

    reward.__name__ = "json_schema"
    return reward


def tool_call(model: Any, tools: Sequence[Any], reasoning_end: str = _THINK_END) -> Reward:
    """1.0 when the reply holds at least one tool call, in ``model``'s family format, and every call names one
    of ``tools`` (functions or JSON tool specs) with arguments valid under that tool's parameter schema."""
    import jsonschema

    specs = tool_schemas(tools)
    if model.tool_parser(specs) is None:
        raise ValueError(f"{model} has no tool-call format to score calls in")
    parameters = {s["function"]["name"]: s["function"].get("parameters") or {} for s in specs}
    validators = {name: jsonschema.validators.validator_for(p)(p) for name, p in parameters.items()}

    def reward(prompt: Any, completion: str) -> float:
        parser = model.tool_parser(specs)
        text = final_text(completion, reasoning_end)
        pieces = parser.feed(text) + parser.finish()
        calls = [call for piece in pieces if isinstance(piece, CallBlock) for call in piece.calls]
        valid = [c for c in calls if c.arguments is not None and c.name in validators
                 and validators[c.name].is_valid(c.arguments)]
        return 1.0 if calls and len(valid) == len(calls) else 0.0

    reward.__name__ = "tool_call"
    return reward
