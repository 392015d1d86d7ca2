"""Helpers for session tests: the stateless reference run, and the exact reuse a cache can offer."""

from __future__ import annotations

from typing import Any

import mlxchat
from mlxchat.prompt_cache import common_prefix_length

# Greedy, short, and with a repetition penalty so that random-weight models do not just repeat one token.
GREEDY = {"max_tokens": 12, "temperature": 0.0, "repetition_penalty": 1.3}


def template_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {"enable_thinking": config["enable_thinking"]} if "enable_thinking" in config else {}


def prompt_ids(model: mlxchat.GenerativeModel, messages: list[mlxchat.ChatMessage], config: dict[str, Any],
               tools: list[Any] | None = None) -> list[int]:
    history = [m.template_dict() for m in messages]
    return model.apply_chat_template(history, tools=tools, **template_kwargs(config))  # type: ignore[return-value]


def stateless_tokens(model: mlxchat.GenerativeModel, messages: list[mlxchat.ChatMessage], config: dict[str, Any],
                     tools: list[Any] | None = None) -> list[int]:
    """Greedy reply tokens of a fresh render of ``messages`` on a fresh cache."""
    run = {k: v for k, v in config.items() if k != "enable_thinking"}
    return model.generate(prompt_ids(model, messages, config, tools), run).tokens


def expected_reuse(session: mlxchat.ChatSession, prompt: list[int]) -> int:
    """How many prompt tokens the session's cache can honestly serve, computed from its state."""
    cache = session.cache
    limit = min(common_prefix_length(cache.tokens, prompt), len(prompt) - 1)
    if all(layer.can_trim_to(limit) for layer in cache.layers):
        return limit
    return max([p for p in cache.snapshot_positions if p <= limit], default=0)


def assert_matches_stateless(model: mlxchat.GenerativeModel, session: mlxchat.ChatSession, result: mlxchat.ChatResult,
                             config: dict[str, Any], tools: list[Any] | None = None) -> None:
    """The reply equals a stateless run over the visible history before it, token for token."""
    history = session.messages[:-1]
    assert result.tokens == stateless_tokens(model, history, config, tools)
