"""Rotary position embeddings (rotate-half style) with the scaling types released checkpoints use.

The frequencies are computed in Python when the layer is built and handed to MLX as plain numbers, so the
layer holds no lazy array: whatever thread runs the forward, nothing built on another thread is evaluated
there.
"""

from __future__ import annotations

import math
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..config import ModelConfig, RopeConfig
from ..errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(dims: int, rope: RopeConfig, max_position_embeddings: int) -> tuple[list[float], float]:
    """Inverse frequencies of the ``dims`` rotated features and the factor applied to them (yarn's
    attention factor), as transformers' ``ROPE_INIT_FUNCTIONS`` compute them for the static types.

    ``dynamic`` starts from the plain frequencies; :class:`RoPE` rescales its base as the sequence grows.
    """
    base = rope.rope_theta
    inv = [base ** (-2 * j / dims) for j in range(dims // 2)]
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        return inv, 1.0
    factor = rope.factor or 1.0
    if kind == "linear":
        return [f / factor for f in inv], 1.0
    if kind == "llama3":
        original = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = original / rope.low_freq_factor
        high_wavelen = original / rope.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out, 1.0
    if kind == "yarn":
        return _yarn(inv, dims, rope, max_position_embeddings)
    hint = " (Phi-3's long/short factors; no family mlxchat serves uses it)" if kind in ("longrope", "su") else ""
    raise CheckpointError(
        f"rope_type {kind!r}{hint} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}; "
        "Gemma 4's 'proportional' through ProportionalRoPE)"
    )


def context_limit(config: ModelConfig) -> tuple[int, str]:
    """The most tokens a model with this config serves, and why, derived as vLLM derives ``max_model_len``:
    linear and dynamic scaling stretch ``max_position_embeddings`` by ``factor``, yarn stretches
    ``original_max_position_embeddings`` by ``factor``; llama3 (and every other type) already counts its
    scaling in ``max_position_embeddings``."""
    rope = getattr(config, "rope", None)
    rope = rope if isinstance(rope, RopeConfig) else None  # Gemma 4 keeps one per layer kind: none scales
    max_position_embeddings = config.max_position_embeddings
    window = f"max_position_embeddings {max_position_embeddings}"
    if rope is None or rope.rope_type not in ("linear", "dynamic", "yarn") or not rope.factor:
        kind = f" ({rope.rope_type} RoPE)" if rope is not None and rope.rope_type != "default" else ""
        return max_position_embeddings, f"{window}{kind}"
    original = max_position_embeddings
    if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
        original, window = rope.original_max_position_embeddings, \
            f"original_max_position_embeddings {rope.original_max_position_embeddings}"
    stretched = original * rope.factor
    if not math.isfinite(stretched):
        raise CheckpointError(f"config.json: a {rope.rope_type} RoPE factor of {rope.factor:g} stretches {window} past "
                              "any number of tokens")
    limit = int(stretched)
    return limit, f"{rope.rope_type} RoPE: factor {rope.factor:g} x {window}"


def _yarn(inv: list[float], dims: int, rope: RopeConfig, max_position_embeddings: int) -> tuple[list[float], float]:
    """YaRN: high frequencies kept, low ones interpolated by ``factor``, a linear ramp between; the attention
    factor (``0.1 ln(factor) + 1`` unless the config gives one) scales the rotated features."""
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    out = []
    for j, f in enumerate(inv):
        extrapolation = 1 - min(max((j - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * (1 - extrapolation) + f * extrapolation)
    return out, attention


def _positions(offsets: mx.array) -> list[int]:
    """A batch's offsets ``[B]``, one per row, as the kernels take them."""
    return [int(o) for o in cast(list[int], offsets.tolist())]


class RoPE(nn.Module):
    """Rotates the first ``dims`` features of each head (all of them unless a partial factor says less).

    ``dynamic`` (NTK-aware) scaling raises the base once the sequence seen so far (``offset`` plus this
    chunk) outgrows ``max_position_embeddings``, as transformers does: keys already cached keep the
    frequencies they were rotated with, so a cached run matches transformers' cached run, not its full
    forward, and past the window the result depends on how the sequence was chunked (``generate``'s
    schedule, the prompt in one forward and then one token at a time, is proven against transformers in
    tests/test_rope_scaling.py). The base follows each forward's length alone, as in a fresh transformers
    model (whose rotary layer otherwise keeps the longest length any earlier forward reached).
    """

    def __init__(self, dims: int, rope: RopeConfig, max_position_embeddings: int = 32768):
        super().__init__()
        self.dims = dims
        self.base = rope.rope_theta
        self.max_positions = max_position_embeddings
        self.dynamic_factor = (rope.factor or 1.0) if rope.rope_type == "dynamic" else None
        inv_freq, self.scale = rope_inv_freq(dims, rope, max_position_embeddings)
        # mx.fast.rope takes wavelength divisors; the plain and dynamic cases keep its `base` fast path.
        plain = rope.rope_type in ("default", "dynamic")
        self._freqs = None if plain else mx.array([1.0 / f for f in inv_freq], dtype=mx.float32)
        self._static_inv_freq = mx.array(inv_freq, dtype=mx.float32)
        """For :func:`mlxchat.kernels.rope` (a dynamic RoPE's, once its base grows, is made per call)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """``offset``: the position of ``x``'s first token, or one per row of a batch (``[B]``)."""
        if isinstance(offset, mx.array) and self.dynamic_factor is not None:  # a base per row's length
            return mx.concatenate([self(x[i : i + 1], o) for i, o in enumerate(_positions(offset))], axis=0)
        if self.scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.scale)
        turn = self.rotation(offset, x.shape[-2])
        if turn is not None:
            at = turn.offsets[0] if isinstance(offset, int) else turn.offsets
            fused = kernels.rope(x, turn.inv_freq, self.dims, at)
            if fused is not None:
                return fused
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=None if self._freqs is not None else self._base(offset if isinstance(offset, int) else 0, x.shape[-2]),
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )

    def rotation(self, offset: int | mx.array, length: int) -> kernels.Rotation | None:
        """The rotation of a chunk of ``length`` positions from ``offset`` (or one offset per row, ``[B]``) as the
        fused kernels take it (:func:`mlxchat.kernels.heads`); ``None`` where only MLX's rope does it (a dynamic
        RoPE's rows, each with a base of its own; positions of another shape, MRoPE's ``[3, L]``; no rows)."""
        if isinstance(offset, mx.array):
            if offset.ndim != 1 or offset.size == 0 or self.dynamic_factor is not None:
                return None
            offsets = _positions(offset)
        else:
            offsets = [offset]
        base = self._base(offsets[0], length)
        inv_freq = self._static_inv_freq if base == self.base else mx.array(
            [base ** (-2 * j / self.dims) for j in range(self.dims // 2)], dtype=mx.float32)
        return kernels.Rotation(inv_freq, self.dims, self.scale, offsets)

    def _base(self, offset: int, length: int) -> float:
        """The base the frequencies of a chunk of ``length`` positions from ``offset`` come from: a dynamic RoPE's
        grows once the sequence outgrows ``max_position_embeddings``."""
        if self.dynamic_factor is None:
            return self.base
        seen = max(offset + length, self.max_positions)
        growth = self.dynamic_factor * seen / self.max_positions - (self.dynamic_factor - 1)
        return float(self.base * growth ** (self.dims / (self.dims - 2)))


def rotate(x: mx.array, angles: mx.array) -> mx.array:
    """Rotate-half RoPE with explicit angles: feature ``j`` pairs with ``j + D/2`` and the pair turns by
    ``angles[..., j]`` (``angles`` broadcasts against ``x[..., :D/2]``)."""
    half = x.shape[-1] // 2
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class MRoPE(RoPE):
    """Qwen's multimodal RoPE with interleaved sections (Qwen3-VL, Qwen3.5): a token has a 3-D position
    (temporal, height, width) and rotated pair ``j`` turns by the height coordinate when
    ``j % 3 == 1`` and ``j < 3 * sections[1]``, by the width when ``j % 3 == 2`` and
    ``j < 3 * sections[2]``, and by the temporal one otherwise.

    Text tokens have three equal coordinates, which is plain RoPE at that position: an ``int`` offset takes
    :class:`RoPE`'s fast path unchanged. Explicit positions ``[3, L]`` (a chunk with image tokens) take the
    general one.
    """

    def __init__(self, dims: int, rope: RopeConfig, sections: tuple[int, int, int], max_position_embeddings: int):
        super().__init__(dims, rope, max_position_embeddings)
        if rope.rope_type != "default":
            raise CheckpointError(f"multimodal RoPE with rope_type {rope.rope_type!r} is not supported")
        inv_freq, _ = rope_inv_freq(dims, rope, max_position_embeddings)
        axes = [1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2] else 0
                for j in range(dims // 2)]
        self._inv_freq = mx.array(inv_freq, dtype=mx.float32)
        self._axes = mx.array(axes)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:  # type: ignore[override]
        if isinstance(offset, int) or offset.ndim == 1:  # text: a position, or one per row of a batch
            return super().__call__(x, offset)
        angles = offset[self._axes].T.astype(mx.float32) * self._inv_freq  # [L, dims/2]
        turned = rotate(x[..., : self.dims], angles)
        return mx.concatenate([turned, x[..., self.dims :]], axis=-1) if self.dims < x.shape[-1] else turned


class ProportionalRoPE(nn.Module):
    """Gemma 4's "proportional" RoPE: rotate-half pairs ``(j, j + head_dim/2)`` over the whole head, of which
    only the first ``partial_rotary_factor * head_dim / 2`` turn; the other pairs pass unchanged.

    Unlike a partial rotary (``RoPE`` with ``dims < head_dim``), the rotated features are two separate
    slices, ``[0, a)`` and ``[head_dim/2, head_dim/2 + a)``, and the frequencies are those of the full
    head dim. Pairs that stay put get an infinite wavelength (angle 0).
    """

    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.head_dim = head_dim
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        factor = rope.factor or 1.0
        wavelengths = [factor * rope.rope_theta ** (2 * j / head_dim) for j in range(rotated)]
        wavelengths += [math.inf] * (head_dim // 2 - rotated)
        self._freqs = mx.array(wavelengths, dtype=mx.float32)
        self._inv_freq = mx.array([1.0 / w for w in wavelengths], dtype=mx.float32)  # (0 where a pair stays put)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """``offset``: the position of ``x``'s first token, or one per row of a batch (``[B]``)."""
        at = offset if isinstance(offset, int) else _positions(offset) if offset.ndim == 1 else None
        fused = None if at is None else kernels.rope(x, self._inv_freq, self.head_dim, at)
        if fused is not None:
            return fused
        return mx.fast.rope(x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)
