"""mlxchat's CPU quantized matmuls (mlxchat.quantized, native kernels in core/native) equal MLX's own
``quantized_matmul`` / ``gather_qmm`` up to float32 rounding, through every kernel this CPU has, for every
width MLX's affine mode writes (2, 3, 4, 5, 6 and 8 bits), odd group counts, one row and many; they work
under ``mx.compile`` and give ``x`` MLX's gradient; and where they do not apply, MLX's op runs unchanged.

Tolerance: the kernels add up ``sum_g scale * sum_k q * x + sum_g bias * sum_k x`` (or look up
``scale * q + bias``), MLX ``sum_k x * (scale * q + bias)``: the same terms in another order, so the
difference is bounded by a few float32 epsilons times ``sum_k |x| |w|`` (measured: under 3e-7 of it for
K = 1024). We allow 1e-5 of it: a wrong nibble, group or scale is off by a whole weight.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlxchat.quantized as mq
from mlxchat.layers.quantized import QuantizedEmbedding, QuantizedLinear

native = pytest.importorskip("mlxchat._quantized", reason="native quantized kernels not built here")


def _available_isas() -> list[str]:
    order = ["scalar", "avx2", "avx512", "amx"]
    return order[: order.index(native.detected_isa()) + 1]


@pytest.fixture(params=_available_isas())
def isa(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Every kernel this CPU has; AMX (tiles for products of several rows) also takes single rows here."""
    native.set_isa(request.param)
    rows = native.amx_rows()
    native.set_amx_rows(1 if request.param == "amx" else rows)
    yield request.param
    native.set_isa(native.detected_isa())
    native.set_amx_rows(rows)


def _quantized(n: int, k: int, group_size: int, bits: int, experts: int | None = None, seed: int = 0):  # type: ignore[no-untyped-def]
    mx.random.seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    w = mx.random.normal(shape) * 0.5
    packed, scales, biases = mx.quantize(w, group_size, bits)
    return packed, scales, biases


def _bound(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> np.ndarray:
    """sum_k |x| |w| for every output: the scale of float32 rounding differences."""
    w = np.abs(np.array(mx.dequantize(packed, scales, biases, group_size, bits)))
    return np.abs(np.array(x)) @ w.T


def _assert_matches(ours: mx.array, theirs: mx.array, bound: np.ndarray) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == mx.float32
    err = np.abs(np.array(ours) - np.array(theirs))
    assert (err <= 1e-5 * bound + 1e-6).all(), f"max error {err.max():.2e}, relative {(err / bound).max():.2e}"


# shapes: rows of x, outputs, inputs, group size -- odd group counts, outputs not a multiple of the tiles
SHAPES = [(1, 64, 128, 64), (1, 37, 96, 32), (1, 300, 320, 64), (1, 257, 384, 128), (2, 41, 160, 32),
          (3, 100, 192, 64), (4, 129, 448, 64), (8, 70, 256, 128), (9, 45, 224, 32), (33, 130, 320, 64)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m,n,k,group_size", SHAPES, ids=lambda v: str(v))
def test_quantized_matmul_equals_mlx(isa: str, bits: int, m: int, n: int, k: int, group_size: int) -> None:
    packed, scales, biases = _quantized(n, k, group_size, bits, seed=m + n)
    x = mx.random.normal((m, k))
    ours = native.quantized_matmul(x, packed, scales, biases, group_size, bits)
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits)
    _assert_matches(ours, theirs, _bound(x, packed, scales, biases, group_size, bits))


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_many_rows_take_the_sgemm_path_and_still_equal_mlx(bits: int) -> None:
    packed, scales, biases = _quantized(300, 512, 64, bits)
    x = mx.random.normal((2, 40, 512))  # 80 rows, batch dimensions kept
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=bits)
    bound = _bound(x.reshape(80, 512), packed, scales, biases, 64, bits).reshape(2, 40, 300)
    rows = native.small_rows()
    try:
        for limit in (rows, 1000):  # through sgemm, then through the small-row kernel
            native.set_small_rows(limit)
            _assert_matches(native.quantized_matmul(x, packed, scales, biases, 64, bits), theirs, bound)
    finally:
        native.set_small_rows(rows)


def test_strided_and_broadcast_inputs_are_read_correctly() -> None:
    packed, scales, biases = _quantized(96, 256, 64, 4)
    base = mx.random.normal((256, 5))
    for x in (base.T, mx.broadcast_to(mx.random.normal((1, 256)), (3, 256)), mx.random.normal((4, 512))[:, ::2]):
        theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)
        _assert_matches(native.quantized_matmul(x, packed, scales, biases, 64, 4), theirs,
                        _bound(x, packed, scales, biases, 64, 4))
    # every other row of a larger quantized matrix: strided weights, scales and biases
    packed, scales, biases = (a[::2] for a in _quantized(192, 256, 64, 4))
    x = mx.random.normal((2, 256))
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)
    _assert_matches(native.quantized_matmul(x, packed, scales, biases, 64, 4), theirs,
                    _bound(x, packed, scales, biases, 64, 4))


@pytest.fixture(params=["row kernel", "sgemm"])
def rows_limit(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Experts with more rows than the limit go through sgemm: also check that path with few rows."""
    default = native.small_rows()
    native.set_small_rows(default if request.param == "row kernel" else 1)
    yield request.param
    native.set_small_rows(default)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_gathered_experts_equal_mlx_gather_qmm(isa: str, rows_limit: str, bits: int, tokens: int) -> None:
    experts, top_k, n, k = 6, 3, 72, 192
    packed, scales, biases = _quantized(n, k, 64, bits, experts=experts)
    rng = np.random.default_rng(tokens)
    indices = mx.array(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.uint32))
    x = mx.random.normal((tokens, 1, 1, k))  # the decode layout: one row broadcast over the token's experts
    theirs = mx.gather_qmm(x, packed, scales, biases, rhs_indices=indices, transpose=True, group_size=64, bits=bits)
    ours = native.gather_quantized_matmul(x, packed, scales, biases, indices, 64, bits)
    assert ours.shape == theirs.shape == (tokens, top_k, 1, n)
    w = np.abs(np.array(mx.dequantize(packed, scales, biases, 64, bits)))
    bound = np.einsum("tk,tjnk->tjn", np.abs(np.array(x))[:, 0, 0], w[np.array(indices)])[:, :, None]
    _assert_matches(ours, theirs, bound)
    # the sorted layout the prefill path uses: rows grouped by expert, one row per (token, expert)
    flat = indices.flatten()
    order = mx.argsort(flat)
    rows = mx.broadcast_to(x, (tokens, top_k, 1, k)).reshape(-1, 1, k)[order]
    theirs = mx.gather_qmm(rows, packed, scales, biases, rhs_indices=flat[order], transpose=True, group_size=64,
                           bits=bits, sorted_indices=True)
    ours = mq.gather_quantized_matmul(rows, packed, scales, biases, flat[order], 64, bits, sorted_indices=True)
    _assert_matches(ours, theirs, bound.reshape(-1, 1, n)[order])


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_gathered_float_experts_equal_mlx_gather_mm_with_its_gradients(tokens: int) -> None:
    """Float32 experts: one sgemm per expert's rows (MLX's CPU gather_mm multiplies each row alone)."""
    experts, top_k, n, k = 6, 3, 72, 192
    w = mx.random.normal((experts, n, k)) * 0.5
    rng = np.random.default_rng(tokens)
    indices = mx.array(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.uint32))
    for x in (mx.random.normal((tokens, 1, 1, k)), mx.random.normal((tokens, top_k, 2, k))):
        theirs = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices)
        ours = native.gather_matmul(x, w, indices)
        assert ours.shape == theirs.shape
        bound = np.abs(np.array(x)) @ np.abs(np.array(w)).max(0).T
        assert (np.abs(np.array(ours) - np.array(theirs)) <= 1e-5 * bound + 1e-6).all()

        def ours_loss(x: mx.array, w: mx.array) -> mx.array:
            return native.gather_matmul(x, w, indices).square().sum()  # type: ignore[no-any-return]

        def theirs_loss(x: mx.array, w: mx.array) -> mx.array:
            return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices).square().sum()

        for ours_grad, theirs_grad in zip(mx.grad(ours_loss, (0, 1))(x, w), mx.grad(theirs_loss, (0, 1))(x, w),
                                          strict=True):
            np.testing.assert_allclose(np.array(ours_grad), np.array(theirs_grad), rtol=1e-4, atol=1e-3)
    assert mq.gathers_rows(x, w) and not mq.gathers_rows(x.astype(mx.bfloat16), w.astype(mx.bfloat16))


def test_works_under_mx_compile_including_shapeless() -> None:
    packed, scales, biases = _quantized(80, 256, 64, 4)
    experts = _quantized(24, 256, 64, 8, experts=4, seed=1)

    def f(x: mx.array, indices: mx.array) -> mx.array:
        dense = mq.quantized_matmul(x, packed, scales, biases, 64, 4) * 2.0
        routed = mq.gather_quantized_matmul(x[:, None, None], *experts, indices, 64, 8)
        return mx.concatenate([dense.sum(-1), routed.sum((-3, -2, -1))])

    compiled, shapeless = mx.compile(f), mx.compile(f, shapeless=True)
    for rows in (1, 5, 1):
        x = mx.random.normal((rows, 256))
        indices = mx.random.randint(0, 4, (rows, 2)).astype(mx.uint32)
        expected = np.array(f(x, indices))
        np.testing.assert_array_equal(np.array(compiled(x, indices)), expected)
        np.testing.assert_array_equal(np.array(shapeless(x, indices)), expected)


def test_gradient_for_x_equals_mlx() -> None:
    packed, scales, biases = _quantized(48, 128, 32, 8)
    x = mx.random.normal((3, 128))
    ours = mx.grad(lambda v: native.quantized_matmul(v, packed, scales, biases, 32, 8).square().sum())(x)
    theirs = mx.grad(
        lambda v: mx.quantized_matmul(v, packed, scales, biases, transpose=True, group_size=32, bits=8).square().sum()
    )(x)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sort", [False, True])
def test_gathered_gradient_for_x_equals_mlx(sort: bool) -> None:
    """Adapters on a quantized mixture of experts train through the experts: ``x``'s gradient, broadcast over the
    token's experts (decode layout) or one row per expert (sorted prefill layout), is MLX's."""
    experts = _quantized(24, 128, 32, 4, experts=4, seed=2)
    indices = mx.array([[0, 2], [3, 1], [2, 2]], dtype=mx.uint32)
    x = mx.random.normal((3, 1, 1, 128))
    if sort:
        x, indices = mx.broadcast_to(x, (3, 2, 1, 128)).reshape(-1, 1, 128), indices.flatten()

    weights = mx.random.normal((24,), key=mx.random.key(3))

    def loss(product):  # type: ignore[no-untyped-def]
        return lambda v: (product(v) * weights).sum()

    ours = mx.grad(loss(lambda v: native.gather_quantized_matmul(v, *experts, indices, 32, 4)))(x)
    theirs = mx.grad(loss(lambda v: mx.gather_qmm(v, *experts, rhs_indices=indices, transpose=True, group_size=32,
                                                  bits=4)))(x)
    assert ours.shape == x.shape
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)


def test_quantized_linear_uses_mlx_where_the_kernels_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = QuantizedLinear.from_linear(nn.Linear(128, 40), 64, 4)
    x = mx.random.normal((2, 128))

    def mlx_op(layer: QuantizedLinear, x: mx.array) -> np.ndarray:
        y = mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True, group_size=64, bits=4)
        return np.array((y + layer.bias).astype(mx.float32))

    native_out = np.array(layer(x))
    # without the native module (not built, MLX version mismatch, MLXCHAT_QUANT=off): MLX's op, bit for bit
    with monkeypatch.context() as patch:
        patch.setattr(mq, "_native", lambda: (None, "test"))
        np.testing.assert_array_equal(np.array(layer(x)), mlx_op(layer, x))
    np.testing.assert_allclose(native_out, mlx_op(layer, x), rtol=1e-5, atol=1e-5)
    # bfloat16 activations and scales: MLX's op, bit for bit
    layer.set_dtype(mx.bfloat16)
    x16 = x.astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(layer(x16).astype(mx.float32)), mlx_op(layer, x16))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_rows_equal_mlx_dequantize_bit_for_bit(bits: int, group_size: int) -> None:
    """A quantized embedding's lookup in one node: the rows MLX's gathers and dequantize give, exactly, for ids of
    any shape (int32 or uint32), and its scales' and biases' gradients."""
    packed, scales, biases = _quantized(50, 256, group_size, bits, seed=bits)
    for ids in (mx.array([[7, 0, 49], [7, 7, 3]]), mx.array([5], dtype=mx.uint32)):
        ours = mq.dequantize_rows(packed, scales, biases, ids, group_size, bits)
        theirs = mx.dequantize(packed[ids], scales[ids], biases[ids], group_size, bits)
        assert ours.shape == (*ids.shape, 256)
        np.testing.assert_array_equal(np.array(ours), np.array(theirs))
    ids = mx.array([1, 3, 3])
    weights = mx.random.normal((3, 256))

    def loss(lookup):  # type: ignore[no-untyped-def]
        return lambda s, b: (lookup(s, b) * weights).sum()

    ours_grads = mx.grad(loss(lambda s, b: native.dequantize_rows(packed, s, b, ids, group_size, bits)), (0, 1))(
        scales, biases)
    theirs_grads = mx.grad(loss(lambda s, b: mx.dequantize(packed[ids], s[ids], b[ids], group_size, bits)), (0, 1))(
        scales, biases)
    for ours_grad, theirs_grad in zip(ours_grads, theirs_grads, strict=True):
        np.testing.assert_allclose(np.array(ours_grad), np.array(theirs_grad), rtol=1e-6, atol=1e-6)


def test_quantized_embedding_is_one_node_and_refuses_to_read_outside_its_rows() -> None:
    """The layer's lookup runs the native node (an out-of-range id, which a model never receives, gives NaNs
    rather than memory past the matrix); the output head it ties to is unchanged."""
    layer = QuantizedEmbedding.from_embedding(nn.Embedding(40, 128), 64, 4)
    ids = mx.array([[3, 39]])
    out = layer(ids)
    assert out.shape == (1, 2, 128)
    np.testing.assert_array_equal(np.array(out), np.array(nn.QuantizedEmbedding.__call__(layer, ids)))
    bad = np.array(native.dequantize_rows(layer.weight, layer.scales, layer.biases, mx.array([40, -1, 2]), 64, 4))
    assert np.isnan(bad[:2]).all() and np.isfinite(bad[2]).all()
    with pytest.raises(ValueError, match="int32 or uint32"):
        native.dequantize_rows(layer.weight, layer.scales, layer.biases, mx.array([1.0]), 64, 4)
    with pytest.raises(ValueError, match="do not match"):
        native.dequantize_rows(layer.weight, layer.scales[:, :1], layer.biases[:, :1], ids, 64, 4)


def test_runtime_info_names_the_quantized_kernels() -> None:
    info = mq.kernel_info()["quantized_kernels"]
    assert info.startswith("mlxchat native") and native.detected_isa() in info
