"""A freshly initialised model of any plugin architecture, built from a ``config.json`` dict."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from ..registry import registry


def from_scratch(hf_config: dict[str, Any], *, seed: int = 0, init_std: float | None = 0.02) -> nn.Module:
    """The module the plugin serving ``hf_config["model_type"]`` builds, with seeded weights.

    ``init_std``: linear and embedding weights drawn from N(0, init_std^2), biases zero (the usual
    transformer init, ``initializer_range`` in transformers); ``None`` keeps each layer's own init. Other
    parameters (norm scales, recurrent-state constants) keep the values their layers are built with.
    """
    arch = registry().architecture_for_config(hf_config)
    config: ModelConfig = arch.config_class.from_hf(hf_config)
    mx.random.seed(seed)
    module = arch.model_class(config)
    if init_std is not None:
        init_weights(module, init_std)
    mx.eval(module.parameters())
    return module


def init_weights(module: nn.Module, std: float) -> None:
    """Redraw the weights of every ``Linear`` and ``Embedding`` (quantized layers are not trainable)."""
    def visit(_: str, layer: nn.Module) -> None:
        if isinstance(layer, nn.Linear | nn.Embedding):
            layer.weight = mx.random.normal(layer.weight.shape, scale=std)
            if "bias" in layer:
                layer.bias = mx.zeros_like(layer.bias)

    module.apply_to_modules(visit)
