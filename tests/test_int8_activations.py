"""Quantized products with 8-bit x (``mlxchat.quantized.set_int8_activations``; AVX-512 VNNI or AVX2): each group
of a row of ``x`` is rounded to int8 against its largest magnitude and multiplied by the packed weights as
integers. The oracle is that arithmetic written in numpy (the rounded ``x`` times the dequantized weights, in
float64): the kernel must equal it up to float32 rounding, whatever the width, group size, shape, or the other
rows computed with it; a 4-bit model's logits stay close to float ``x``'s; with the setting off nothing changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from int8_support import oracle

import mlxchat.quantized as mq
from mlxchat.layers.quantized import quantize
from mlxchat.registry import registry

native = pytest.importorskip("mlxchat._quantized", reason="native quantized kernels not built here")
ORDER = ["scalar", "avx2", "avx512", "amx"]
ISAS = [isa for isa in ("avx2", "avx512") if isa in ORDER[: ORDER.index(native.detected_isa()) + 1]]
pytestmark = pytest.mark.skipif(not ISAS, reason="8-bit x needs AVX2")

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True, params=ISAS)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every integer kernel this CPU has: AVX2's (vpmaddubsw), and AVX-512 VNNI's (vpdpbusd) where it has it."""
    native.set_isa(request.param)
    yield native.int8_kernel()
    native.set_isa(native.detected_isa())


@pytest.fixture
def every_row() -> Iterator[None]:
    """8-bit x from one row up (the default keeps float x below int8_rows())."""
    rows = native.int8_rows()
    native.set_int8_rows(1)
    yield
    native.set_int8_rows(rows)


def _quantized(n: int, k: int, group_size: int, bits: int, experts: int | None = None, seed: int = 0):  # type: ignore[no-untyped-def]
    mx.random.seed(seed)
    w = mx.random.normal((n, k) if experts is None else (experts, n, k)) * 0.5
    return mx.quantize(w, group_size, bits)


def _oracle(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, group_size: int,
            bits: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.array(mx.dequantize(packed, scales, biases, group_size, bits), dtype=np.float64)
    return oracle(np.array(x), w, group_size)


def _assert_equals_oracle(ours: mx.array, expected: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(np.array(ours, dtype=np.float64) - expected)
    assert (err <= 1e-5 * bound + 1e-6).all(), f"max error {err.max():.2e}, relative {(err / bound).max():.2e}"


# rows of x (tiles of 12, the last padded), outputs (blocks of 16, a partial last), inputs, group size
SHAPES = [(8, 37, 96, 32), (13, 300, 320, 64), (40, 129, 448, 64), (25, 257, 384, 128), (12, 16, 1024, 128),
          (1, 5, 64, 64)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m,n,k,group_size", SHAPES, ids=lambda v: str(v))
def test_products_equal_the_rounded_x_times_the_dequantized_weights(every_row: None, bits: int, m: int, n: int,
                                                                     k: int, group_size: int) -> None:
    packed, scales, biases = _quantized(n, k, group_size, bits, seed=m + n)
    x = mx.random.normal((m, k)) * 3
    ours = native.quantized_matmul(x, packed, scales, biases, group_size, bits, True)
    _assert_equals_oracle(ours, *_oracle(x, packed, scales, biases, group_size, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_rounding_moves_outputs_by_about_a_thousandth(bits: int) -> None:
    """What 8-bit x costs against float x (a Gaussian x; measured ~2e-3 of the largest output at most)."""
    packed, scales, biases = _quantized(256, 1024, 64, bits)
    x = mx.random.normal((48, 1024))
    exact = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=bits)
    rounded = native.quantized_matmul(x, packed, scales, biases, 64, bits, True)
    scale = float(mx.abs(exact).max())
    error = float(mx.abs(rounded - exact).max()) / scale
    assert 1e-5 < error < 1e-2


def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it(every_row: None) -> None:
    """The integer sums are exact and a row's float steps its own: any subset of rows gives the same bits."""
    packed, scales, biases = _quantized(70, 256, 64, 4)
    x = mx.random.normal((40, 256))
    every = np.array(native.quantized_matmul(x, packed, scales, biases, 64, 4, True))
    for start, stop in ((0, 1), (3, 17), (12, 24), (39, 40)):
        part = np.array(native.quantized_matmul(x[start:stop], packed, scales, biases, 64, 4, True))
        np.testing.assert_array_equal(part, every[start:stop])


def test_non_finite_groups_give_nan_and_tiny_ones_round_to_zero(every_row: None) -> None:
    packed, scales, biases = _quantized(20, 128, 64, 4)
    x = np.array(mx.random.normal((4, 128)))
    x[0, 5], x[1, 70], x[2, :] = np.inf, np.nan, 1e-37
    ours = np.array(native.quantized_matmul(mx.array(x), packed, scales, biases, 64, 4, True))
    assert np.isnan(ours[0]).all() and np.isnan(ours[1]).all()
    assert np.isfinite(ours[2:]).all() and np.abs(ours[2]).max() < 1e-30
    expected, bound = _oracle(mx.array(x[3:]), packed, scales, biases, 64, 4)
    _assert_equals_oracle(mx.array(ours[3:]), expected, bound)


def test_huge_finite_groups_stay_finite_and_no_outputs_is_fine(every_row: None) -> None:
    packed, scales, biases = _quantized(20, 64, 32, 4)
    x = mx.full((2, 64), 2e37)  # a group's sum would overflow float32; its product with weights of ~0.5 does not
    ours = native.quantized_matmul(x, packed * 0, scales * 1e-3, biases * 1e-3, 32, 4, True)
    assert np.isfinite(np.array(ours)).all()
    empty = native.quantized_matmul(mx.random.normal((16, 64)), packed[:0], scales[:0], biases[:0], 32, 4, True)
    assert empty.shape == (16, 0)


def test_experts_with_few_rows_keep_float_x_beside_those_with_many() -> None:
    """Whether a product takes 8-bit x is decided per expert: its own rows against int8_rows()."""
    packed, scales, biases = _quantized(40, 128, 64, 4, experts=3)
    few = native.int8_rows() - 1
    indices = mx.array([0] * few + [1] * 20 + [2] * few, dtype=mx.int32)  # experts 0 and 2: few rows
    x = mx.random.normal((indices.size, 1, 128))
    ours = np.array(native.gather_quantized_matmul(x, packed, scales, biases, indices, 64, 4, True))
    theirs = np.array(mx.gather_qmm(x, packed, scales, biases, rhs_indices=indices, transpose=True, group_size=64,
                                    bits=4))
    float_rows = np.r_[0:few, few + 20:2 * few + 20]
    np.testing.assert_allclose(ours[float_rows], theirs[float_rows], rtol=1e-5, atol=1e-5)
    expected, bound = _oracle(x[few:few + 20, 0], packed[1], scales[1], biases[1], 64, 4)
    _assert_equals_oracle(mx.array(ours[few:few + 20, 0]), expected, bound)


@pytest.mark.parametrize("bits", [4, 8])
def test_gathered_experts_round_x_too(every_row: None, bits: int) -> None:
    packed, scales, biases = _quantized(48, 256, 64, bits, experts=4)
    x = mx.random.normal((30, 1, 1, 256))  # 30 tokens, each through 2 experts
    indices = mx.array(np.random.default_rng(0).integers(0, 4, size=(30, 2)).astype(np.int32))
    ours = np.array(native.gather_quantized_matmul(x, packed, scales, biases, indices, 64, bits, True))
    for t in range(30):
        for j in range(2):
            e = int(indices[t, j])
            expected, bound = _oracle(x[t, 0], packed[e], scales[e], biases[e], 64, bits)
            _assert_equals_oracle(mx.array(ours[t, j]), expected, bound)


def test_few_rows_keep_float_x() -> None:
    """Below int8_rows() rows (decode steps), x stays float32: MLX's result to float32 rounding."""
    packed, scales, biases = _quantized(64, 256, 64, 4)
    x = mx.random.normal((native.int8_rows() - 1, 256))
    ours = native.quantized_matmul(x, packed, scales, biases, 64, 4, True)
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


def test_the_setting_is_taken_when_the_product_is_built() -> None:
    packed, scales, biases = _quantized(64, 256, 64, 4)
    x = mx.random.normal((32, 256))
    assert not mq.int8_activations()  # off unless asked for
    try:
        mq.set_int8_activations(True)
        assert mq.int8_activations()
        rounded = mq.quantized_matmul(x, packed, scales, biases, 64, 4)
    finally:
        mq.set_int8_activations(False)
    plain = mq.quantized_matmul(x, packed, scales, biases, 64, 4)
    expected, bound = _oracle(x, packed, scales, biases, 64, 4)
    _assert_equals_oracle(rounded, expected, bound)  # evaluated after the setting went off
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)
    np.testing.assert_allclose(np.array(plain), np.array(theirs), rtol=1e-5, atol=1e-5)


def test_a_4bit_models_prompt_logits_stay_close_to_float_x() -> None:
    """The fixture Qwen3 (random weights) quantized to 4 bits: 8-bit x moves its prompt's logits by a small
    fraction of their spread (measured: 3% of their standard deviation at most) and keeps the top tokens."""
    config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    arch = registry().architecture_for_config(config)
    module = arch.model_class(arch.config_class.from_hf(config))
    mx.random.seed(0)
    module.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.1, module.parameters()))
    quantize(module, lambda path, layer: {"bits": 4, "group_size": 32} if isinstance(layer, nn.Linear) else False)
    ids = mx.array(np.random.default_rng(1).integers(0, config["vocab_size"], size=(1, 48)).astype(np.int32))
    plain = np.array(module(ids)[0])
    try:
        mq.set_int8_activations(True)
        rounded = np.array(module(ids)[0])
    finally:
        mq.set_int8_activations(False)
    assert 0 < np.abs(rounded - plain).max() < 0.1 * plain.std()
    assert (rounded.argmax(-1) == plain.argmax(-1)).mean() >= 0.9
