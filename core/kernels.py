"""Fused CPU kernels for the work MLX's CPU backend runs as many scalar, single-threaded passes.

Measured on the 2-core machine (float32, MLX 0.32.4): MLX's CPU ``exp`` takes about 16 ns a value, so in a
512-token prefill of Qwen3-0.6B shapes the SwiGLU gates (44 M sigmoids) and the softmax of attention (117 M
exponentials) cost more than every matrix product together; and on the CPU ``mx.fast.rms_norm``,
``mx.fast.rope`` and ``mx.fast.scaled_dot_product_attention`` fall back to half a dozen or more separate
operations each, so a decode step's graph holds over 4,000 of them, each with its own dispatch.
``mlxchat._kernels`` (C++ in ``core/native/``, built like ``mlxchat._quantized``) does attention in one
fused pass over float32, float16 or 4/8-bit quantized keys and values (``attention.cpp``), ``silu(g) * x`` and RMS
normalization each in one vectorized pass, rotate-half RoPE, and ``exp`` and ``silu`` alone (Qwen3.5's
DeltaNet), as MLX primitives; and, a decode step's graph being mostly small nodes (each a few microseconds to
dispatch), attention's heads from the q/k/v product (norms, RoPE, layout), a decode row's cache write and
attention, a Gated DeltaNet layer's whole decode step and a short convolution's (LFM2), one node each.

They are used when the extension was built for the running MLX, the default device is the CPU and the
arrays are float32; otherwise (a GPU, other dtypes) MLX's own operations run. Gradients, ``vmap`` and
``jvp`` go through MLX's operations (each primitive transforms the same function written in MLX's ops; RoPE
has only its gradient, the opposite rotation), so training is unchanged; ``mx.compile`` takes the
primitives as they are. Results differ from MLX's only in the order of float32 additions and in ``exp`` (a
polynomial, about 1 ulp). ``MLXCHAT_KERNELS=off`` keeps MLX's.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .cache import QuantizedKeysValues
from .extensions import kernels_extension as _native


def fused(*arrays: mx.array) -> bool:
    """Whether the kernels run for these arrays (built, on the CPU, float32)."""
    return _applies(*arrays) is not None


def _applies(*arrays: mx.array) -> ModuleType | None:
    module = _native()[0]
    if module is None or mx.default_device().type != mx.DeviceType.cpu:
        return None
    return module if all(a.dtype == mx.float32 for a in arrays) else None


KV_DTYPES = (mx.float32, mx.float16)
"""Float keys and values the attention kernel reads as they lie (float16 converted as it loads them)."""


def _attending(queries: mx.array, *held: mx.array) -> ModuleType | None:
    """The extension where it attends float32 queries over these keys and values."""
    module = _applies(queries)
    return module if all(a.dtype in KV_DTYPES for a in held) else None


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
    return {"fused_kernels": f"mlxchat native ({module.isa()}, attention on {module.attention_isas()[-1]}, "
                             f"{module.threads()} threads)"
            if module is not None else f"MLX's own ({why})"}


# -- elementwise ------------------------------------------------------------------------------------------


def silu_mul(gate: mx.array, x: mx.array | None = None) -> mx.array | None:
    """``silu(gate) * x`` in one pass, or ``None`` where the kernel does not apply (the caller's own op runs).
    Without ``x``, ``gate`` holds both, side by side on its last axis (a joined gate/up product)."""
    if x is None:
        module = _applies(gate)
        return None if module is None or gate.shape[-1] % 2 else module.silu_mul(gate)
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


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis (``mx.fast.rms_norm``); no ``weight``: none
    (Gemma's ``with_scale=False``)."""
    module = _applies(x, *(() if weight is None else (weight,)))
    if module is None or (weight is not None and weight.ndim != 1):
        return mx.fast.rms_norm(x, weight, eps)
    return module.rms_norm(x, _ones(x.shape[-1]) if weight is None else weight, eps)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=16)
def _ones(size: int) -> mx.array:
    """A weight of ones (evaluated: any thread may read it)."""
    ones = mx.ones((size,))
    mx.eval(ones)
    return ones


# -- rotary embedding ---------------------------------------------------------------------------------------


def rope(x: mx.array, inv_freq: mx.array, dims: int, offset: int | list[int]) -> mx.array | None:
    """Rotate-half RoPE of ``x [..., L, D]`` at positions ``offset ..`` over its first ``dims`` features, pair
    ``j`` turning by ``position * inv_freq[j]`` (float32, as transformers computes the angles); a list holds
    one offset per index of ``x``'s first axis (the rows of a batch, each at its own position). ``None``
    where the kernel does not apply. Its gradient is the opposite rotation (in the kernel)."""
    module = _applies(x, inv_freq)
    if module is None or x.ndim < 2:
        return None
    if isinstance(offset, int):
        return module.rope(x, inv_freq, dims, offset)  # type: ignore[no-any-return]
    if not hasattr(module, "rope_rows") or x.ndim < 3 or not offset or len(offset) != x.shape[0]:
        return None
    return module.rope_rows(x, inv_freq, dims, offset)  # type: ignore[no-any-return]


class Rotation(NamedTuple):
    """A rotate-half RoPE as the kernels take it (:meth:`mlxchat.layers.RoPE.rotation`)."""

    inv_freq: mx.array
    """``[dims / 2]`` float32: pair ``j`` turns by ``position * inv_freq[j]``."""
    dims: int
    """The features rotated (the first ones of each head)."""
    scale: float
    """Multiplies the rotated features first (yarn's attention factor; 1 for the other types)."""
    offsets: list[int]
    """The position of each row's first token: one for all rows, or one per row."""


def heads(q: mx.array, k: mx.array | None, v: mx.array | None, heads: int, kv_heads: int,
          norms: tuple[mx.array, mx.array, float] | None,
          rotation: Rotation | None, span: int = 1) -> tuple[mx.array, mx.array, mx.array] | None:
    """Attention's heads ``[B, heads, L, D]`` from its projections' outputs ``[B, L, heads * D]``, or (``k`` and
    ``v`` ``None``) from the one product ``q`` they are parts of: q and k normalized per head by ``norms`` (the q
    and k RMS norms' weights and their eps) when given, then turned by ``rotation``; v only laid out. One node
    in place of a layer's twelve (the split, reshapes, norms, transposes and rotations), the same arithmetic as
    :func:`rms_norm` then :func:`rope`. ``span`` 2: each query head's features are followed in ``q`` by as many
    others (Qwen3.5's output gate), which it skips. ``None`` where the kernel does not apply (the caller's own ops
    run)."""
    weights = list(norms[:2]) if norms is not None else []
    given = [a for a in (q, k, v) if a is not None]
    module = _applies(*given, *weights, *(() if rotation is None else (rotation.inv_freq,)))
    if module is None or not hasattr(module, "heads") or q.ndim != 3 or (k is None) != (v is None):
        return None
    if k is None and q.shape[-1] % (span * heads + 2 * kv_heads):
        return None
    turn = () if rotation is None else (rotation.inv_freq, rotation.dims, rotation.scale, rotation.offsets)
    return tuple(module.heads(q, k, v, heads, kv_heads, weights, norms[2] if norms else 0.0, *turn,  # type: ignore[return-value]
                              span=span))


# -- Gated DeltaNet ------------------------------------------------------------------------------------------


def gated_delta_step(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array,
                     conv_weight: mx.array, state: mx.array, a_log: mx.array, dt_bias: mx.array, norm: mx.array,
                     key_heads: int, q_weight: float, k_weight: float, l2_eps: float,
                     eps: float) -> tuple[mx.array, mx.array, mx.array] | None:
    """One decode step of a Gated DeltaNet layer (:class:`mlxchat.layers.GatedDeltaNet`) for ``B`` rows in one node:
    the convolution over ``conv_state [B, K-1, C]`` and ``qkv [B, 1, C]`` (``conv_weight [C, K, 1]``), SiLU, q and k
    L2-normalized (RMS norms of constant weights ``q_weight``, ``k_weight`` and ``l2_eps``), the delta rule on each
    value head's ``state [B, Hv, Dk, Dv]`` and the output's gated RMS norm (``norm``, ``eps``, times ``silu(z)``).
    Returns the output ``[B, 1, Hv * Dv]``, the next conv state and the next state (written over the old one where
    nothing else holds it); ``None`` where the kernel does not apply. Decode only: it has no gradient."""
    arrays = (qkv, z, b, a, conv_state, conv_weight, state, a_log, dt_bias, norm)
    module = _applies(*arrays)
    if (module is None or not hasattr(module, "gated_delta_step") or qkv.ndim != 3 or qkv.shape[1] != 1
            or conv_weight.ndim != 3 or conv_weight.shape[1] < 2):
        return None
    return tuple(module.gated_delta_step(*arrays, key_heads, q_weight, k_weight, l2_eps, eps))  # type: ignore[return-value]


def short_conv_step(bcx: mx.array, conv_state: mx.array, conv_weight: mx.array) -> tuple[mx.array, mx.array] | None:
    """One decode step of a gated short convolution (:class:`mlxchat.layers.ShortConv`) for ``B`` rows in one node:
    from the input projection's output ``bcx [B, 1, 3H]`` (``B | C | x``), ``C * conv(B * x)`` over the last
    ``K - 1`` values of ``B * x`` (``conv_state [B, K-1, H]``, ``conv_weight [H, K, 1]``), the same float steps as
    the layer's ops for a chunk. Returns the output ``[B, 1, H]`` and the next conv state; ``None`` where the
    kernel does not apply. Decode only: it has no gradient."""
    module = _applies(bcx, conv_state, conv_weight)
    if (module is None or not hasattr(module, "short_conv_step") or bcx.ndim != 3 or bcx.shape[1] != 1
            or conv_weight.ndim != 3 or conv_weight.shape[1] < 2):
        return None
    return tuple(module.short_conv_step(bcx, conv_state, conv_weight))  # type: ignore[return-value]


# -- attention ----------------------------------------------------------------------------------------------


def _attends(module: ModuleType | None, queries: mx.array, keys: mx.array, values: mx.array,
             prefix: tuple[mx.array, mx.array] | None = None) -> bool:
    return (module is not None and queries.ndim == keys.ndim == values.ndim == 4 and keys.shape[1] > 0
            and queries.shape[1] % keys.shape[1] == 0 and queries.shape[3] == keys.shape[3]
            and queries.shape[2] <= keys.shape[2]
            and (prefix is None or (all(a.dtype in KV_DTYPES for a in prefix)
                                    and prefix[0].ndim == prefix[1].ndim == 4
                                    and prefix[0].shape[:2] == keys.shape[:2] and prefix[0].shape[3] == keys.shape[3]
                                    and prefix[1].shape[:3] == prefix[0].shape[:3]
                                    and prefix[1].shape[3] == values.shape[3])))


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              window: int | None = None, prefix: tuple[mx.array, mx.array] | None = None) -> mx.array | None:
    """Causal attention of ``[B, heads, L, D]`` queries, the last ``L`` of the ``T`` positions, over
    ``[B, kv_heads, T, D]`` keys and values (grouped-query: query head ``h`` reads KV head
    ``h // (heads / kv_heads)``), float32 or float16; with a ``window``, each query sees only the ``window`` last
    keys up to its own. A ``prefix``'s keys and values come before them (a shared prefix: the two parts read where each
    lies). ``None`` where the kernel does not apply (the caller's MLX attention runs).

    One fused pass (online softmax over blocks of keys, split over the cores): keys and values are read once
    per block of queries, in place (a cache's used part is a view of its buffer, not copied), and the
    scratch is a block's, whatever the context.
    """
    module = _attending(queries, keys, values)
    if not _attends(module, queries, keys, values, prefix):
        return None
    assert module is not None
    return module.attention(queries, keys, values, scale, window or 0, False,  # type: ignore[no-any-return]
                            *(prefix or (None, None)))


def decode_rows(queries: mx.array, keys: mx.array, values: mx.array, buffers: list[mx.array], starts: list[int],
                scale: float, prefixes: list[mx.array] | None = None, spans: list[int] | None = None,
                lse: bool = False) -> list[mx.array] | None:
    """One decode step of ``B`` sequences' attention in one node: row ``b``'s key and value (``keys``, ``values``
    ``[B, kv_heads, 1, D]``) written at ``starts[b]`` of its cache's buffers (``buffers[2b]``, ``buffers[2b + 1]``,
    ``[1, kv_heads, capacity, D]``, of the keys' dtype: taken over in place where nothing else holds them, as a
    slice update is), its queries (``[B, heads, 1, D]``) attending over positions ``spans[2b]`` to
    ``spans[2b + 1]`` of its shared prefix (the next two of ``prefixes``, its keys and values, for each row whose
    span is not empty; read where they lie), then over their first ``starts[b] + 1`` positions; with ``lse``, each
    output row ends with its log-sum-exp (:func:`attention_parts`). Returns ``[out, *buffers]``; ``None`` where
    the kernel does not apply (an extension built before it, too). The same arithmetic as :func:`attention` per
    row, in one node instead of seven per row."""
    module = _attending(queries, keys, values, *(prefixes or ()))
    if (module is None or not hasattr(module, "decode_rows") or not _attends(module, queries, keys, values)
            or queries.shape[2] != 1 or keys.dtype != values.dtype):
        return None
    return module.decode_rows(queries, keys, values, buffers, starts, scale,  # type: ignore[no-any-return]
                              prefixes or [], spans or [], lse)


def attention_parts(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    prefix: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array] | None:
    """:func:`attention` (no window) and each query row's log-sum-exp of its scaled scores, ``[B, heads, L, 1]``:
    what merging it with attention over other keys takes (:func:`mlxchat.layers.attention.attend_shared`).
    ``None`` where the kernel does not apply."""
    module = _attending(queries, keys, values)
    if not _attends(module, queries, keys, values, prefix):
        return None
    assert module is not None
    both = module.attention(queries, keys, values, scale, 0, True, *(prefix or (None, None)))
    return both[..., :-1], both[..., -1:]


def quantized_attention(queries: mx.array, held: QuantizedKeysValues, scale: float,
                        window: int | None = None) -> mx.array | None:
    """:func:`attention` over a quantized cache's keys and values: its packed ones (4 or 8 bits, float32
    scales and biases; a shared prefix's, then its own) read and dequantized a block at a time where they lie,
    then its float tail. ``None`` where the kernel does not apply."""
    if not held.packed:
        return attention(queries, held.keys, held.values, scale, window)
    *shared, ((packed_keys, key_scales, key_biases), (packed_values, value_scales, value_biases)) = held.packed
    scales = [a for part in held.packed for x in part for a in x[1:]]
    module = _attending(queries, held.keys, held.values) if all(a.dtype == mx.float32 for a in scales) else None
    if held.bits not in (4, 8) or not _attends(module, queries, held.keys, held.values):
        return None
    assert module is not None
    return module.quantized_attention(  # type: ignore[no-any-return]
        queries, packed_keys, key_scales, key_biases, packed_values, value_scales, value_biases, held.keys,
        held.values, scale, window or 0, held.bits, held.group_size, [a for part in shared for x in part for a in x])
