"""The Gated DeltaNet layer: its chunked form equals the token-by-token recurrence (float64 NumPy) for any
chunk size and starting state, and the layer gives the same outputs however a sequence is split into calls."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.cache import StateCache
from mlxchat.layers import GatedDeltaNet, RMSNormGated, gated_delta_chunked, gated_delta_step

RNG = np.random.default_rng(7)
B, H, L, DK, DV = 2, 3, 150, 16, 24


def recurrence(q, k, v, g, beta, state):
    """The gated delta rule as written in the paper, one token at a time."""
    state = state.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[2]):
        state = state * np.exp(g[:, :, t])[..., None, None]
        recalled = np.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        delta = (v[:, :, t] - recalled) * beta[:, :, t][..., None]
        state = state + k[:, :, t][..., :, None] * delta[..., None, :]
        out[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], state)
    return out, state


def inputs():
    q = RNG.normal(size=(B, H, L, DK))
    k = RNG.normal(size=(B, H, L, DK))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(DK)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = RNG.normal(size=(B, H, L, DV))
    # Per-head decay rates from none to strong (a chunk's cumulative decay reaches far below exp(-80)).
    g = -np.abs(RNG.normal(size=(B, H, L))) * np.array([0.01, 1.0, 6.0])[None, :, None]
    beta = 1 / (1 + np.exp(-RNG.normal(size=(B, H, L))))
    return q, k, v, g, beta


def f32(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


@pytest.mark.parametrize("chunk", [64, 16, 7, 1, 1000])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_form_equals_recurrence(chunk: int, with_state: bool) -> None:
    q, k, v, g, beta = inputs()
    state = RNG.normal(size=(B, H, DK, DV)) if with_state else np.zeros((B, H, DK, DV))
    expected, expected_state = recurrence(q, k, v, g, beta, state)
    out, final = gated_delta_chunked(f32(q), f32(k), f32(v), f32(g), f32(beta),
                                     f32(state) if with_state else None, chunk)
    assert np.abs(np.array(out) - expected).max() < 1e-5
    assert np.abs(np.array(final) - expected_state).max() < 1e-5


def test_recurrent_step_equals_recurrence() -> None:
    q, k, v, g, beta = inputs()
    state0 = RNG.normal(size=(B, H, DK, DV))
    expected, expected_state = recurrence(q, k, v, g, beta, state0)
    state = f32(state0)
    for t in range(L):
        out, state = gated_delta_step(f32(q[:, :, t]), f32(k[:, :, t]), f32(v[:, :, t]), f32(g[:, :, t]),
                                      f32(beta[:, :, t]), state)
        assert np.abs(np.array(out) - expected[:, :, t]).max() < 1e-5
    assert np.abs(np.array(state) - expected_state).max() < 1e-5


def test_chunked_form_has_the_recurrences_gradients() -> None:
    """Training (LoRA on Qwen3.5's DeltaNet layers) differentiates the chunked form, through its triangular
    inverse: its gradients are those of the token-by-token step."""
    q, k, v, g, beta = (f32(x[:, :, :40]) for x in inputs())
    weights = mx.random.normal((B, H, 40, DV), key=mx.random.key(0))

    def stepped(*args: mx.array) -> mx.array:
        state, total = mx.zeros((B, H, DK, DV)), mx.array(0.0)
        for t in range(40):
            out, state = gated_delta_step(*(a[:, :, t] for a in args), state)
            total = total + (out * weights[:, :, t]).sum()
        return total

    def chunked(*args: mx.array) -> mx.array:
        return (gated_delta_chunked(*args, None, 16)[0] * weights).sum()

    argnums = [0, 1, 2, 3, 4]
    expected = mx.grad(stepped, argnums=argnums)(q, k, v, g, beta)
    got = mx.grad(chunked, argnums=argnums)(q, k, v, g, beta)
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=1e-4)


def _layer(chunk: int) -> GatedDeltaNet:
    mx.random.seed(3)
    layer = GatedDeltaNet(32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12,
                          conv_kernel=4, chunk_size=chunk)
    layer.update({"A_log": mx.random.uniform(-2, 2, (4,)), "dt_bias": mx.random.normal((4,)),
                  "norm": {"weight": 1 + 0.3 * mx.random.normal((12,))}})
    return layer


def test_layer_gives_the_same_outputs_for_any_split_into_calls() -> None:
    layer = _layer(chunk=8)
    x = mx.random.normal((1, 45, 32))
    whole = np.array(layer(x))
    for sizes in ([45], [9, 1, 20, 15], [1] * 45, [3, 40, 1, 1]):
        cache, parts, pos = StateCache(2), [], 0
        for size in sizes:
            parts.append(np.array(layer(x[:, pos : pos + size], cache)))
            pos += size
        assert cache.offset == 45
        assert np.abs(np.concatenate(parts, axis=1) - whole).max() < 1e-5, sizes


def test_chunk_size_does_not_change_the_layer() -> None:
    x = mx.random.normal((2, 70, 32))
    assert np.abs(np.array(_layer(64)(x)) - np.array(_layer(5)(x))).max() < 1e-5


def test_gated_norm_uses_a_plain_weight() -> None:
    norm = RMSNormGated(6, eps=1e-6)
    norm.weight = mx.array([0.5, 1.0, 1.5, 2.0, -1.0, 0.0])
    x, z = RNG.normal(size=(3, 6)), RNG.normal(size=(3, 6))
    expected = norm.weight * (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)) * (z / (1 + np.exp(-z)))
    assert np.abs(np.array(norm(f32(x), f32(z))) - np.array(expected)).max() < 1e-5


def test_value_heads_must_share_key_heads_evenly() -> None:
    with pytest.raises(ValueError, match="multiple"):
        GatedDeltaNet(32, num_key_heads=3, num_value_heads=4, key_head_dim=8, value_head_dim=8)


def test_a_decode_step_in_one_node_equals_the_ops_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.gated_delta_step (a decode step's convolution, normalized q and k, delta rule and gated norm in one
    node) gives what the ops one at a time give, for a batch of rows whose value heads share key heads; the state
    is rewritten in place unless something else holds it (a snapshot: that one is left as it was)."""
    from mlxchat import kernels

    if kernels._native()[0] is None:
        pytest.skip(f"fused kernels: {kernels._native()[1]}")

    def address(a: mx.array) -> int:
        return int(np.asarray(a).__array_interface__["data"][0])

    layer = _layer(chunk=8)
    x = mx.random.normal((2, 30, 32)) * 2

    def run() -> tuple[np.ndarray, StateCache]:
        cache = StateCache(2)
        outs = [np.array(layer(x[:, :20], cache))]
        outs += [np.array(layer(x[:, t : t + 1], cache)) for t in range(20, 30)]
        return np.concatenate(outs, axis=1), cache

    calls = []
    step = kernels.gated_delta_step
    monkeypatch.setattr(kernels, "gated_delta_step", lambda *a: calls.append(1) or step(*a))
    fused, cache = run()
    assert len(calls) == 10
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "gated_delta_step", lambda *a: None)
        plain, plain_cache = run()
    assert np.abs(fused - plain).max() < 1e-5
    assert all(np.abs(np.array(mine) - np.array(theirs)).max() < 1e-5  # (no name left holding the state)
               for mine, theirs in zip(cache.state, plain_cache.state, strict=True))

    mx.eval(cache.state)
    before = address(cache[1])
    mx.eval(layer(x[:, :1], cache), cache.state)
    assert address(cache[1]) == before  # taken over: nothing else held it
    snapshot = cache.snapshot()
    kept = np.array(cache[1])
    mx.eval(layer(x[:, 1:2], cache), cache.state)
    assert address(cache[1]) != address(snapshot[1][1]) and np.array_equal(np.array(snapshot[1][1]), kept)


def test_a_decode_step_refuses_arrays_that_do_not_fit() -> None:
    from mlxchat import kernels

    module = kernels._native()[0]
    if module is None:
        pytest.skip(f"fused kernels: {kernels._native()[1]}")
    qkv, z, b = mx.zeros((1, 1, 2 * 2 * 8 + 4 * 12)), mx.zeros((1, 1, 48)), mx.zeros((1, 1, 4))
    conv_state, conv_weight, state = mx.zeros((1, 3, 80)), mx.zeros((80, 4, 1)), mx.zeros((1, 4, 8, 12))
    ok = (qkv, z, b, b, conv_state, conv_weight, state, mx.zeros((4,)), mx.zeros((4,)), mx.ones((12,)))
    mx.eval(module.gated_delta_step(*ok, 2, 0.1, 0.3, 1e-7, 1e-6))
    with pytest.raises(ValueError, match="multiple"):
        module.gated_delta_step(*ok, 3, 0.1, 0.3, 1e-7, 1e-6)
    with pytest.raises(ValueError, match="conv_state"):
        module.gated_delta_step(*ok[:4], conv_state[:, :2], *ok[5:], 2, 0.1, 0.3, 1e-7, 1e-6)
    with pytest.raises(ValueError, match="qkv"):
        module.gated_delta_step(qkv[..., 1:], *ok[1:], 2, 0.1, 0.3, 1e-7, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        module.gated_delta_step(*ok[:6], state.astype(mx.float16), *ok[7:], 2, 0.1, 0.3, 1e-7, 1e-6)


def test_the_convolution_serves_layers_of_any_width_in_one_process() -> None:
    """Its taps run as a shapeless compiled function: layers of other widths (another model, a sharded one) get
    their own sums, not the first width's (a tap sliced inside the trace kept the first width)."""
    from mlxchat.layers.gated_delta import causal_conv_silu

    for channels in (40, 48, 24):
        weight, window = mx.random.normal((4, channels)), mx.random.normal((2, 7, channels))
        expected = sum(window[:, i : i + 4] * weight[i] for i in range(4))
        got = causal_conv_silu(window, weight)
        assert got.shape == (2, 4, channels)
        assert float(mx.abs(got - expected * mx.sigmoid(expected)).max()) < 1e-5  # type: ignore[operator]


def test_the_decode_rows_of_a_ragged_step_take_the_one_node_step_and_give_each_rows_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving step's decode rows (RaggedRows: two rows decoding a token each beside a prompt's chunk) run as
    one batch through the one-node step; every sequence's output and state are what it gets alone."""
    from mlxchat import kernels
    from mlxchat.cache import RaggedRows

    if kernels._native()[0] is None:
        pytest.skip(f"fused kernels: {kernels._native()[1]}")
    layer = _layer(chunk=8)
    x = mx.random.normal((3, 12, 32))
    caches = [StateCache(2) for _ in range(3)]
    for i, cache in enumerate(caches):
        mx.eval(layer(x[i : i + 1, :10], cache), cache.state)
    before = [cache.snapshot() for cache in caches]
    parts = [x[0:1, 10:11], x[1:2, 10:11], x[2:3, 10:12]]
    alone = [np.array(layer(part, cache)) for part, cache in zip(parts, caches, strict=True)]
    states = [[np.array(a) for a in cache.state] for cache in caches]
    for cache, snapshot in zip(caches, before, strict=True):
        cache.restore(snapshot)
    calls = []
    step = kernels.gated_delta_step
    monkeypatch.setattr(kernels, "gated_delta_step", lambda *a: calls.append(a[0].shape[0]) or step(*a))
    together = np.array(layer(mx.concatenate(parts, axis=1), RaggedRows(caches, [1, 1, 2], rows=2)))  # type: ignore[arg-type]
    assert calls == [2]
    assert np.abs(together - np.concatenate(alone, axis=1)).max() < 1e-5
    for cache, expected in zip(caches, states, strict=True):
        assert cache.offset == (11 if expected is not states[2] else 12)
        assert all(np.abs(np.array(a) - b).max() < 1e-5 for a, b in zip(cache.state, expected, strict=True))
