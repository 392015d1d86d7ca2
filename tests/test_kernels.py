"""The fused CPU kernels (mlxchat.kernels) equal MLX's own operations: silu(g) * x, RMS norm and RoPE, values
and gradients; and MLX's operations run where a kernel does not apply (attention: tests/test_attention.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxchat import kernels

pytestmark = pytest.mark.skipif(kernels._native()[0] is None, reason=f"fused kernels: {kernels._native()[1]}")


def close(a: mx.array, b: mx.array, tolerance: float = 2e-6) -> None:
    scale = max(float(mx.abs(b).max()), 1.0)
    assert float(mx.abs(a - b).max()) <= tolerance * scale


def test_silu_mul_equals_mlx_over_the_whole_range() -> None:
    gate = mx.concatenate([mx.linspace(-100, 100, 4001), mx.random.normal((999,)) * 5])
    x = mx.random.normal((5000,))
    close(kernels.silu_mul(gate, x), nn.silu(gate) * x)
    grads = mx.grad(lambda g, x: kernels.silu_mul(g, x).sum(), argnums=(0, 1))(gate, x)
    expected = mx.grad(lambda g, x: (nn.silu(g) * x).sum(), argnums=(0, 1))(gate, x)
    for a, b in zip(grads, expected, strict=True):
        close(a, b)


def test_silu_mul_of_a_joined_products_halves() -> None:
    """A joined gate/up product [..., 2I] read as its two halves where they lie; the gradient flows to both."""
    joined = mx.random.normal((3, 5, 2 * 72)) * 4
    gate, x = joined[..., :72], joined[..., 72:]
    close(kernels.silu_mul(joined), nn.silu(gate) * x)
    grad = mx.grad(lambda j: (kernels.silu_mul(j) ** 2).sum())(joined)
    close(grad, mx.grad(lambda j: ((nn.silu(j[..., :72]) * j[..., 72:]) ** 2).sum())(joined), 1e-5)
    assert kernels.silu_mul(joined[..., 1:]) is None  # an odd last axis has no halves


@pytest.mark.parametrize("layout", ["rows apart", "last axis strided"])
def test_rms_norm_equals_mlx_on_strided_input(layout: str) -> None:
    x = (mx.random.normal((3, 40, 70)).swapaxes(0, 1) if layout == "rows apart"  # not row-contiguous
         else mx.random.normal((40, 70, 3)).swapaxes(1, 2)[:, ::-1])  # values 3 apart, rows in reverse
    w = mx.random.normal((70,))
    close(kernels.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    ours = mx.grad(lambda x, w: (kernels.rms_norm(x, w, 1e-5) ** 2).sum(), argnums=(0, 1))(x, w)
    theirs = mx.grad(lambda x, w: (mx.fast.rms_norm(x, w, 1e-5) ** 2).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs, strict=True):
        close(a, b, 1e-5)
    close(kernels.rms_norm(x, None, 1e-6), mx.fast.rms_norm(x, None, 1e-6))  # weightless (Gemma's value norm)


@pytest.mark.parametrize(("dims", "offset"), [(32, 0), (16, 7), (8, 1000)])
def test_rope_equals_mlx_and_its_gradient_turns_back(dims: int, offset: int) -> None:
    x = mx.random.normal((2, 3, 9, 32))
    inv_freq = mx.array([10000.0 ** (-2 * j / dims) for j in range(dims // 2)], dtype=mx.float32)
    ours = kernels.rope(x, inv_freq, dims, offset)
    assert ours is not None
    close(ours, mx.fast.rope(x, dims, traditional=False, base=10000.0, scale=1.0, offset=offset), 2e-5)
    weights = mx.random.normal((32,))
    grad = mx.grad(lambda x: (kernels.rope(x, inv_freq, dims, offset) * weights).sum())(x)
    expected = mx.grad(lambda x: (mx.fast.rope(x, dims, traditional=False, base=10000.0, scale=1.0,
                                               offset=offset) * weights).sum())(x)
    close(grad, expected, 2e-5)


def test_rope_of_a_batch_turns_each_row_by_its_own_offset_and_its_gradient_back() -> None:
    """Decode rows of a batch sit at their own positions: one node rotates each (a list of offsets) as RoPE at
    that offset alone would, on transposed queries too; offsets that do not fit are refused."""
    offsets = [0, 37, 5000]
    x = mx.random.normal((3, 1, 4, 64)).transpose(0, 2, 1, 3)  # [B, L=1, heads, D] read as [B, heads, L, D]
    inv_freq = mx.array([10000.0 ** (-2 * j / 64) for j in range(32)], dtype=mx.float32)
    ours = kernels.rope(x, inv_freq, 64, offsets)
    assert ours is not None
    alone = [kernels.rope(x[i : i + 1], inv_freq, 64, o) for i, o in enumerate(offsets)]
    assert mx.array_equal(ours, mx.concatenate(alone))  # type: ignore[arg-type]
    close(ours[:2], mx.concatenate([mx.fast.rope(x[i : i + 1], 64, traditional=False, base=10000.0, scale=1.0,
                                                 offset=offsets[i]) for i in range(2)]), 2e-5)
    weights = mx.random.normal((64,))
    grad = mx.grad(lambda x: (kernels.rope(x, inv_freq, 64, offsets) * weights).sum())(x)
    back = mx.concatenate([kernels.rope(weights * mx.ones_like(x[i : i + 1]), -inv_freq, 64, o)  # type: ignore[misc]
                           for i, o in enumerate(offsets)])
    assert mx.array_equal(grad, back)
    assert kernels.rope(x, inv_freq, 64, offsets[:2]) is None  # not one per row: the caller's own op
    assert kernels.rope(x[:0], inv_freq, 64, []) is None
    with pytest.raises(ValueError, match="negative"):
        kernels._native()[0].rope_rows(x, inv_freq, 64, [0, -1, 2])
    with pytest.raises(ValueError, match="one per index"):  # (an empty batch: no offsets to divide it among)
        kernels._native()[0].rope_rows(x[:0], inv_freq, 64, [])


def test_rope_equals_mlx_on_transposed_queries() -> None:
    x = mx.random.normal((1, 128, 16, 64)).transpose(0, 2, 1, 3)  # [B, L, heads, D] read as [B, heads, L, D]
    inv_freq = mx.array([10000.0 ** (-2 * j / 64) for j in range(32)], dtype=mx.float32)
    ours = kernels.rope(x, inv_freq, 64, 5)
    assert ours is not None
    close(ours, mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=5), 2e-5)


def test_mlx_runs_where_a_kernel_does_not_apply() -> None:
    half = mx.random.normal((1, 2, 3, 8)).astype(mx.float16)
    assert kernels.silu_mul(mx.ones((3,)), mx.ones((2, 3))) is None  # shapes that broadcast: the caller's op
    w = mx.ones((8,), mx.float16)
    assert kernels.rms_norm(half, w, 1e-6).dtype == mx.float16
    assert np.allclose(np.array(kernels.rms_norm(half, w, 1e-6)), np.array(mx.fast.rms_norm(half, w, 1e-6)))


def unfused_heads(q: mx.array, k: mx.array, v: mx.array, heads: int, kv_heads: int,
                  norms: tuple[mx.array, mx.array, float] | None, turn: kernels.Rotation | None) -> list[mx.array]:
    """What Attention does without kernels.heads: reshape, RMS norms, transpose, scale, RoPE, one op at a time."""
    batch, length, _ = q.shape
    out = []
    for i, (x, count) in enumerate(((q, heads), (k, kv_heads), (v, kv_heads))):
        x = x.reshape(batch, length, count, -1)
        if norms is not None and i < 2:
            x = kernels.rms_norm(x, norms[i], norms[2])  # type: ignore[arg-type]
        x = x.transpose(0, 2, 1, 3)
        if turn is not None and i < 2:
            if turn.scale != 1.0:
                x = x.at[..., : turn.dims].multiply(turn.scale)
            offset = turn.offsets[0] if len(turn.offsets) == 1 else turn.offsets
            x = kernels.rope(x, turn.inv_freq, turn.dims, offset)  # type: ignore[assignment]
        out.append(x)
    return out


@pytest.mark.parametrize(("length", "offsets", "dims", "scale", "normed"),
                         [(1, [7], 64, 1.0, True), (5, [0, 300], 32, 1.0, True), (3, [2], 64, 1.2, False),
                          (1, [4, 9], 48, 0.9, True)])
def test_heads_equal_the_ops_they_fuse_values_and_gradients(length: int, offsets: list[int], dims: int, scale: float,
                                                            normed: bool) -> None:
    """One node (kernels.heads) gives the heads the separate reshapes, norms, transposes and rotations give, bit for
    bit, from views of one product (as the joined q/k/v projection yields them); gradients equal theirs."""
    batch, heads, kv_heads, d = len(offsets), 4, 2, 64
    joined = mx.random.normal((batch, length, (heads + 2 * kv_heads) * d))
    inv_freq = mx.array([1e4 ** (-2 * j / dims) for j in range(dims // 2)], dtype=mx.float32)
    norms = (mx.random.normal((2 * d,))[::2], mx.random.normal((d,)), 1e-6) if normed else None  # (one strided)
    turn = kernels.Rotation(inv_freq, dims, scale, offsets)

    def split(x: mx.array) -> list[mx.array]:
        return mx.split(x, [heads * d, (heads + kv_heads) * d], axis=-1)  # type: ignore[return-value]

    ours = kernels.heads(*split(joined), heads, kv_heads, norms, turn)
    whole = kernels.heads(joined, None, None, heads, kv_heads, norms, turn)  # the product itself, not split
    assert ours is not None and whole is not None
    for a, b, c in zip(ours, unfused_heads(*split(joined), heads, kv_heads, norms, turn), whole, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b) and mx.array_equal(a, c)
    plain = kernels.heads(*split(joined), heads, kv_heads, None, None)  # laid out only
    assert plain is not None
    for a, b in zip(plain, unfused_heads(*split(joined), heads, kv_heads, None, None), strict=True):
        assert mx.array_equal(a, b)

    weights = [mx.random.normal(x.shape) for x in ours]

    def loss(how: str, x: mx.array, wq: mx.array, wk: mx.array) -> mx.array:
        n = (wq, wk, 1e-6) if normed else None
        made = (kernels.heads(*split(x), heads, kv_heads, n, turn) if how == "parts" else
                kernels.heads(x, None, None, heads, kv_heads, n, turn) if how == "whole" else
                unfused_heads(*split(x), heads, kv_heads, n, turn))
        return sum(((h * w).sum() for h, w in zip(made, weights, strict=True)), mx.array(0.0))  # type: ignore[union-attr]

    wq, wk = (norms[0], norms[1]) if norms else (mx.ones((d,)), mx.ones((d,)))
    expected = mx.grad(lambda *a: loss("ops", *a), argnums=(0, 1, 2))(joined, wq, wk)
    for how in ("parts", "whole"):
        grads = mx.grad(lambda *a, how=how: loss(how, *a), argnums=(0, 1, 2))(joined, wq, wk)
        for a, b in zip(grads, expected, strict=True):
            close(a, b, 1e-5)


def test_heads_beside_their_gates_skip_the_gates_values_and_gradients() -> None:
    """span 2 (Qwen3.5's gated attention: each query head followed by its output gate in the product): the heads the
    ops give from the query halves, bit for bit, from the parts or the whole product; gradients equal theirs."""
    batch, length, heads, kv_heads, d, dims = 2, 3, 4, 2, 32, 16
    joined = mx.random.normal((batch, length, (2 * heads + 2 * kv_heads) * d))
    inv_freq = mx.array([1e4 ** (-2 * j / dims) for j in range(dims // 2)], dtype=mx.float32)
    norms = (mx.random.normal((d,)), mx.random.normal((d,)), 1e-6)
    turn = kernels.Rotation(inv_freq, dims, 1.0, [5, 11])

    def parts(x: mx.array) -> list[mx.array]:
        return mx.split(x, [2 * heads * d, (2 * heads + kv_heads) * d], axis=-1)  # type: ignore[return-value]

    def queries(x: mx.array) -> mx.array:  # each head's first half, as the ops take them
        return x.reshape(batch, length, heads, 2 * d)[..., :d].reshape(batch, length, heads * d)

    def ops(x: mx.array, wq: mx.array, wk: mx.array) -> list[mx.array]:
        q, k, v = parts(x)
        return unfused_heads(queries(q), k, v, heads, kv_heads, (wq, wk, 1e-6), turn)

    whole = kernels.heads(joined, None, None, heads, kv_heads, norms, turn, span=2)
    split = kernels.heads(*parts(joined), heads, kv_heads, norms, turn, span=2)
    assert whole is not None and split is not None
    for a, b, c in zip(whole, split, ops(joined, norms[0], norms[1]), strict=True):
        assert a.shape == c.shape and mx.array_equal(a, c) and mx.array_equal(b, c)
    weights = [mx.random.normal(x.shape) for x in whole]

    def loss(made: Any) -> mx.array:
        return sum(((h * w).sum() for h, w in zip(made, weights, strict=True)), mx.array(0.0))

    expected = mx.grad(lambda *a: loss(ops(*a)), argnums=(0, 1, 2))(joined, norms[0], norms[1])
    ours = mx.grad(lambda x, wq, wk: loss(kernels.heads(x, None, None, heads, kv_heads, (wq, wk, 1e-6), turn, span=2)),
                   argnums=(0, 1, 2))(joined, norms[0], norms[1])
    for a, b in zip(ours, expected, strict=True):
        close(a, b, 1e-5)
    with pytest.raises(ValueError, match="span"):
        kernels._native()[0].heads(joined, None, None, heads, kv_heads, span=3)


def test_heads_refuse_what_does_not_fit() -> None:
    module = kernels._native()[0]
    q, k, v = mx.zeros((1, 2, 8 * 4)), mx.zeros((1, 2, 2 * 4)), mx.zeros((1, 2, 2 * 4))
    inv_freq = mx.ones((2,))
    with pytest.raises(ValueError, match="negative"):
        module.heads(q, k, v, 8, 2, [], 0.0, inv_freq, 4, 1.0, [-1])
    with pytest.raises(ValueError, match="one per row"):
        module.heads(q, k, v, 8, 2, [], 0.0, inv_freq, 4, 1.0, [0, 1])
    with pytest.raises(ValueError, match="dims"):
        module.heads(q, k, v, 8, 2, [], 0.0, inv_freq, 6, 1.0, [0])
    with pytest.raises(ValueError, match="heads"):
        module.heads(q, k, v, 3, 2, [], 0.0, inv_freq, 4, 1.0, [0])
    with pytest.raises(ValueError, match="norm"):
        module.heads(q, k, v, 8, 2, [mx.ones((4,))], 1e-6)
    with pytest.raises(ValueError, match="batch"):
        module.heads(q, k[:, :1], v, 8, 2)
    with pytest.raises(ValueError, match="heads"):  # a product of 40 features is no 8 + 2 * 2 heads
        module.heads(mx.zeros((1, 2, 40)), None, None, 8, 2)
    with pytest.raises(ValueError, match="neither"):
        module.heads(q, k, None, 8, 2)
    assert kernels.heads(q.astype(mx.float16), k, v, 8, 2, None, None) is None  # the caller's own ops run
