"""``ShortConv``: one forward over a sequence equals any split of it into cached chunks (single tokens,
chunks shorter than the kernel, long ones), for any kernel size; the state is small and owns its memory."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.cache import StateCache
from mlxchat.errors import CheckpointError
from mlxchat.layers import ShortConv, depthwise_weight


def layer(dims: int, kernel: int, bias: bool) -> ShortConv:
    mx.random.seed(kernel + 10 * bias)
    conv = ShortConv(dims, kernel, bias=bias)
    conv.update({"conv": {"weight": mx.random.normal((dims, kernel, 1)),
                          **({"bias": mx.random.normal((dims,))} if bias else {})}})
    return conv


def reference(conv: ShortConv, h: mx.array) -> mx.array:
    """The definition, one position at a time: y[t] = sum_k w[k] * (B*x)[t - (K-1) + k], zeros before 0."""
    b, c, x = mx.split(conv.in_proj(h), 3, axis=-1)
    gated = np.array(b * x)[0]
    weight = np.array(conv.conv.weight)[:, :, 0]  # [dims, K]
    kernel = weight.shape[1]
    padded = np.concatenate([np.zeros((kernel - 1, gated.shape[1]), np.float32), gated])
    y = np.stack([(padded[t : t + kernel].T * weight).sum(axis=1) for t in range(gated.shape[0])])
    if "bias" in conv.conv:
        y = y + np.array(conv.conv.bias)
    return conv.out_proj(c * mx.array(y)[None])


@pytest.mark.parametrize("kernel", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [[17], [1] * 17, [2, 1, 5, 9], [1, 2, 3, 11], [16, 1]])
def test_any_chunking_equals_one_pass(kernel: int, bias: bool, chunks: list[int]) -> None:
    conv = layer(24, kernel, bias)
    h = mx.random.normal((1, sum(chunks), 24))
    whole = conv(h)
    np.testing.assert_allclose(np.array(whole), np.array(reference(conv, h)), atol=1e-5)
    cache, out, pos = StateCache(1), [], 0
    for size in chunks:
        out.append(conv(h[:, pos : pos + size], cache))
        pos += size
    assert cache.offset == pos
    np.testing.assert_allclose(np.array(mx.concatenate(out, axis=1)), np.array(whole), atol=1e-5)


def test_snapshot_resumes_exactly() -> None:
    conv = layer(16, 3, False)
    h = mx.random.normal((1, 12, 16))
    cache = StateCache(1)
    conv(h[:, :7], cache)
    saved = cache.snapshot()
    first = conv(h[:, 7:], cache)
    cache.restore(saved)
    assert cache.offset == 7 and not cache.can_trim_to(5)
    np.testing.assert_array_equal(np.array(conv(h[:, 7:], cache)), np.array(first))


def test_state_does_not_pin_the_chunk() -> None:
    """After a long chunk the state holds its own K-1 rows, not a view that keeps the chunk's activations
    alive (snapshots hold states, so a view would cost a chunk of memory per layer per snapshot)."""
    conv = layer(256, 3, False)
    mx.eval(conv.parameters())
    cache = StateCache(1)
    base = mx.get_active_memory()
    out = conv(mx.random.normal((1, 2048, 256)), cache)
    mx.eval(out, cache[0])
    del out
    assert cache[0] is not None and cache[0].shape == (1, 2, 256)
    assert mx.get_active_memory() - base < 64 * 1024


def test_depthwise_weight_layouts() -> None:
    torch_layout = mx.arange(12, dtype=mx.float32).reshape(4, 1, 3)
    mlx_layout = depthwise_weight("w", torch_layout)
    assert mlx_layout.shape == (4, 3, 1)
    assert mx.array_equal(depthwise_weight("w", mlx_layout), mlx_layout)
    with pytest.raises(CheckpointError, match="model.layers.0.conv.conv.weight"):
        depthwise_weight("model.layers.0.conv.conv.weight", mx.zeros((4, 3)))


def test_a_decode_step_in_one_node_is_a_chunks_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.short_conv_step takes a decode step of a batch of rows in one node: from the same input projections,
    its outputs and next states are bit for bit those of one chunk over the same tokens (the same products and
    sums in the same order); the ops one at a time give them within float rounding."""
    from mlxchat import kernels

    if kernels._native()[0] is None:
        pytest.skip(f"fused kernels: {kernels._native()[1]}")
    conv = layer(24, 3, False)
    bcx = mx.random.normal((2, 12, 72), key=mx.random.key(4))
    whole_cache = StateCache(1)
    whole = conv._mix(bcx, whole_cache)

    def steps() -> tuple[np.ndarray, np.ndarray]:
        cache = StateCache(1)
        outs = [conv._mix(bcx[:, :5], cache)] + [conv._mix(bcx[:, t : t + 1], cache) for t in range(5, 12)]
        return np.array(mx.concatenate(outs, axis=1)), np.array(cache[0])

    calls = []
    step = kernels.short_conv_step
    monkeypatch.setattr(kernels, "short_conv_step", lambda *a: calls.append(1) or step(*a))
    fused, state = steps()
    assert len(calls) == 7
    np.testing.assert_array_equal(fused, np.array(whole))
    np.testing.assert_array_equal(state, np.array(whole_cache[0]))
    monkeypatch.setattr(kernels, "short_conv_step", lambda *a: None)
    plain, plain_state = steps()
    assert np.abs(plain - fused).max() < 1e-5 and np.array_equal(plain_state, state)


def test_a_decode_step_refuses_arrays_that_do_not_fit() -> None:
    from mlxchat import kernels

    module = kernels._native()[0]
    if module is None:
        pytest.skip(f"fused kernels: {kernels._native()[1]}")
    bcx, state, weight = mx.zeros((2, 1, 24)), mx.zeros((2, 2, 8)), mx.zeros((8, 3, 1))
    mx.eval(module.short_conv_step(bcx, state, weight))
    with pytest.raises(ValueError, match="conv_state"):
        module.short_conv_step(bcx, state[:, :1], weight)
    with pytest.raises(ValueError, match="bcx"):
        module.short_conv_step(bcx[..., 1:], state, weight)
    with pytest.raises(ValueError, match="conv_weight"):
        module.short_conv_step(bcx, state, weight[:, :1])
    with pytest.raises(ValueError, match="float32"):
        module.short_conv_step(bcx, state.astype(mx.float16), weight)
    assert kernels.short_conv_step(bcx, state, weight[:, :1]) is None  # one tap: the layer's ops take it
