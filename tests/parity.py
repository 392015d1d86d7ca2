"""Parity checks against stored reference outputs, shared by every architecture's tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlxchat
from mlxchat.generation import decode_tokens
from mlxchat.sampling import make_sampler

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


def prefill_and_decode(model: mlxchat.GenerativeModel, prompt: list[int], cache: mlxchat.PromptCache, n: int,
                       snapshot_at: list[int] = (), step: int = 512) -> tuple[list[int], int]:
    """``n`` greedy tokens through ``cache`` (on the caller's thread: call it on the model's worker), not
    stopping at the checkpoint's stop tokens; and how many prompt tokens the cache served."""
    reused, pending = cache.prefill(model.module, prompt, snapshot_at=snapshot_at, step=step)
    return list(decode_tokens(model.module, cache, pending, make_sampler(0.0), n)), reused


def greedy(model: mlxchat.GenerativeModel, prompt: list[int], n: int, prefill_step: int = 5) -> list[int]:
    """``n`` greedy tokens from the generation loop itself (prefilled in small chunks), not stopping at the
    checkpoint's stop tokens (the reference run did not stop either)."""
    return model.worker.run(lambda: prefill_and_decode(model, prompt, model.make_prompt_cache(), n,
                                                       step=prefill_step)[0])


def assert_close(ours: np.ndarray, theirs: np.ndarray, tol: float = TOLERANCE) -> None:
    err = float(np.abs(ours - theirs).max())
    assert err <= tol, f"max abs error {err:.2e} > {tol:.0e}"
