"""Gated feed-forward layers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .fused import Projections
from .parallel import RowParallelLinear, balanced, input_unit, slice_outputs


@partial(mx.compile, shapeless=True)
def _silu_gate(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


def silu_gate(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: one vectorized pass on a CPU (:mod:`mlxchat.kernels`), one fused kernel elsewhere."""
    fused = kernels.silu_mul(gate, x)
    return fused if fused is not None else _silu_gate(gate, x)


@partial(mx.compile, shapeless=True)
def gelu_tanh_gate(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * x


@partial(mx.compile, shapeless=True)
def gelu_gate(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu(gate) * x


# Each gate is one fused kernel: MLX's CPU elementwise ops run one pass at a time, on one thread.
GATES: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "silu": silu_gate,
    "gelu": gelu_gate,
    "gelu_tanh": gelu_tanh_gate,
    "gelu_pytorch_tanh": gelu_tanh_gate,
}


def gate_function(activation: str) -> Callable[[mx.array, mx.array], mx.array]:
    if activation not in GATES:
        raise ValueError(f"unsupported gate activation {activation!r} (supported: {', '.join(GATES)})")
    return GATES[activation]


class SwiGLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SiLU by default (SwiGLU), ``gelu`` / ``gelu_tanh`` for
    GeGLU (the names transformers' ``hidden_act`` uses are accepted). Gate and up run as one product once
    loaded (:mod:`mlxchat.layers.fused`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj: nn.Module = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self._gate = gate_function(activation)
        self._gate_up = Projections("gate_proj", "up_proj")

    def __call__(self, x: mx.array) -> mx.array:
        parts = self._gate_up.parts(self, x)
        if len(parts) == 1 and self._gate is silu_gate:  # the joined product's halves, read where they lie
            fused = kernels.silu_mul(parts[0])
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self._gate(*self._gate_up.split(parts)))

    def shard(self, group: mx.distributed.Group, *, reduce: bool = True) -> None:
        """Tensor parallel: each rank keeps a slice of the hidden units (whole quantization groups of
        ``down_proj``); ``reduce=False`` leaves the sum of the ranks' outputs to the caller."""
        width = self.gate_proj["weight"].shape[0]
        parts = balanced(width, group.size(), input_unit(self.down_proj), what="MLP hidden units")
        slice_outputs(self.gate_proj, [parts[group.rank()]])
        slice_outputs(self.up_proj, [parts[group.rank()]])
        self.down_proj = RowParallelLinear(self.down_proj, parts, group, reduce=reduce)
