"""Blocks that vision towers share: 2-D rotary positions of image patches and bidirectional attention
over one image's patches."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .rope import rotate


class AxialRoPE(nn.Module):
    """2-D ("axial") RoPE of a ViT: a patch at ``(a, b)`` turns by ``a`` on some pairs and by ``b`` on the
    others, with frequencies ``theta^(-4j / head_dim)`` for ``j < head_dim / 4``.

    Two layouts exist. ``split_head=False`` (Qwen-VL): one rotate-half over the whole head, the first
    ``head_dim / 4`` pairs turning by ``a``, the next ``head_dim / 4`` by ``b``. ``split_head=True``
    (Gemma 4): each half of the head is rotated on its own, the first by ``a``, the second by ``b``.
    """

    def __init__(self, head_dim: int, theta: float, split_head: bool):
        super().__init__()
        spatial = head_dim // 2
        exponents = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
        self._inv_freq = mx.array(1.0 / (np.float32(theta) ** exponents), dtype=mx.float32)
        self.split_head = split_head

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """``x [..., patches, head_dim]`` turned by ``positions [patches, 2]``."""
        a = positions[:, :1].astype(mx.float32) * self._inv_freq
        b = positions[:, 1:].astype(mx.float32) * self._inv_freq
        if not self.split_head:
            return rotate(x, mx.concatenate([a, b], axis=-1))
        half = x.shape[-1] // 2
        return mx.concatenate([rotate(x[..., :half], a), rotate(x[..., half:], b)], axis=-1)


def attend_all(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Bidirectional attention among one image's patches: ``[B, heads, patches, D]`` each, no mask."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
