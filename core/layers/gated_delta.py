"""Gated DeltaNet, the linear attention of Qwen3.5's ``linear_attention`` layers.

Each value head keeps a state ``S [Dk, Dv]`` that every token decays, corrects and reads::

    S = exp(g_t) * S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Decoding one token runs this recurrence directly. A prompt runs the equivalent chunked form (as
transformers does): inside a chunk the delta-rule corrections are one unit-lower-triangular solve and a
few batched matmuls, and only the state is carried from chunk to chunk, so there is no Python loop over
tokens. Both forms continue from the cached state, so any split of a prompt into calls gives the same
result. The state is float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from functools import partial
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache import RaggedRows, RowCaches, StateCache, each_sequence
from .fused import Projections
from .parallel import RowParallelLinear, head_split, slice_outputs

CHUNK_SIZE = 64
L2_EPS = 1e-6


def l2_normalize(x: mx.array, scale: float = 1.0) -> mx.array:
    """``scale * x / sqrt(sum(x^2) + 1e-6)`` over the last axis, as one fused RMS norm.

    ``rms_norm`` divides by ``sqrt(mean(x^2) + eps)``: with ``eps = 1e-6 / D`` that is the L2 norm over
    ``sqrt(D)``, which the weight folds back in together with ``scale``.
    """
    dims = x.shape[-1]
    weight = mx.full((dims,), scale / math.sqrt(dims), dtype=x.dtype)
    return kernels.rms_norm(x, weight, L2_EPS / dims)


@partial(mx.compile, shapeless=True)
def log_decay(a_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """Per-token log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32, at most 0)."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    softplus = mx.logaddexp(a, mx.zeros_like(a))
    return -mx.exp(a_log.astype(mx.float32)) * softplus


def causal_conv_silu(window: mx.array, weight: mx.array) -> mx.array:
    """``silu`` of a depthwise causal convolution: ``window [B, K-1+L, C]`` and ``weight [K, C]`` give
    ``[B, L, C]``.

    The taps are shifted views of the window, summed in one fused pass (a grouped ``conv1d`` runs channel
    by channel on the CPU).
    """
    kernel = weight.shape[0]
    length = window.shape[1] - kernel + 1
    shifted = [window[:, i : i + length] for i in range(kernel)]
    taps = [weight[i] for i in range(kernel)]  # sliced here: a slice traced into a shapeless compile keeps its size
    if kernels.fused(window, weight):  # MLX's CPU sigmoid is scalar: the silu runs vectorized on its own
        return kernels.silu(_taps(shifted, taps))
    return _taps_silu(shifted, taps)


@partial(mx.compile, shapeless=True)
def _taps(shifted: list[mx.array], taps: list[mx.array]) -> mx.array:
    out = shifted[0] * taps[0]
    for i in range(1, len(shifted)):
        out = out + shifted[i] * taps[i]
    return out


@partial(mx.compile, shapeless=True)
def _taps_silu(shifted: list[mx.array], taps: list[mx.array]) -> mx.array:
    out = _taps(shifted, taps)
    return out * mx.sigmoid(out)


def _triangles(size: int) -> tuple[mx.array, mx.array]:
    """Masks of the lower triangle (diagonal included) and of the diagonal of a ``size`` square."""
    rows, cols = mx.arange(size)[:, None], mx.arange(size)[None, :]
    return rows >= cols, rows == cols


def _intra_chunk(gamma: mx.array, beta: mx.array, kk: mx.array, qk: mx.array, lower: mx.array,
                 diagonal: mx.array) -> tuple[mx.array, mx.array]:
    """Per-chunk matrices from cumulative log-decays ``gamma [..., C]`` and ``kk = K K^T``, ``qk = Q K^T``:

    - ``system``: ``I + strictly_lower(beta_i (k_i . k_j) exp(gamma_i - gamma_j))``, whose inverse turns
      the sequential delta-rule corrections of a chunk into one product;
    - ``attn``: ``lower(q_i . k_j exp(gamma_i - gamma_j))``, the causal read inside the chunk.
    """
    decay = kernels.exp(_log_decay_between(gamma, lower))  # vectorized on a CPU (MLX's exp is scalar there)
    return _decayed(decay, beta, kk, qk, diagonal)


@partial(mx.compile, shapeless=True)
def _log_decay_between(gamma: mx.array, lower: mx.array) -> mx.array:
    return mx.where(lower, gamma[..., :, None] - gamma[..., None, :], -mx.inf)


@partial(mx.compile, shapeless=True)
def _decayed(decay: mx.array, beta: mx.array, kk: mx.array, qk: mx.array,
             diagonal: mx.array) -> tuple[mx.array, mx.array]:
    system = mx.where(diagonal, 1.0, kk * decay * beta[..., :, None])
    return system, qk * decay


@partial(mx.compile, shapeless=True)
def _weighted_solution(inverse: mx.array, beta: mx.array, gamma: mx.array) -> tuple[mx.array, mx.array]:
    """``T diag(beta)`` and ``T diag(beta exp(gamma))``: multiplied by V and K they give the chunk's
    corrected values and the keys that read the incoming state."""
    tb = inverse * beta[..., None, :]
    return tb, tb * mx.exp(gamma)[..., None, :]


@mx.custom_function
def _lower_inverse(system: mx.array) -> mx.array:
    """The inverse of lower-triangular matrices, with a gradient (MLX's ``tri_inv``, LAPACK, on the CPU only, has
    none; training needs it)."""
    return mx.linalg.tri_inv(system, upper=False, stream=mx.cpu)


@_lower_inverse.vjp
def _lower_inverse_vjp(primals: tuple[mx.array], cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    """``d(A^-1) = -A^-1 dA A^-1``: the gradient of ``A`` is ``-A^-T G A^-T``, kept on ``A``'s lower triangle."""
    inverse_t = output.swapaxes(-1, -2)
    return (mx.tril(-(inverse_t @ cotangent @ inverse_t)),)


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a whole sequence, chunk by chunk.

    ``q, k [B, H, L, Dk]`` (normalised, ``q`` scaled), ``v [B, H, L, Dv]``, log-decay ``g`` and ``beta``
    ``[B, H, L]``, all float32; ``state [B, H, Dk, Dv]`` or ``None`` for zeros. Returns the outputs
    ``[B, H, L, Dv]`` and the final state.
    """
    batch, heads, length, k_dim = k.shape
    v_dim = v.shape[-1]
    size = min(chunk_size, length)
    chunks = -(-length // size)
    pad = chunks * size - length
    if pad:
        # Zero keys, values, beta and log-decay leave the state untouched and the real outputs unchanged.
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    q = q.reshape(batch, heads, chunks, size, k_dim)
    k = k.reshape(batch, heads, chunks, size, k_dim)
    v = v.reshape(batch, heads, chunks, size, v_dim)
    gamma = mx.cumsum(g.reshape(batch, heads, chunks, size), axis=-1)
    beta = beta.reshape(batch, heads, chunks, size)

    k_t = k.swapaxes(-1, -2)
    system, attn = _intra_chunk(gamma, beta, k @ k_t, q @ k_t, *_triangles(size))
    inverse = cast(mx.array, _lower_inverse(system))
    tb, tbe = _weighted_solution(inverse, beta, gamma)
    values = tb @ v  # what the chunk writes if the incoming state were zero
    readers = tbe @ k  # the keys through which the incoming state enters those values
    last = gamma[..., -1:]
    q_decayed = q * mx.exp(gamma)[..., None]
    k_decayed = (k * mx.exp(last - gamma)[..., None]).swapaxes(-1, -2)
    chunk_decay = mx.exp(last)[..., None]

    outputs, first = [], 0
    if state is None:  # nothing to read or decay: the first chunk stands alone
        outputs.append(attn[:, :, 0] @ values[:, :, 0])
        state, first = k_decayed[:, :, 0] @ values[:, :, 0], 1
    for c in range(first, chunks):
        corrected = mx.addmm(values[:, :, c], readers[:, :, c], state, alpha=-1.0)
        outputs.append(mx.addmm(attn[:, :, c] @ corrected, q_decayed[:, :, c], state))
        state = mx.addmm(state * chunk_decay[:, :, c], k_decayed[:, :, c], corrected)
    out = mx.concatenate(outputs, axis=2) if chunks > 1 else outputs[0]
    return out[:, :, :length], state


def gated_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of the recurrence: ``q, k [B, H, Dk]``, ``v [B, H, Dv]``, ``g, beta [B, H]``,
    ``state [B, H, Dk, Dv]``. Returns ``o [B, H, Dv]`` and the new state.

    The state is read by two matrix-vector products and rewritten in one fused pass.
    """
    decay = mx.exp(g)[..., None]
    recalled = decay * (k[..., None, :] @ state)[..., 0, :]
    delta = (v - recalled) * beta[..., None]
    state = _decay_and_write(state, decay[..., None], k[..., :, None], delta[..., None, :])
    return (q[..., None, :] @ state)[..., 0, :], state


@partial(mx.compile, shapeless=True)
def _decay_and_write(state: mx.array, decay: mx.array, k: mx.array, delta: mx.array) -> mx.array:
    return state * decay + k * delta


class RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over the last axis (plain ``weight``, stored around 1)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = kernels.rms_norm(x, self.weight, self.eps)
        fused = kernels.silu_mul(gate, normed) if gate.dtype == normed.dtype else None
        return fused if fused is not None else _gate_silu(normed, gate)


@partial(mx.compile, shapeless=True)
def _gate_silu(x: mx.array, gate: mx.array) -> mx.array:
    gate = gate.astype(mx.float32)
    return (x * (gate * mx.sigmoid(gate))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet mixer: projections, causal depthwise conv over ``[q | k | v]``, the gated delta
    rule, a gated RMSNorm and the output projection. Attribute names are the checkpoint's; the four input
    projections run as one product once loaded (:mod:`mlxchat.layers.fused`).

    Cache: a :class:`~mlxchat.cache.StateCache` of two arrays, the last ``K-1`` conv inputs ``[B, K-1, C]``
    and the delta-rule state ``[B, Hv, Dk, Dv]`` (float32). ``conv1d.weight`` is ``[C, K, 1]`` (MLX layout).
    """

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        chunk_size: int = CHUNK_SIZE,
    ):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_key_heads})")
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.key_dim = num_key_heads * key_head_dim
        self.value_dim = num_value_heads * value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = mx.zeros((num_value_heads,))
        self.dt_bias = mx.ones((num_value_heads,))
        self.norm = RMSNormGated(value_head_dim, eps)
        self.out_proj: nn.Module = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._in = Projections("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __call__(self, x: mx.array, cache: StateCache | RaggedRows | None = None) -> mx.array:
        qkv, z, b, a = self._in(self, x)
        return self.out_proj(each_sequence(self._mix, cache, qkv, z, b, a, axis=1))  # each from its own state

    def _mix(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
             cache: StateCache | RowCaches | None) -> mx.array:
        """One sequence's (or a batch of decode rows') gated, normalized heads ``[B, L, value_dim]``: a decode step
        in one node where it applies, otherwise the convolution, the delta rule and the gated norm as ops."""
        batch, length, _ = qkv.shape
        stepped = self._step(qkv, z, b, a, cache) if length == 1 else None
        if stepped is not None:
            return stepped
        out = self._recur(qkv, b, a, cache)
        z = z.reshape(batch, length, self.num_value_heads, self.value_head_dim)
        return self.norm(out.astype(qkv.dtype), z).reshape(batch, length, self.value_dim)

    def _step(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
              cache: StateCache | RowCaches | None) -> mx.array | None:
        """A decode step from ``cache``'s state in one node (:func:`mlxchat.kernels.gated_delta_step`: the
        convolution, the delta rule and the gated norm, the state rewritten in place) where it applies: the
        output projection's input ``[B, 1, value_dim]``."""
        held = (cache[0], cache[1]) if cache is not None else (None, None)
        if held[0] is None or held[1] is None or type(self.norm) is not RMSNormGated:
            return None
        dims = self.key_head_dim
        made = kernels.gated_delta_step(qkv, z, b, a, held[0], self.conv1d.weight, held[1], self.A_log,
                                        self.dt_bias, self.norm.weight, self.num_key_heads,
                                        dims**-0.5 / math.sqrt(dims), 1.0 / math.sqrt(dims), L2_EPS / dims,
                                        self.norm.eps)
        if made is None:
            return None
        assert cache is not None
        out, conv_state, state = made
        cache.update(conv_state, state, tokens=1)
        return out

    def _recur(self, qkv: mx.array, b: mx.array, a: mx.array, cache: StateCache | RowCaches | None) -> mx.array:
        """The convolution and the delta rule of one sequence (or a batch of decode rows) from ``cache``'s
        state: the heads' outputs ``[B, L, Hv, Dv]`` (float32)."""
        batch, length, _ = qkv.shape
        conv_state = cache[0] if cache is not None else None
        if conv_state is None:
            conv_state = mx.zeros((batch, self.conv_kernel - 1, self.conv_dim), qkv.dtype)
        window = mx.concatenate([conv_state, qkv], axis=1)
        mixed = causal_conv_silu(window, self.conv1d.weight[:, :, 0].T)

        heads, group = self.num_value_heads, self.num_value_heads // self.num_key_heads
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(batch, length, self.num_key_heads, self.key_head_dim).astype(mx.float32),
                         self.key_head_dim**-0.5)
        k = l2_normalize(k.reshape(batch, length, self.num_key_heads, self.key_head_dim).astype(mx.float32))
        v = v.reshape(batch, length, heads, self.value_head_dim).astype(mx.float32)
        if group > 1:  # value head j reads key head j // group
            q, k = mx.repeat(q, group, axis=2), mx.repeat(k, group, axis=2)
        beta = mx.sigmoid(b.astype(mx.float32))
        g = log_decay(self.A_log, a, self.dt_bias)

        state = cache[1] if cache is not None else None
        if length == 1 and state is not None:
            out, state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            out = out[:, None]
        else:
            out, state = gated_delta_chunked(
                q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), g.swapaxes(1, 2), beta.swapaxes(1, 2),
                state, self.chunk_size,
            )
            out = out.swapaxes(1, 2)
        if cache is not None:
            # A copy: a slice would keep the whole prompt's projections alive in the cache.
            cache.update(mx.contiguous(window[:, -(self.conv_kernel - 1) :]), state, tokens=length)
        return out

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel by heads: each rank keeps some value heads and the key heads they read (replicated
        when there are fewer key heads than ranks), with their conv channels, decays and gates; the output
        projection sums the ranks' heads."""
        split = head_split(self.num_value_heads, self.num_key_heads, group.size(), "DeltaNet value heads")
        (v0, v1), (k0, k1) = split[group.rank()]
        dk, dv = self.key_head_dim, self.value_head_dim
        keys = (k0 * dk, k1 * dk)
        channels = [keys, (self.key_dim + keys[0], self.key_dim + keys[1]),
                    (2 * self.key_dim + v0 * dv, 2 * self.key_dim + v1 * dv)]
        slice_outputs(self.in_proj_qkv, channels)
        slice_outputs(self.conv1d, channels)
        slice_outputs(self.in_proj_z, [(v0 * dv, v1 * dv)])
        for layer in (self.in_proj_b, self.in_proj_a):
            slice_outputs(layer, [(v0, v1)])
        slice_outputs(self, [(v0, v1)], names=("A_log", "dt_bias"))
        self.out_proj = RowParallelLinear(self.out_proj, [(a * dv, b * dv) for (a, b), _ in split], group)
        self.num_key_heads, self.num_value_heads = k1 - k0, v1 - v0
        self.key_dim, self.value_dim = (k1 - k0) * dk, (v1 - v0) * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
