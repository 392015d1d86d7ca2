"""Parity checks against stored reference outputs, shared by every architecture's tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlxchat
from mlxchat.generation import GenerationConfig, decode_tokens

TOLERANCE = 1e-4


def full_logits(model: mlxchat.GenerativeModel, ids: np.ndarray) -> np.ndarray:
    return np.array(model.logits(ids.tolist()))


def chunked_logits(model: mlxchat.GenerativeModel, ids: np.ndarray, chunks: list[int]) -> np.ndarray:
    """Logits of ``ids`` fed through a cache in chunks of the given sizes, then one token at a time."""

    def run() -> np.ndarray:
        cache = model.module.make_cache()
        out, pos = [], 0
        for size in chunks + [1] * (len(ids) - sum(chunks)):
            step = mx.array(ids[pos : pos + size].tolist())[None]
            logits = model.module(step, cache)[0].astype(mx.float32)
            mx.eval(logits)
            out.append(np.array(logits))
            pos += size
        return np.concatenate(out)

    return model.worker.run(run)


def greedy(model: mlxchat.GenerativeModel, prompt: list[int], n: int, prefill_step: int = 5) -> list[int]:
    """``n`` greedy tokens from the generation loop itself (prefilled in small chunks), not stopping at the
    checkpoint's stop tokens (the reference run did not stop either)."""
    config = GenerationConfig(max_tokens=n, temperature=0.0, prefill_step=prefill_step)

    def run() -> list[int]:
        return list(decode_tokens(model.module, prompt, model.make_prompt_cache(), config, model.config.vocab_size))

    return model.worker.run(run)


def assert_close(ours: np.ndarray, theirs: np.ndarray, tol: float = TOLERANCE) -> None:
    err = float(np.abs(ours - theirs).max())
    assert err <= tol, f"max abs error {err:.2e} > {tol:.0e}"
