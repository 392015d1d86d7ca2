"""SlidingWindowCache with window_mask: any chunking of a sequence (decode steps, chunks shorter and longer
than the window, after it has filled) attends exactly as one windowed pass over the whole sequence; memory
stays at the window; it cuts back only as far as it still holds; snapshots restore; and
ProportionalRoPE rotates the two slices transformers' "proportional" RoPE rotates."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxchat.cache import SlidingWindowCache
from mlxchat.config import RopeConfig
from mlxchat.layers import ProportionalRoPE, window_mask
from mlxchat.prompt_cache import PromptCache

HEADS, KV_HEADS, DIM = 2, 1, 8


def sequence(length: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    q, k, v = (mx.array(rng.standard_normal((1, h, length, DIM)).astype(np.float32))
               for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v


def attend(q: mx.array, k: mx.array, v: mx.array, window: int) -> mx.array:
    mask = window_mask(q.shape[2], k.shape[2], window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask)


def reference(q: mx.array, k: mx.array, v: mx.array, window: int) -> np.ndarray:
    """Every position attends to itself and the window - 1 before it (plain numpy)."""
    qn, kn, vn = (np.array(a)[0] for a in (q, k, v))
    out = np.zeros_like(qn)
    for t in range(qn.shape[1]):
        lo = max(0, t - window + 1)
        scores = np.einsum("hd,kd->hk", qn[:, t], kn[0, lo : t + 1]) * DIM**-0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, t] = (weights / weights.sum(-1, keepdims=True)) @ vn[0, lo : t + 1]
    return out


def run(cache: SlidingWindowCache, q: mx.array, k: mx.array, v: mx.array, chunks: list[int],
        start: int = 0) -> np.ndarray:
    """Feed positions ``start..`` of the sequence in chunks; the attention outputs, ``[heads, n, dim]``."""
    outs, pos = [], start
    for size in chunks:
        part = slice(pos, pos + size)
        keys, values = cache.update_and_fetch(k[:, :, part], v[:, :, part])
        outs.append(np.array(attend(q[:, :, part], keys, values, cache.window))[0])
        assert all(a.shape[2] == cache.window for a in cache.state)  # memory stays at the window
        pos += size
    return np.concatenate(outs, axis=1)


chunkings = st.lists(st.integers(1, 23), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 12), chunks=chunkings, seed=st.integers(0, 2**16))
def test_any_chunking_attends_like_one_windowed_pass(window: int, chunks: list[int], seed: int) -> None:
    q, k, v = sequence(sum(chunks), seed)
    ours = run(SlidingWindowCache(window), q, k, v, chunks)
    np.testing.assert_allclose(ours, reference(q, k, v, window), atol=1e-5)
    np.testing.assert_allclose(np.array(attend(q, k, v, window))[0], ours, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 10), first=chunkings, back=st.integers(0, 30), rest=chunkings,
       seed=st.integers(0, 2**16))
def test_cuts_back_only_as_far_as_it_still_holds(window: int, first: list[int], back: int, rest: list[int],
                                                 seed: int) -> None:
    total = sum(first)
    position = max(0, total - back)
    q, k, v = sequence(position + sum(rest), seed)
    other = sequence(total, seed + 1)  # what the cache was fed after `position` differs from what follows
    cache = SlidingWindowCache(window)
    run(cache, *(mx.concatenate([a[:, :, :position], b[:, :, position:]], axis=2)
                 for a, b in zip((q, k, v), other, strict=True)), first)
    # Until tokens leave the window any cut works; after that, one step back at most (the window before
    # the new position must still be there).
    assert cache.can_trim_to(position) == (total <= window or position >= total - 1)
    assert not cache.can_trim_to(total + 1)
    if not cache.can_trim_to(position):
        with pytest.raises(ValueError):
            cache.trim_to(position)
        return
    cache.trim_to(position)
    ours = run(cache, q, k, v, rest, start=position)
    np.testing.assert_allclose(ours, reference(q, k, v, window)[:, position:], atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 10), before=chunkings, after=chunkings, seed=st.integers(0, 2**16))
def test_snapshot_restores_the_position(window: int, before: list[int], after: list[int], seed: int) -> None:
    q, k, v = sequence(sum(before) + sum(after), seed)
    cache = SlidingWindowCache(window)
    run(cache, q, k, v, before)
    saved = cache.snapshot()
    run(cache, *sequence(sum(after), seed + 1), after, start=0)  # something else, then back
    cache.restore(saved)
    ours = run(cache, q, k, v, after, start=sum(before))
    np.testing.assert_allclose(ours, reference(q, k, v, window)[:, sum(before):], atol=1e-5)
    cache.restore(saved)  # a snapshot survives being restored from
    np.testing.assert_allclose(run(cache, q, k, v, after, start=sum(before)), ours, atol=1e-6)


def test_prompt_cache_returns_through_snapshots_once_the_window_moved() -> None:
    cache = PromptCache(lambda: [SlidingWindowCache(4)])
    assert cache.needs_snapshots
    _, k, v = sequence(12, 0)

    def feed(tokens: list[int]) -> None:
        part = slice(len(cache), len(cache) + len(tokens))
        cache.layers[0].update_and_fetch(k[:, :, part], v[:, :, part])
        cache.feed(tokens)

    feed([1, 2, 3])
    assert cache.reuse([1, 2, 9, 9]) == 2  # still inside the window: a plain cut
    feed([9, 9, 9, 9, 9])
    cache.snapshot()
    feed([5, 5, 5])
    assert cache.reuse([1, 2, 9, 9, 9, 9, 9, 7]) == 7  # the window moved on: the snapshot at 7
    assert cache.layers[0].offset == 7
    assert cache.reuse([1, 2, 8]) == 0  # nothing held that far back
    assert cache.layers[0].offset == 0


def test_window_mask() -> None:
    assert window_mask(1, 4, 4) is None
    mask = np.array(window_mask(3, 5, 2))
    assert mask.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                             [False, False, False, True, True]]


def proportional_reference(x: np.ndarray, offset: int, head_dim: int, theta: float,
                           factor: float) -> np.ndarray:
    """transformers' proportional inv_freq (zeros past the rotated pairs), applied rotate-half style."""
    rotated = int(factor * head_dim // 2)
    inv = np.concatenate([1.0 / theta ** (np.arange(0, 2 * rotated, 2) / head_dim),
                          np.zeros(head_dim // 2 - rotated)])
    angles = (offset + np.arange(x.shape[-2]))[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    half = head_dim // 2
    rotate_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotate_half * sin


@pytest.mark.parametrize(("head_dim", "factor"), [(32, 0.25), (512, 0.25), (16, 0.5), (8, 1.0)])
def test_proportional_rope_rotates_two_slices(head_dim: int, factor: float) -> None:
    x = np.random.default_rng(0).standard_normal((1, 2, 5, head_dim)).astype(np.float32)
    rope = ProportionalRoPE(head_dim, RopeConfig(rope_type="proportional", rope_theta=1e6,
                                                 partial_rotary_factor=factor))
    ours = np.array(rope(mx.array(x), offset=7))
    np.testing.assert_allclose(ours, proportional_reference(x, 7, head_dim, 1e6, factor), atol=2e-5)
    untouched = int(factor * head_dim // 2)
    if untouched < head_dim // 2:
        still = np.r_[untouched : head_dim // 2, head_dim // 2 + untouched : head_dim]
        assert np.array_equal(ours[..., still], x[..., still])
    assert not math.isclose(float(np.abs(ours - x).max()), 0.0)
    rows = np.array(rope(mx.array(np.concatenate([x, x])), offset=mx.array([7, 30])))  # each at its own position
    np.testing.assert_allclose(rows[1:], proportional_reference(x, 30, head_dim, 1e6, factor), atol=2e-5)
    assert np.array_equal(rows[:1], ours)
