"""Quantized linear layers whose products go through :mod:`mlxchat.quantized` (native CPU kernels when
they apply, MLX's own ops otherwise), and :func:`quantize`, which puts them in a model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ..quantized import dequantize_rows, quantized_matmul


class QuantizedLinear(nn.QuantizedLinear):
    """:class:`mlx.nn.QuantizedLinear` (same parameters) computed by :func:`mlxchat.quantized.quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                             self.mode)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """:class:`mlx.nn.QuantizedEmbedding` whose lookup and ``as_linear`` (a tied output head) use the same kernels."""

    def __call__(self, x: mx.array) -> mx.array:
        return dequantize_rows(self["weight"], self["scales"], self.get("biases"), x, self.group_size, self.bits,
                               self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                                self.mode)


def quantize(module: nn.Module, predicate: Callable[[str, nn.Module], bool | dict[str, Any]]) -> None:
    """Like :func:`mlx.nn.quantize` with a dict-returning ``class_predicate``, but linear and embedding layers
    become the classes above; other layers quantize through their own ``to_quantized``."""

    def swap(path: str, layer: nn.Module) -> nn.Module:
        params = predicate(path, layer)
        if not params:
            return layer
        options = params if isinstance(params, dict) else {}
        if isinstance(layer, nn.Linear):
            return QuantizedLinear.from_linear(layer, **options)
        if isinstance(layer, nn.Embedding):
            return QuantizedEmbedding.from_embedding(layer, **options)
        return layer.to_quantized(**options)  # type: ignore[no-any-return]

    module.update_modules(tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module))
