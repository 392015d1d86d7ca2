"""The gated short convolution of LFM2: a cheap token mixer whose whole memory is the last few inputs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache import RaggedRows, RowCaches, StateCache, each_sequence
from ..errors import CheckpointError
from .parallel import RowParallelLinear, balanced, input_unit, slice_outputs


class ShortConv(nn.Module):
    """``out_proj(C * conv(B * x))`` where ``B, C, x = in_proj(h)`` and ``conv`` is a causal depthwise
    convolution over the sequence (``kernel_size`` taps, the last one on the current token).

    The state is the last ``kernel_size - 1`` values of ``B * x`` (``cache[0]``, ``[batch, K-1, dims]``),
    so a chunk of any length continues exactly where the previous one stopped. Attribute names are the
    checkpoint's; ``conv.weight`` is MLX's depthwise layout ``[dims, K, 1]`` (see :func:`depthwise_weight`).
    """

    def __init__(self, dims: int, kernel_size: int, bias: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.in_proj = nn.Linear(dims, 3 * dims, bias=bias)
        self.conv = nn.Conv1d(dims, dims, kernel_size, groups=dims, bias=bias)
        self.out_proj: nn.Module = nn.Linear(dims, dims, bias=bias)

    def __call__(self, h: mx.array, cache: StateCache | RaggedRows | None = None) -> mx.array:
        return self.out_proj(each_sequence(self._mix, cache, self.in_proj(h), axis=1))  # each over its own past

    def _mix(self, bcx: mx.array, cache: StateCache | RowCaches | None) -> mx.array:
        """One sequence's (or a batch of decode rows') ``C * conv(B * x)`` from the input projection's output: a
        decode step in one node where it applies (:func:`mlxchat.kernels.short_conv_step`), else the ops."""
        past = cache[0] if cache is not None and bcx.shape[1] == 1 and "bias" not in self.conv else None
        made = kernels.short_conv_step(bcx, past, self.conv.weight) if past is not None else None
        if made is not None:
            assert cache is not None
            out, state = made
            cache.update(state, tokens=1)
            return out
        b, c, x = mx.split(bcx, 3, axis=-1)
        return c * self._convolve(b * x, cache)

    def _convolve(self, gated: mx.array, cache: StateCache | RowCaches | None) -> mx.array:
        batch, length, dims = gated.shape
        keep = self.kernel_size - 1
        past = cache[0] if cache is not None else None
        if past is None:
            past = mx.zeros((batch, keep, dims), gated.dtype)
        window = mx.concatenate([past, gated], axis=1)
        if cache is not None:
            # An own buffer: a view would pin the whole chunk's activations in the state and its snapshots.
            cache.update(mx.contiguous(window[:, length:]), tokens=length)
        # Taps as broadcast multiply-adds: cheaper than a grouped conv1d, which MLX runs channel by channel.
        taps = self.conv.weight[:, :, 0].T  # [K, dims]
        if length == 1:
            y = (window * taps).sum(axis=1, keepdims=True)
        else:
            y = window[:, :length] * taps[0]
            for k in range(1, self.kernel_size):
                y = y + window[:, k : k + length] * taps[k]
        if "bias" in self.conv:
            y = y + self.conv.bias
        return y

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel by channels: each rank keeps its channels of ``B``, ``C`` and ``x`` and of the
        convolution; the output projection sums the ranks' channels."""
        dims = self.out_proj["weight"].shape[0]
        parts = balanced(dims, group.size(), input_unit(self.out_proj), what="conv channels")
        a, b = parts[group.rank()]
        slice_outputs(self.in_proj, [(a, b), (dims + a, dims + b), (2 * dims + a, 2 * dims + b)])
        slice_outputs(self.conv, [(a, b)])
        self.out_proj = RowParallelLinear(self.out_proj, parts, group)


def depthwise_weight(name: str, weight: mx.array) -> mx.array:
    """Checkpoint tensor ``name``, a depthwise conv weight, in MLX's ``[dims, K, 1]`` layout (from
    PyTorch's ``[dims, 1, K]``, or already converted)."""
    if weight.ndim != 3 or 1 not in (weight.shape[1], weight.shape[2]):
        raise CheckpointError(f"{name}: a depthwise conv weight is [dims, 1, K] or [dims, K, 1], "
                              f"got {tuple(weight.shape)}")
    return weight.swapaxes(1, 2) if weight.shape[1] == 1 and weight.shape[2] > 1 else weight
