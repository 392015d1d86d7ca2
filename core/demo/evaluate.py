"""Held-out accuracy of a chat model on the demo world, by greedy generation through mlxchat.

    python -m mlxchat.demo.evaluate [MODEL_FOLDER] [--seed 0] [--limit N]

Metrics (each a fraction of its held-out items):

- ``capitals``: the answer names the right capital (one unseen phrasing per country).
- ``arithmetic``: the last number of the answer is the result (300 unseen two-digit problems).
- ``conversions``: the last number of the answer is the converted amount (60 unseen conversions).
- ``tool_calls``: exactly one call, valid JSON, the right function and ``{"city": ...}`` (unseen cities).
- ``two_calls``: two calls in the one turn, both valid and right (unseen cities).
- ``tool_answers``: the answer written from given tool results quotes every value and city in them.
- ``dont_know``: an honest "I don't know" outside the world (unseen questions, invented countries).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..generation import GenerationConfig
from ..loading import load_model
from ..model import GenerativeModel
from .data import DemoData, EvalItem
from .world import DEMO_TOOLS

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Reply:
    """A generated reply split the way a chat session splits it."""

    thinking: str
    content: str
    calls: list[dict[str, Any] | None]
    """Each ``<tool_call>`` body parsed as JSON (``None`` where it is not valid JSON)."""

    @classmethod
    def parse(cls, text: str) -> Reply:
        thinking = ""
        if "</think>" in text:
            thinking, text = text.split("</think>", 1)
            thinking = thinking.replace("<think>", "").strip()
        calls: list[dict[str, Any] | None] = []
        for body in _CALL.findall(text):
            try:
                value = json.loads(body)
                calls.append(value if isinstance(value, dict) else None)
            except json.JSONDecodeError:
                calls.append(None)
        return cls(thinking, _CALL.sub("", text).strip(), calls)


def _last_number(text: str) -> int | None:
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


def _calls_right(reply: Reply, expected: list[tuple[str, str]]) -> bool:
    made = [(c.get("name"), c.get("arguments")) for c in reply.calls if c is not None]
    wanted = [(name, {"city": city}) for name, city in expected]
    return len(reply.calls) == len(expected) and sorted(map(repr, made)) == sorted(map(repr, wanted))


CHECKS: dict[str, Callable[[Reply, dict[str, Any]], bool]] = {
    "capitals": lambda r, e: e["answer"] in r.content,
    "arithmetic": lambda r, e: _last_number(r.content) == e["answer"],
    "conversions": lambda r, e: _last_number(r.content) == e["answer"],
    "tool_calls": lambda r, e: _calls_right(r, e["calls"]),
    "two_calls": lambda r, e: _calls_right(r, e["calls"]),
    "tool_answers": lambda r, e: not r.calls and all(q in r.content for q in e["quotes"])
    and all(city in r.content for _, city in e["calls"]),
    "dont_know": lambda r, e: "don't know" in r.content,
}


def reply_to(model: GenerativeModel, item: EvalItem, max_tokens: int = 200) -> str:
    prompt = model.apply_chat_template(item.messages, tools=list(DEMO_TOOLS) if item.tools else None)
    return model.generate(prompt, GenerationConfig(temperature=0.0, max_tokens=max_tokens)).text


def evaluate(
    model: GenerativeModel,
    seed: int = 0,
    limit: int | None = None,
    on_failure: Callable[[str, EvalItem, str], None] | None = None,
) -> dict[str, float]:
    """Accuracy per metric on the held-out items of ``seed`` (the first ``limit`` of each, if given)."""
    scores = {}
    for metric, items in DemoData(seed).evaluation().items():
        chosen = items[:limit] if limit else items
        right = 0
        for item in chosen:
            text = reply_to(model, item)
            if CHECKS[metric](Reply.parse(text), item.expected):
                right += 1
            elif on_failure is not None:
                on_failure(metric, item, text)
        scores[metric] = right / len(chosen)
    return scores


def main(argv: list[str] | None = None) -> int:
    from . import default_model_path

    parser = argparse.ArgumentParser(prog="python -m mlxchat.demo.evaluate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint folder (default: the shipped demo model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split the model was trained on")
    parser.add_argument("--limit", type=int, default=None, help="items per metric (default: all)")
    parser.add_argument("--show-failures", action="store_true", help="print each wrong reply")
    args = parser.parse_args(argv)
    model = load_model(Path(args.model) if args.model else default_model_path())

    def show(metric: str, item: EvalItem, text: str) -> None:
        print(f"[{metric}] {item.messages[-1]['content']!r}\n  -> {text!r}", file=sys.stderr)

    start = time.perf_counter()
    scores = evaluate(model, args.seed, args.limit, show if args.show_failures else None)
    for metric, value in scores.items():
        print(f"{metric:14s} {100 * value:6.1f}%")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
