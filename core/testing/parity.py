"""Parity with an oracle: a fixture folder (a tiny checkpoint and the ``reference.npz`` its builder stored,
see :mod:`mlxchat.testing.builders`) and the model mlxchat loads from it must agree.

:func:`assert_parity` checks, in float32 and within ``tolerance``:

- the full forward's logits;
- the logits of the same tokens fed through the layer caches in uneven chunks (prefill chunks crossing
  any window or chunk size, then single tokens);
- cached decoding step by step after the prompt, against the oracle's own cached run when it stored one;
- greedy continuation of the prompt, token for token, both through the model's caches directly and
  through the public ``generate`` (which stops at an end-of-turn token; the oracle did not).

Every failing check is reported, each with where the error is largest, so a wrong layer shows as a
readable pattern rather than one number.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..generation import decode_tokens
from ..model import GenerativeModel
from ..prompt_cache import PromptCache, last_logits_of
from ..sampling import make_sampler
from .fixtures import fixture_info, load_fixture

TOLERANCE = 1e-4
"""Max abs logit error accepted in float32 (logits of a few units: a wrong layer shows far above it)."""
CHUNKINGS: tuple[tuple[int, ...], ...] = ((24,), (5, 11, 1, 7, 13), (3, 14, 2, 9, 1, 5), (20, 17, 3), (1, 1, 2, 30))
"""Prefill chunk sizes tried by default (the rest of the sequence follows one token at a time)."""
PREFILL_STEP = 5
"""Chunk size of the greedy run's prefill: the prompt spans several chunks."""


def reference(folder: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The oracle's outputs stored in a fixture folder."""
    return dict(np.load(Path(folder) / "reference.npz"))


def full_logits(model: GenerativeModel, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Float32 logits ``[len, vocab]`` of one cache-free forward pass."""
    return np.array(model.logits([int(t) for t in ids]))


def chunked_logits(model: GenerativeModel, ids: Sequence[int] | np.ndarray, chunks: Sequence[int]) -> np.ndarray:
    """Logits of ``ids`` fed through fresh layer caches in chunks of the given sizes, then one token at a time."""
    tokens = [int(t) for t in ids]
    sizes = [*chunks, *[1] * (len(tokens) - sum(chunks))]

    def run() -> np.ndarray:
        cache = model.module.make_cache()
        out, position = [], 0
        for size in sizes:
            step = mx.array(tokens[position : position + size])[None]
            logits = model.module(step, cache)[0].astype(mx.float32)
            mx.eval(logits)
            out.append(np.array(logits))
            position += size
        return np.concatenate(out)

    return model.worker.run(run)


def prefill_and_decode(model: GenerativeModel, prompt: Sequence[int], cache: PromptCache, count: int, *,
                       snapshot_at: Sequence[int] = (), step: int = PREFILL_STEP) -> tuple[list[int], int]:
    """``count`` greedy tokens from the generation loop itself (:meth:`PromptCache.prefill`, then
    :func:`~mlxchat.generation.decode_tokens`) through ``cache``, never stopping early; and how many prompt
    tokens the cache served. Call it on the model's worker (``model.worker.run``)."""
    reused, pending = cache.prefill(model.module, list(prompt), snapshot_at=snapshot_at, step=step)
    return list(decode_tokens(model.module, cache, pending, make_sampler(0.0), count)), reused


def greedy_tokens(model: GenerativeModel, prompt: Sequence[int], count: int,
                  prefill_step: int = PREFILL_STEP) -> list[int]:
    """``count`` greedy tokens after ``prompt`` on a fresh cache (prefill in chunks of ``prefill_step``, the
    last chunk together with the first sampled token), never stopping early."""
    return model.worker.run(lambda: prefill_and_decode(model, prompt, model.make_prompt_cache(), count,
                                                       step=prefill_step)[0])


def max_error(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, int]:
    """The largest absolute difference and the position (row) where it occurs."""
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    row = int(np.unravel_index(int(np.argmax(diff)), diff.shape)[0])
    return float(diff.max()), row


def assert_close(ours: np.ndarray, theirs: np.ndarray, tolerance: float = TOLERANCE) -> None:
    err, row = max_error(ours, theirs)
    assert err <= tolerance, f"max abs error {err:.2e} > {tolerance:.0e} (largest at position {row})"


def assert_parity(
    folder: str | os.PathLike[str],
    *,
    model: GenerativeModel | None = None,
    tolerance: float | None = None,
    chunkings: Sequence[Sequence[int]] = CHUNKINGS,
) -> None:
    """Check the model loaded from ``folder`` (or ``model``) against the reference stored there; raise an
    ``AssertionError`` listing every check that failed. ``tolerance``: by default the fixture's own
    (``fixture.json``, say for an oracle that sums in another order), else :data:`TOLERANCE`."""
    folder = Path(folder)
    if tolerance is None:
        tolerance = float(fixture_info(folder).get("tolerance", TOLERANCE))
    model = model if model is not None else load_fixture(folder)
    ref = reference(folder)
    ids = ref["input_ids"]
    problems: list[str] = []

    def check(label: str, ours: np.ndarray, theirs: np.ndarray) -> None:
        err, row = max_error(ours, theirs)
        if err > tolerance:
            problems.append(f"{label}: max abs error {err:.2e} (largest at position {row} of {len(theirs)})")

    if np.abs(ref["logits"]).max() <= 2:
        problems.append("the reference logits stay within +-2: a 1e-4 match would mean little (perturb the "
                        "fixture's weights, see mlxchat.testing.builders.perturb)")
    check("full forward", full_logits(model, ids), ref["logits"])
    # Where transformers' own cached run differs from its full forward (dynamic NTK RoPE rescales with the
    # length seen so far), cached logits are compared with that cached run only.
    stepwise = ref.get("stepwise_logits")
    consistent = stepwise is None or max_error(stepwise, ref["logits"])[0] <= tolerance
    if consistent:
        for chunks in chunkings:
            if sum(chunks) <= len(ids):
                check(f"prefill in chunks {list(chunks)}, then one token at a time",
                      chunked_logits(model, ids, chunks), ref["logits"])
    if stepwise is not None:
        prompt_len = int(ref["prompt_len"])
        check(f"prompt of {prompt_len} in one chunk, then one token at a time (the oracle's cached run)",
              chunked_logits(model, ids, [prompt_len]), stepwise)
    if "greedy" in ref:
        problems += _greedy_problems(model, ref)
    if problems:
        where = f"{folder} ({model.architecture.name} plugin, {type(model.module).__name__})"
        raise AssertionError(f"{where} does not match its reference (tolerance {tolerance:.0e}):\n  "
                             + "\n  ".join(problems))


def _greedy_problems(model: GenerativeModel, ref: dict[str, Any]) -> list[str]:
    prompt = ref["input_ids"][: int(ref["prompt_len"])].tolist()
    expected = ref["greedy"].tolist()
    problems = []
    ours = greedy_tokens(model, prompt, len(expected))
    if ours != expected:
        problems.append(f"greedy continuation through the caches: {_first_difference(ours, expected)}")
    config = {"max_tokens": len(expected), "temperature": 0.0, "repetition_penalty": 1.0,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}}
    result = model.generate(prompt, config)
    # generate stops at an end-of-turn token, which the reference run did not: compare up to there.
    stopped_early = result.finish_reason == "stop" and len(result.tokens) < len(expected)
    if result.tokens != expected[: len(result.tokens)]:
        problems.append(f"greedy continuation through generate(): {_first_difference(result.tokens, expected)}")
    elif stopped_early and expected[len(result.tokens)] not in model.eos_ids:
        problems.append(f"generate() stopped after {len(result.tokens)} tokens, where the reference goes on "
                        f"with {expected[len(result.tokens)]}, not an end-of-turn token")
    return problems


def _first_difference(ours: list[int], expected: list[int]) -> str:
    first = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b)
    return f"token {first} is {ours[first]}, the reference chose {expected[first]} (after {ours[:first]})"


def batched_decoding_problems(model: GenerativeModel, prompts: Sequence[Sequence[int]], steps: int = 6,
                              tolerance: float = TOLERANCE) -> list[str]:
    """Decode ``prompts`` together (one forward over all rows a step, each row with its own cache) and
    alone: the logits of every step agree within ``tolerance`` (the products of several rows are summed in
    another order than one row's: about 1e-5 apart in float32) and the greedy tokens are the same. On a
    module that ``runs_ragged`` the first step also carries the last prompt's last tokens (up to 5) as a
    prompt chunk after the others' decode tokens (the decode rows as one batch), as the worker's step does.
    Returns what differs (empty when nothing does)."""
    from ..batching import batched_last_logits, ragged_last_logits

    ragged = getattr(model.module, "runs_ragged", False)
    tails = [min(len(p) - 1, 5) if ragged and i == len(prompts) - 1 else 1 for i, p in enumerate(prompts)]

    def run() -> list[str]:
        alone: list[PromptCache] = []
        together: list[PromptCache] = []
        for prompt, tail in zip(prompts, tails, strict=True):
            for caches in (alone, together):
                cache = model.make_prompt_cache()
                cache.prefill(model.module, list(prompt[: len(prompt) - tail + 1]))  # leaves the tail
                caches.append(cache)
        fed = [list(p[len(p) - tail:]) for p, tail in zip(prompts, tails, strict=True)]
        problems: list[str] = []
        for step in range(steps):
            rows = [np.array(last_logits_of(model.module)(mx.array(ids)[None], cache.layers)[0].astype(mx.float32))
                    if len(ids) > 1 else  # a prompt chunk through the single-sequence pass
                    np.array(batched_last_logits(model.module, ids, [cache])[0].astype(mx.float32))
                    for ids, cache in zip(fed, alone, strict=True)]
            if step == 0 and ragged:
                batch = np.array(ragged_last_logits(model.module, [mx.array(ids) for ids in fed], together,
                                                    rows=len(fed) - 1).astype(mx.float32))
            else:
                batch = np.array(batched_last_logits(model.module, [ids[-1] for ids in fed],
                                                     together).astype(mx.float32))
            for cache, ids in zip([*alone, *together], fed * 2, strict=True):
                cache.feed(ids)
            for row, expected in enumerate(rows):
                err = float(np.abs(batch[row] - expected).max())
                if err > tolerance:
                    problems.append(f"step {step}, row {row}: batched logits differ by {err:.2e}")
            fed = [[int(np.argmax(r))] for r in rows]
            if [int(np.argmax(b)) for b in batch] != [ids[0] for ids in fed]:
                problems.append(f"step {step}: batched greedy tokens differ from the rows' own")
        return problems

    return model.worker.run(run)
