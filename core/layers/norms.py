"""Normalisation layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``.

    Checkpoints that store zero-centred weights (Qwen3.5's ``1 + w``) have the 1 folded in by their
    plugin's ``sanitize``, so one forward serves every convention.
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.eps, self.weight)


def rms_norm(x: mx.array, eps: float, weight: mx.array | None = None) -> mx.array:
    """``x / rms(x)`` over the last axis, times ``weight`` when given (Gemma's weightless norms have none): one
    vectorized pass on a CPU (:func:`mlxchat.kernels.rms_norm`), where ``mx.fast.rms_norm`` runs seven ops."""
    return kernels.rms_norm(x, weight, eps)
