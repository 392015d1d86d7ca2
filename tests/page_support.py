"""What the chat page's tests share: a demo model of their own (its defaults change for long replies, its
generation can be paced or scripted), the conversation API read through its server-sent events, and the
prompt a conversation renders (to know exactly how much of it a turn may take from the cache)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

import mlxchat
from mlxchat.demo import default_model_path
from mlxchat.generation import GenerationChunk
from mlxchat.messages import ChatMessage
from mlxchat.registry import registry

State = dict[str, Any]


def page_model() -> mlxchat.GenerativeModel:
    """The demo model, loaded apart from the shared one (tests switch its replies to long ones)."""
    return mlxchat.load_model(default_model_path(), dtype="float32")


@contextmanager
def long_replies(model: mlxchat.GenerativeModel, tokens: int = 3000) -> Iterator[None]:
    """Replies that run to ``tokens`` (no end of turn), long enough to queue behind and to stop. They are
    plain text: a greedy reply that drifted into tool calls would end waiting for an approval, so the token that
    opens a call in the model's tool format is banned with the end of turn."""
    before = model.defaults
    calls = model.architecture.chat.tool_format
    call = None if calls is None else model.tokenizer.token_id(registry().tool_parsers()[calls].start)
    banned = [*model.eos_ids, *([] if call is None else [call])]
    model.defaults = before.merged({"max_tokens": tokens, "logit_bias": {t: -100.0 for t in banned}})
    try:
        yield
    finally:
        model.defaults = before


@contextmanager
def slow_replies(model: mlxchat.GenerativeModel, seconds_per_token: float = 0.02) -> Iterator[None]:
    """Long replies that take their time (each token waits on the model's worker), so that a browser test
    can queue, look and stop while one streams; nothing is asserted on the time."""
    run = model.run_generation

    def paced(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for item in run(*args, **kwargs):
            if isinstance(item, GenerationChunk) and item.text:
                time.sleep(seconds_per_token)
            yield item

    with long_replies(model):
        model.run_generation = paced  # type: ignore[method-assign]
        try:
            yield
        finally:
            del model.run_generation


@contextmanager
def scripted_replies(model: mlxchat.GenerativeModel, text: str) -> Iterator[threading.Event]:
    """Replies that say ``text`` instead of what the model writes (a few characters a token; the model runs
    as many tokens as that takes, and more), and hold their last token until the event yielded is set: a
    test looks at the whole reply while it still streams, then lets it end."""
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    release = threading.Event()
    run = model.run_generation

    def scripted(*args: Any, **kwargs: Any) -> Iterator[Any]:
        left = list(pieces)
        for item in run(*args, **kwargs):
            if isinstance(item, GenerationChunk):
                if item.report is None:
                    item = item.model_copy(update={"text": left.pop(0) if left else ""})
                else:  # the last one
                    release.wait()
                    item = item.model_copy(update={"text": "".join(left)})
            yield item

    with long_replies(model, tokens=len(pieces) + 8):
        model.run_generation = scripted  # type: ignore[method-assign]
        try:
            yield release
        finally:
            release.set()
            del model.run_generation


def events(client: httpx.Client, conversation: str) -> Iterator[State]:
    """The conversation's states as its event stream sends them (messages carried over progress events)."""
    messages: list[dict[str, Any]] = []
    with client.stream("GET", f"/api/conversations/{conversation}/events", timeout=120) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        kind = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                state = json.loads(line[6:])
                if kind == "state":
                    messages = state["messages"]
                else:
                    assert "messages" not in state
                    state["messages"] = messages
                yield state


def until(client: httpx.Client, conversation: str, check: Callable[[State], bool]) -> State:
    """The first state (now or streamed later) that passes ``check``."""
    for state in events(client, conversation):
        if check(state):
            return state
    raise AssertionError("the event stream ended")


def idle(state: State) -> bool:
    return state["status"] == "idle" and not state["queue"]


def report(message: dict[str, Any]) -> dict[str, Any]:
    """The report of an assistant message's shown version."""
    return message["versions"][message["selected_version"]]["report"]


def prompt(model: mlxchat.GenerativeModel, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """The prompt a conversation's session renders for the reply after ``messages`` (as the API sends them)."""
    return model.render_prompt([ChatMessage.model_validate(m).template_dict() for m in messages], tools=tools)[1]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
