"""Normalisation layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``.

    ``offset=1.0`` gives the zero-centred norm (weights stored around 0) that Qwen3.5 and Gemma 3 use;
    checkpoints keep their own convention and the forward applies it.
    """

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.weight + self.offset if self.offset else self.weight
        return mx.fast.rms_norm(x, weight, self.eps)
