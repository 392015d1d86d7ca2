"""Linear layers that read the same input, run as one matrix product: ``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``, DeltaNet's four input projections.

A float32 decode step on a CPU is a few hundred matrix-vector products of a few megabytes each, and each
call pays for waking the BLAS's threads and ramping up its stream from memory; one product over the joined
rows reads the same bytes in fewer, larger calls (and its graph has fewer nodes). The layers stay what
checkpoints, adapters and tensor parallelism know (``q_proj`` is still a linear layer with its own
``weight``), so loading, saving, LoRA and sharding are unchanged: :func:`fuse_projections` runs once the
weights are loaded (and sharded), joins each group's parameters into one array and makes every layer's
parameters row slices of it (views: no memory is doubled). The joined product runs only while every layer
and parameter is the one it was joined from; while one is replaced (an adapter wrapped around a layer) the
layers run one by one, as before, and the join is dropped once the layers hold other parameters (a weight
updated by training; :meth:`~mlxchat.GenerativeModel.fuse_adapter` joins the fused weights again). Results
differ from the separate products only in float rounding.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn

from ..quantized import quantized_matmul
from .quantized import QuantizedLinear

_PLAIN = ("weight", "bias")
_QUANTIZED = ("weight", "scales", "biases", "bias")


class Projections:
    """Linear layers of a module that read the same input, by attribute name; calling it with the module
    and ``x`` gives each layer's output (row-slice views of one product once :func:`fuse_projections` has
    joined them). A module keeps it as a plain attribute (``self._qkv = Projections("q_proj", ...)``)."""

    def __init__(self, *names: str):
        self.names = names
        self.joined: _Joined | None = None

    def __call__(self, module: nn.Module, x: mx.array) -> list[mx.array]:
        return self.split(self.parts(module, x))

    def parts(self, module: nn.Module, x: mx.array) -> list[mx.array]:
        """The layers' outputs as they come: one array, all of them side by side (last axis), where the layers run
        joined (a kernel that reads them there saves the split); otherwise each layer's."""
        joined = self.joined
        if joined is not None:
            if joined.serves(module, self.names):
                return [joined(x)]
            if not joined.intact():
                self.joined = None  # the layers were given other parameters: the join would only pin memory
        return [module[name](x) for name in self.names]

    def split(self, parts: list[mx.array]) -> list[mx.array]:
        """Each layer's output from :meth:`parts`."""
        if len(parts) == len(self.names):
            return parts
        assert self.joined is not None
        return cast(list[mx.array], mx.split(parts[0], self.joined.bounds, axis=-1))  # a list at run time

    def fuse(self, module: nn.Module) -> bool:
        """Join the layers' parameters if they are of one kind (all float, or all quantized alike) and all
        or none have a bias; returns whether they were joined."""
        layers = [module[name] for name in self.names]
        self.joined = _Joined.of(layers) if len(layers) > 1 else None
        return self.joined is not None


def fuse_projections(module: nn.Module) -> int:
    """Join the :class:`Projections` of every submodule of ``module`` (after its weights are loaded, and
    after :meth:`~mlxchat.layers.CausalLM.shard`: each rank joins its own rows); returns how many groups
    were joined. Each group's parameters are evaluated before the next is joined, so loading peaks at one
    group's worth of extra memory."""
    count = 0
    for _, child in module.named_modules():
        for value in vars(child).values():
            if isinstance(value, Projections):
                count += value.fuse(child)
    return count


def _names(layer: nn.Module) -> tuple[str, ...] | None:
    """The parameters a linear layer's product reads, or ``None`` when it is not a plain linear layer."""
    if type(layer) is nn.Linear:
        return _PLAIN
    if type(layer) in (QuantizedLinear, nn.QuantizedLinear):
        return _QUANTIZED
    return None


class _Joined:
    """The joined parameters of some linear layers, and the parameters each layer held when they were joined
    (row slices of the joined ones)."""

    def __init__(self, layers: list[nn.Module], joined: dict[str, mx.array], sizes: list[int]):
        self.layers = layers
        self.params = [[(name, layer[name]) for name in joined] for layer in layers]
        self.joined = joined
        self.bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
        self.quantization = (layers[0].group_size, layers[0].bits, layers[0].mode) if "scales" in joined else None
        self.transposed = None if self.quantization else joined["weight"].T  # evaluated: no transpose a step
        mx.eval(self.transposed)

    @classmethod
    def of(cls, layers: list[nn.Module]) -> _Joined | None:
        names = _names(layers[0])
        if names is None or any(_names(layer) != names for layer in layers):
            return None
        present = [name for name in names if name in layers[0]]
        if any([name for name in names if name in layer] != present for layer in layers):
            return None
        if "scales" in present and len({(lay.group_size, lay.bits, lay.mode) for lay in layers}) > 1:
            return None
        if any(len({layer[name].dtype for layer in layers}) > 1 for name in present):
            return None
        sizes = [layer["weight"].shape[0] for layer in layers]
        joined = {name: mx.concatenate([layer[name] for layer in layers]) for name in present}
        mx.eval(joined)
        start = 0
        for layer, size in zip(layers, sizes, strict=True):
            for name in present:
                setattr(layer, name, joined[name][start : start + size])
            start += size
        mx.eval([layer[name] for layer in layers for name in present])
        return cls(layers, joined, sizes)

    def intact(self) -> bool:
        """Whether the joined layers still hold the parameters they were given (wrapped in an adapter or not)."""
        for layer, params in zip(self.layers, self.params, strict=True):
            if len(layer) != len(params):
                return False
            for name, value in params:
                if layer.get(name) is not value:
                    return False
        return True

    def serves(self, module: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether ``module``'s layers ``names`` are the layers joined, as they were (checked at every call:
        plain loops, as this runs for every projection of every step)."""
        for name, mine in zip(names, self.layers, strict=True):
            if module.get(name) is not mine:
                return False
        return self.intact()

    def __call__(self, x: mx.array) -> mx.array:
        """The joined product: every layer's output side by side."""
        p = self.joined
        if self.quantization is not None:
            group_size, bits, mode = self.quantization
            y = quantized_matmul(x, p["weight"], p["scales"], p.get("biases"), group_size, bits, mode)
            if "bias" in p:
                y = y + p["bias"]
        else:
            assert self.transposed is not None
            y = x @ self.transposed if "bias" not in p else mx.addmm(p["bias"], x, self.transposed)
        return y
