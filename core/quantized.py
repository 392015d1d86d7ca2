"""Quantized matmuls: mlxchat's native CPU kernels where they apply, MLX's own ops everywhere else.

MLX's CPU kernel for ``quantized_matmul`` runs on one thread and reads packed weights at 1-2 GB/s, so on a
Linux CPU an MLX-quantized checkpoint would decode slower than float32. ``mlxchat._quantized`` (built by
setup.py against MLX's headers; C++ in ``core/native``) adds the same products as MLX primitives: nodes of
the lazy graph like any other (they work under ``mx.compile`` and give ``x`` a gradient) whose CPU kernels
use every core and read 4- and 8-bit weights near memory bandwidth. They are used when all of these hold,
and MLX's ``quantized_matmul`` / ``gather_qmm`` otherwise (on a GPU always):

- the extension was built, for the MLX version that runs (its C++ interface is not stable across versions);
- the default device is the CPU;
- affine mode, 2, 3, 4, 5, 6 or 8 bits, group size 32, 64 or 128 (MLX's own choices);
- float32 activations, scales and biases (mlxchat computes in float32 on a CPU by default).

The same extension gives float32 experts (``gather_matmul``) one sgemm per expert instead of MLX's CPU
``gather_mm``, which multiplies every row alone, and a quantized embedding's lookup (``dequantize_rows``) one
node where MLX's CPU backend runs some fifty (bit for bit the same rows).

``MLXCHAT_QUANT=off`` keeps MLX's kernels. Results equal MLX's up to the order of float32 additions, unless
8-bit activations are switched on (:func:`set_int8_activations`, or ``MLXCHAT_QUANT_INT8=1``; taken when a
product is built): then products with at least 4 rows of ``x`` (``mlxchat._quantized.set_int8_rows``; a
prompt's prefill, a batched step of 4 or more generations, a speculative check of 3 or more drafted tokens, an
expert's share of a prompt) round each group of ``x`` to 8-bit integers and multiply them by the packed weights
as integers (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw), as llama.cpp's quantized products do: prefill about
twice as fast (AVX-512 VNNI), outputs off by ~1e-3 relative. A single generation's decode steps keep float ``x``,
so its follow-up turns match a stateless run to that precision rather than to float32's, and a step's results
then depend on how many rows it holds.

Tuning (rarely needed): ``MLXCHAT_QUANT_THREADS`` (default: the cores this process may use),
``MLXCHAT_QUANT_SPIN_US`` (how long idle workers spin before sleeping, default 50: longer helps a quiet
machine a little and hurts a shared one a lot) and
``MLXCHAT_QUANT_TILE`` (float32 values dequantized per sgemm call for many rows, default 2**20) and, on CPUs
with AMX, ``MLXCHAT_QUANT_AMX_ROWS`` (products with at least this many rows of x go through AMX tiles,
default 3).
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType
from typing import Any

import mlx.core as mx

from .extensions import load_extension

_BITS = (2, 3, 4, 5, 6, 8)
_GROUP_SIZES = (32, 64, 128)
_int8 = os.environ.get("MLXCHAT_QUANT_INT8", "") == "1"


def set_int8_activations(on: bool) -> None:
    """Round ``x`` to 8 bits in the quantized products built from now on, where they have many rows (see the
    module's docstring); a no-op on CPUs without AVX2."""
    global _int8
    _int8 = bool(on)


def int8_activations() -> bool:
    """Whether quantized products built now round many rows of ``x`` to 8 bits (and this CPU can)."""
    module = _native()[0]
    return _int8 and module is not None and bool(module.int8_kernel())


@cache
def _native() -> tuple[ModuleType | None, str]:
    """The extension module, or None and why it is not used."""
    module, why = load_extension("_quantized", "MLXCHAT_QUANT")
    if module is None:
        return None, why
    try:  # builds a graph node only: proves that mx.array crosses into the extension
        module.quantized_matmul(mx.zeros((1, 32)), mx.zeros((1, 4), mx.uint32), mx.zeros((1, 1)), mx.zeros((1, 1)),
                                32, 4)
    except TypeError as exc:
        return None, f"native kernels do not accept this MLX's arrays ({exc})"
    return module, ""


def _applies(x: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str) -> ModuleType | None:
    module = _native()[0]
    if (
        module is None
        or biases is None
        or mode != "affine"
        or bits not in _BITS
        or group_size not in _GROUP_SIZES
        or not x.dtype == scales.dtype == biases.dtype == mx.float32
        or mx.default_device().type != mx.DeviceType.cpu
    ):
        return None
    return module


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
                     bits: int, mode: str = "affine") -> mx.array:
    """``x @ dequantize(w).T``: ``mx.quantized_matmul(..., transpose=True)``."""
    module = _applies(x, scales, biases, group_size, bits, mode)
    if module is not None:
        return module.quantized_matmul(x, w, scales, biases, group_size, bits, _int8)  # type: ignore[no-any-return]
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode)


def gather_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                            indices: mx.array, group_size: int, bits: int, mode: str = "affine",
                            sorted_indices: bool = False) -> mx.array:
    """``x @ dequantize(w[indices]).T`` per expert index: ``mx.gather_qmm(..., rhs_indices=indices,
    transpose=True)`` (the native kernel groups rows by expert itself, sorted or not)."""
    module = _applies(x, scales, biases, group_size, bits, mode)
    if module is not None:
        return module.gather_quantized_matmul(x, w, scales, biases, indices, group_size, bits,  # type: ignore[no-any-return]
                                              _int8)
    return mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=group_size, bits=bits,
                         mode=mode, sorted_indices=sorted_indices)


def dequantize_rows(w: mx.array, scales: mx.array, biases: mx.array | None, indices: mx.array, group_size: int,
                    bits: int, mode: str = "affine") -> mx.array:
    """Rows ``indices`` of a quantized matrix as floats, ``mx.dequantize(w[indices], scales[indices],
    biases[indices])``: a quantized embedding's lookup, one native node (MLX's CPU backend spells the dequantize
    as some fifty operations for one token)."""
    module = _applies(scales, scales, biases, group_size, bits, mode)
    if module is not None and indices.dtype in (mx.int32, mx.uint32):
        return module.dequantize_rows(w, scales, biases, indices, group_size, bits)  # type: ignore[no-any-return]
    return mx.dequantize(w[indices], scales=scales[indices], biases=biases[indices] if biases is not None else None,
                         group_size=group_size, bits=bits, mode=mode)


def _gathers(x: mx.array, w: mx.array) -> ModuleType | None:
    module = _native()[0]
    if (
        module is None
        or not x.dtype == w.dtype == mx.float32
        or mx.default_device().type != mx.DeviceType.cpu
        or not module.has_sgemm()
    ):
        return None
    return module


def gathers_rows(x: mx.array, w: mx.array, scales: mx.array | None = None, biases: mx.array | None = None,
                 group_size: int = 64, bits: int = 4, mode: str = "affine") -> bool:
    """Whether the gathered product of ``x`` with experts ``w`` (quantized when ``scales`` is given) runs on
    the native kernels, which order the rows by expert themselves (sorting them first only costs)."""
    if scales is None:
        return _gathers(x, w) is not None
    return _applies(x, scales, biases, group_size, bits, mode) is not None


def gather_matmul(x: mx.array, w: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    """``x @ w[indices].T`` per expert index for float experts ``w [E, out, in]``: ``mx.gather_mm(x,
    w.swapaxes(-1, -2), rhs_indices=indices)``. MLX's CPU kernel multiplies every row alone (a matrix-vector
    product per row and expert); the native one gives each expert's rows one sgemm."""
    module = _gathers(x, w)
    if module is not None:
        return module.gather_matmul(x, w, indices)  # type: ignore[no-any-return]
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


def kernel_info() -> dict[str, Any]:
    """What quantized layers run on here (for :func:`mlxchat.runtime_info`)."""
    module, why = _native()
    if module is None:
        return {"quantized_kernels": f"MLX's own ({why})"}
    x = f", 8-bit x on {module.int8_kernel()} from {module.int8_rows()} rows" if int8_activations() else ""
    return {"quantized_kernels": f"mlxchat native ({module.isa()}{x}, {module.threads()} threads)"}
