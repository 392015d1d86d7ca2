"""Training examples from chat conversations, and length-bucketed batches of them.

The loss mask marks the tokens the assistant produced. It is found by rendering the conversation
prefix-incrementally through the model's own chat template: for each assistant message, the tokens
between the generation prompt of the conversation before it and the end of its own rendering are what
the model would have generated at that point. Templates rewrite history (Qwen3 drops the reasoning of
turns before the last user message), so a turn is marked only where the full conversation's tokens begin
with that turn's rendering; elsewhere it is context, not a target.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..chat_template import ChatTemplate
from ..limits import check_depth, check_strings


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids, and which of them are targets (the assistant's tokens)."""

    ids: list[int]
    mask: list[bool]
    trained_turns: int = 0
    """Assistant messages whose tokens are marked (those the template renders as generated)."""

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError(f"{len(self.ids)} ids but {len(self.mask)} mask entries")

    @classmethod
    def pretraining(cls, ids: Sequence[int]) -> Example:
        """A plain-text sequence: every token (after the first) is a target."""
        return cls(list(ids), [True] * len(ids))


def encode_chat(
    template: ChatTemplate,
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    stop_ids: Collection[int] = (),
    **template_kwargs: Any,
) -> Example:
    """Tokenize a conversation with its loss mask (see the module docstring).

    ``stop_ids`` (e.g. the id of ``<|im_end|>``): a marked span ends with the last of these in it, so the
    text a template writes after the end-of-turn token (a newline) is not a target.
    """
    check_depth(list(messages), what="a training message")
    check_strings(list(messages), "a training message")  # a lone surrogate no tokenizer encodes

    def encode(upto: int, prompt: bool) -> list[int]:
        return template.encode(messages[:upto], tools=tools, add_generation_prompt=prompt, **template_kwargs)

    full = encode(len(messages), False)
    mask = [False] * len(full)
    turns = 0
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role != "assistant" or index == 0:
            continue
        prompt = encode(index, True)
        turn = full if index == len(messages) - 1 else encode(index + 1, False)
        if turn[: len(prompt)] != prompt or full[: len(turn)] != turn:
            continue
        end = len(turn)
        stops = [i for i in range(len(prompt), len(turn)) if turn[i] in stop_ids]
        if stops:
            end = stops[-1] + 1
        mask[len(prompt) : end] = [True] * (end - len(prompt))
        turns += 1
    return Example(full, mask, turns)


@dataclass(frozen=True)
class Batch:
    """Right-padded ``inputs``/``targets`` ``[B, T]`` and a float ``mask`` of the targets that count."""

    inputs: mx.array
    targets: mx.array
    mask: mx.array
    tokens: int
    """Number of target tokens that count (the mask's sum)."""


def make_batch(examples: Sequence[Example], pad_to: int = 16) -> Batch:
    """Shift each example into (input, target) pairs and right-pad them to a common length (a multiple of
    ``pad_to``, so that few distinct shapes occur). Causal attention never looks right, so padding after a
    sequence changes nothing in it."""
    length = max(len(e.ids) for e in examples) - 1
    length = -(-length // pad_to) * pad_to
    inputs = np.zeros((len(examples), length), dtype=np.int32)
    targets = np.zeros((len(examples), length), dtype=np.int32)
    mask = np.zeros((len(examples), length), dtype=np.float32)
    for row, example in enumerate(examples):
        n = len(example.ids) - 1
        inputs[row, :n] = example.ids[:-1]
        targets[row, :n] = example.ids[1:]
        mask[row, :n] = example.mask[1:]
    return Batch(mx.array(inputs), mx.array(targets), mx.array(mask), int(mask.sum()))


def bucketed_batches(
    examples: Sequence[Example], batch_tokens: int, rng: np.random.Generator, pool: int = 64
) -> Iterator[list[Example]]:
    """One epoch of ``examples`` in random order, grouped into batches of similar length whose padded size
    stays within ``batch_tokens`` (sequence bucketing: little padding, no attention across examples).

    Examples are shuffled, cut into pools of ``pool`` batches' worth, sorted by length within a pool and
    split; the batches are shuffled again so that lengths do not come in order.
    """
    order = rng.permutation(len(examples))
    mean = max(1, int(np.mean([len(e.ids) for e in examples])))
    pool_size = max(1, pool * batch_tokens // mean)
    batches: list[list[Example]] = []
    for start in range(0, len(order), pool_size):
        chunk = sorted((examples[i] for i in order[start : start + pool_size]), key=lambda e: len(e.ids))
        current: list[Example] = []
        for example in chunk:
            longest = max([len(example.ids)] + [len(e.ids) for e in current])
            if current and longest * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(example)
        if current:
            batches.append(current)
    for index in rng.permutation(len(batches)):
        yield batches[index]
