"""Fused CPU kernels for the work MLX's CPU backend runs as many scalar, single-threaded passes.

Measured on the 2-core machine (float32, MLX 0.32.4): MLX's CPU ``exp`` takes about 16 ns a value, so in a
512-token prefill of Qwen3-0.6B shapes the SwiGLU gates (44 M sigmoids) and the softmax of attention (117 M
exponentials) cost more than every matrix product together; and on the CPU ``mx.fast.rms_norm``,
``mx.fast.rope`` and ``mx.fast.scaled_dot_product_attention`` fall back to half a dozen or more separate
operations each, so a decode step's graph holds over 4,000 of them, each with its own dispatch.
``mlxchat._kernels`` (C++ in ``core/native/kernels.cpp``, built like ``mlxchat._quantized``) does the
softmax of attention (the causal mask applied as it goes), ``silu(g) * x`` and RMS normalization each in
one vectorized pass, rotate-half RoPE, and ``exp`` and ``silu`` alone (Qwen3.5's DeltaNet), as MLX
primitives.

They are used when the extension was built for the running MLX, the default device is the CPU and the
arrays are float32; otherwise (a GPU, other dtypes) MLX's own operations run. Gradients go through MLX's
operations (each primitive differentiates the same function written in MLX's ops; RoPE by the opposite
rotation), so training is unchanged. Results differ from MLX's only in the
order of float32 additions and in ``exp`` (a polynomial, about 1 ulp). ``MLXCHAT_KERNELS=off`` keeps MLX's.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@cache
def _native() -> tuple[ModuleType | None, str]:
    """The extension module, or None and why it is not used."""
    if os.environ.get("MLXCHAT_KERNELS", "").lower() in ("off", "0"):
        return None, "MLXCHAT_KERNELS=off"
    try:
        module = importlib.import_module("mlxchat._kernels")
    except ImportError as exc:
        return None, f"not built ({exc})"
    running = ".".join(mx.__version__.split(".")[:3])  # type: ignore[attr-defined]
    if module.mlx_version() != running:
        return None, f"built for MLX {module.mlx_version()}, running {running}"
    return module, ""


def fused(*arrays: mx.array) -> bool:
    """Whether the kernels run for these arrays (built, on the CPU, float32)."""
    return _applies(*arrays) is not None


def _applies(*arrays: mx.array) -> ModuleType | None:
    module = _native()[0]
    if module is None or mx.default_device().type != mx.DeviceType.cpu:
        return None
    return module if all(a.dtype == mx.float32 for a in arrays) else None


def flush_denormals() -> bool:
    """Flush denormal floats to zero on this thread's default CPU stream (once, on a model's worker): on x86
    a denormal operand costs about a hundred cycles, and a DeltaNet chunk's decays (exp of cumulative
    log-decays) reach them routinely. Values below 1.2e-38 become 0; nothing else changes. False where it
    does not apply."""
    module = _native()[0]
    if module is None or mx.default_device().type != mx.DeviceType.cpu:
        return False
    flag = module.flush_denormals()
    mx.eval(flag)
    return bool(flag.item())


def kernel_info() -> dict[str, Any]:
    """What the fused kernels run on here (for :func:`mlxchat.runtime_info`)."""
    module, why = _native()
    return {"fused_kernels": f"mlxchat native ({module.isa()})" if module is not None else f"MLX's own ({why})"}


# -- elementwise ------------------------------------------------------------------------------------------


def silu_mul(gate: mx.array, x: mx.array) -> mx.array | None:
    """``silu(gate) * x`` in one pass, or ``None`` where the kernel does not apply (the caller's own op runs)."""
    module = _applies(gate, x)
    if module is None or gate.shape != x.shape:
        return None
    return module.silu_mul(gate, x)  # type: ignore[no-any-return]


def exp(x: mx.array) -> mx.array:
    """``mx.exp``, vectorized on a CPU (float32)."""
    module = _applies(x)
    return mx.exp(x) if module is None else module.exp(x)


def silu(x: mx.array) -> mx.array:
    """``x * sigmoid(x)``, vectorized on a CPU (float32)."""
    module = _applies(x)
    return nn.silu(x) if module is None else module.silu(x)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis (``mx.fast.rms_norm``)."""
    module = _applies(x, weight)
    if module is None or weight.ndim != 1:
        return mx.fast.rms_norm(x, weight, eps)
    return module.rms_norm(x, weight, eps)  # type: ignore[no-any-return]


# -- rotary embedding ---------------------------------------------------------------------------------------


def rope(x: mx.array, inv_freq: mx.array, dims: int, offset: int) -> mx.array | None:
    """Rotate-half RoPE of ``x [..., L, D]`` at positions ``offset ..`` over its first ``dims`` features, pair
    ``j`` turning by ``position * inv_freq[j]`` (float32, as transformers computes the angles); ``None``
    where the kernel does not apply. Its gradient is the opposite rotation (in the kernel)."""
    module = _applies(x, inv_freq)
    if module is None or x.ndim < 2:
        return None
    return module.rope(x, inv_freq, dims, offset)  # type: ignore[no-any-return]


# -- attention ----------------------------------------------------------------------------------------------


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool) -> mx.array | None:
    """Attention of ``[B, heads, L, D]`` queries over ``[B, kv_heads, T, D]`` keys and values (grouped-query:
    query head ``h`` reads key head ``h // (heads / kv_heads)``), causal over the last ``L`` keys or over all
    of them; ``None`` where the kernel does not apply (the caller's ``mx.fast`` attention runs).

    The two products go to the BLAS; the softmax between them, masked as it goes, is one pass.
    """
    if _applies(queries, keys, values) is None:
        return None
    batch, heads, length, dims = queries.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        return None
    module = _applies(queries, keys, values)
    assert module is not None
    grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads * length, dims)
    scores = grouped @ keys.swapaxes(-1, -2)  # [B, kv_heads, group * L, T]
    probs = module.softmax(scores, length if causal and length > 1 else 0)
    return (probs @ values).reshape(batch, heads, length, values.shape[-1])  # type: ignore[no-any-return]
