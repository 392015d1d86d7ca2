"""LoRA, DoRA and QLoRA layers put in place of a module's linear and stacked expert layers, chosen by their
checkpoint names (:mod:`mlxchat.train.sites`).

The base layer stays as it was (float or MLX-quantized, on mlxchat's kernels: QLoRA) and frozen; only the
adapter matrices ``lora_a`` ``[r, in]`` and ``lora_b`` ``[out, r]`` (peft's ``lora_A``/``lora_B``) and, with
DoRA, the magnitude ``m`` ``[out]`` train. Stacked experts (``[experts, out, in]``) get one adapter per expert,
``lora_a`` ``[experts, r, in]`` and ``lora_b`` ``[experts, out, r]``, run beside the experts' gathered matmul; as in
peft (``lora.ParamWrapper``) they take no dropout and no DoRA.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import AdapterError, InvalidInputError
from ..layers.moe import QuantizedSwitchLinear, SwitchLinear
from .sites import Site, find_sites

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASettings:
    """What an adapter is, in peft's terms (the fields of its ``adapter_config.json`` that we honour)."""

    rank: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    parameters: tuple[str, ...] = ()
    """peft's ``target_parameters``: the fused expert tensors adapted (``experts.gate_up_proj``)."""
    dora: bool = False
    rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_for(self, name: str) -> int:
        return int(_pattern_value(self.rank_pattern, name, self.rank))

    def scale_for(self, name: str) -> float:
        rank, alpha = self.rank_for(name), float(_pattern_value(self.alpha_pattern, name, self.alpha))
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank

    def alpha_for(self, scale: float, rank: int) -> float:
        """The ``lora_alpha`` that gives ``scale`` at ``rank``."""
        return scale * math.sqrt(rank) if self.rslora else scale * rank


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """peft's per-module override: the first key that matches the end of the module's name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))``; with DoRA the sum is rescaled per output row to the learned
    magnitude ``m`` over the norm of the adapted weight (held constant in the gradient, as in the paper)."""

    def __init__(self, base: nn.Module, name: str, settings: LoRASettings, key: mx.array | None = None):
        super().__init__()
        out_dims, in_dims = layer_shape(base)
        self.base = base
        self.base.freeze()
        self.name = name
        """The checkpoint name of the wrapped layer (``model.layers.0.self_attn.q_proj``)."""
        self.settings = settings
        rank, self.scale, self.dora = settings.rank_for(name), settings.scale_for(name), settings.dora
        self.dropout = nn.Dropout(settings.dropout)
        bound = 1 / math.sqrt(in_dims)  # peft's default: Kaiming-uniform A, zero B (the model starts unchanged)
        self.lora_a = mx.random.uniform(-bound, bound, (rank, in_dims), key=key)
        self.lora_b = mx.zeros((out_dims, rank))
        if self.dora:
            self.m = mx.linalg.norm(base_weight(base), axis=1)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        update = (self.dropout(x) @ self.lora_a.T.astype(x.dtype)) @ self.lora_b.T.astype(x.dtype)
        if not self.dora:
            return y + self.scale * update
        bias = self.base["bias"] if "bias" in self.base else None
        rescale = (self.m / mx.stop_gradient(self._adapted_norm())).astype(x.dtype)
        plain = y if bias is None else y - bias
        out = rescale * (plain + self.scale * update)
        return out if bias is None else out + bias

    def _adapted_norm(self) -> mx.array:
        return mx.linalg.norm(self._adapted_weight(), axis=1)

    def _adapted_weight(self) -> mx.array:
        weight = base_weight(self.base)
        return weight + self.scale * (self.lora_b.astype(mx.float32) @ self.lora_a.astype(mx.float32))

    def fused(self) -> nn.Module:
        """The base layer with the adapter added into its weight (re-quantized the same way when quantized)."""
        weight = self._adapted_weight()
        if self.dora:
            weight = (self.m / self._adapted_norm())[:, None] * weight
        base = self.base
        bias = base["bias"] if "bias" in base else None
        if isinstance(base, nn.QuantizedLinear):
            out_dims, in_dims = weight.shape
            linear = nn.Linear(in_dims, out_dims, bias=bias is not None)
            linear.weight = weight.astype(base["scales"].dtype)
            if bias is not None:
                linear.bias = bias
            return type(base).from_linear(linear, base.group_size, base.bits, mode=base.mode)
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        fused.weight = weight.astype(base["weight"].dtype)
        if bias is not None:
            fused.bias = bias
        return fused


class LoRASwitchLinear(nn.Module):
    """Stacked experts with an adapter each: ``base(x, indices) + scale * B[e](A[e](x))`` for the experts ``e``
    each row goes through, as two more gathered matmuls beside the base's."""

    def __init__(self, base: nn.Module, site: Site, settings: LoRASettings, key: mx.array | None = None):
        super().__init__()
        experts, out_dims, in_dims = layer_shape(base)
        self.base = base
        self.base.freeze()
        self.site = site
        """Where the checkpoint keeps these experts (their names, or the fused tensor and its part)."""
        self.name = site.name
        self.settings = settings
        rank, self.scale = settings.rank_for(site.name), settings.scale_for(site.name)
        bound = 1 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (experts, rank, in_dims), key=key)
        self.lora_b = mx.zeros((experts, out_dims, rank))

    def gathers_rows(self, x: mx.array) -> bool:
        """False: the adapter's products are MLX's ``gather_mm``, which runs best on rows sorted by expert."""
        return False

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base(x, indices, sorted_indices)
        down = mx.gather_mm(x, self.lora_a.swapaxes(-1, -2).astype(x.dtype), rhs_indices=indices,
                            sorted_indices=sorted_indices)
        up = mx.gather_mm(down, self.lora_b.swapaxes(-1, -2).astype(x.dtype), rhs_indices=indices,
                          sorted_indices=sorted_indices)
        return y + self.scale * up

    def fused(self) -> nn.Module:
        """The base experts with their adapters added in (re-quantized the same way when quantized)."""
        weight = base_weight(self.base) + self.scale * (self.lora_b.astype(mx.float32) @ self.lora_a.astype(mx.float32))
        base = self.base
        if isinstance(base, QuantizedSwitchLinear):
            return QuantizedSwitchLinear.from_weight(weight.astype(base["scales"].dtype), base.group_size, base.bits,
                                                     base.mode)
        experts, out_dims, in_dims = weight.shape
        fused = SwitchLinear(in_dims, out_dims, experts)
        fused.weight = weight.astype(base["weight"].dtype)
        return fused


Adapter = LoRALinear | LoRASwitchLinear


def base_weight(layer: nn.Module) -> mx.array:
    """A linear layer's weight ``[out, in]`` (stacked experts: ``[experts, out, in]``) in float32, dequantized
    when quantized."""
    if isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                             mode=layer.mode).astype(mx.float32)
    return cast(mx.array, layer["weight"]).astype(mx.float32)


def layer_shape(layer: nn.Module) -> tuple[int, ...]:
    """``(out, in)`` of a linear layer, ``(experts, out, in)`` of stacked experts."""
    *outer, packed = layer["weight"].shape
    if isinstance(layer, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return (*outer, packed * 32 // layer.bits)
    return (*outer, packed)


class LoadedModel(Protocol):
    """What adapters need of a :class:`~mlxchat.GenerativeModel` (named structurally: the model's own adapter
    methods call this module, which therefore does not import it)."""

    module: Any
    worker: Any
    path: Path | None
    weights_version: int


Adaptable = nn.Module | LoadedModel
"""A plugin's module, or a loaded model."""


def module_of(model_or_module: Adaptable) -> nn.Module:
    return model_or_module if isinstance(model_or_module, nn.Module) else cast(nn.Module, model_or_module.module)


def sites(model_or_module: Adaptable, names: Iterable[str] | None = None) -> list[Site]:
    """The layers of a module (or loaded model) adapters can go on, by checkpoint name (adapted ones included):
    the ones ``names`` (checkpoint tensor names, an adapter's) place, by default the checkpoint's own or, for
    a bare module, its parameter names (see :func:`mlxchat.train.sites.find_sites`)."""
    module = module_of(model_or_module)
    path = None if isinstance(model_or_module, nn.Module) else model_or_module.path
    wrapped = {p: layer.base for p, layer in adapters(module).items()}
    return find_sites(module, None if path is None else Path(path), names, wrapped)


def lora(
    model_or_module: Adaptable,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    dora: bool = False,
    *,
    seed: int | None = None,
) -> list[str]:
    """Freeze the model and put a trainable LoRA (``dora=True``: DoRA) adapter on every linear layer whose
    checkpoint name is, or ends with ``.`` and, one of ``targets``, and one per expert on stacked experts named so
    (``...experts.<e>.gate_proj`` or the fused ``...experts.gate_up_proj``: see :class:`~mlxchat.train.sites.Site`);
    quantized layers stay quantized (QLoRA). Returns the checkpoint names adapted (experts:
    ``...experts.gate_proj``). :func:`mlxchat.train.train` then updates only the adapters.
    ``seed`` fixes the adapters' random start (``A``; ``B`` starts at zero), otherwise MLX's global generator.

    A loaded model's adapters are made on its worker; call this before generating from it.
    """
    numbers = all(isinstance(v, Real) and not isinstance(v, bool) for v in (rank, alpha, dropout))
    if not numbers or not isinstance(rank, Integral) or not 1 <= rank <= 2**16 or not math.isfinite(alpha) \
            or alpha <= 0 or not 0 <= dropout < 1 or not targets:
        raise InvalidInputError("lora needs an integer rank from 1 to 65536, a finite alpha > 0, 0 <= dropout < 1 "
                                "and at least one target")
    settings = LoRASettings(rank=int(rank), alpha=float(alpha), dropout=float(dropout), targets=tuple(targets),
                            dora=dora)
    chosen = [site for site in sites(model_or_module) if site.matches(targets)]
    if not chosen:
        raise AdapterError(f"no layer's checkpoint name ends with any of {', '.join(targets)}")
    experts = [site for site in chosen if site.stacked]
    if experts and (dropout or dora):
        raise AdapterError(f"{experts[0].name} and other expert weights take no {'DoRA' if dora else 'dropout'} "
                           "(peft adapts them as parameters, without either): leave them out of targets (e.g. "
                           "targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'))")
    fused: dict[str, set[int]] = {}
    for site in experts:
        fused.setdefault(str(site.parameter), set()).add(site.part)
    lone = sorted(p for p, parts in fused.items() if len(parts) < next(s.parts for s in experts if s.parameter == p))
    if lone:
        raise AdapterError(f"{lone[0]} holds the gate and up projections of its experts together (transformers "
                           "fuses them): target both or neither")
    _run(model_or_module, lambda: attach(module_of(model_or_module), chosen, settings, seed))
    return sorted(site.name for site in chosen)


def attach(module: nn.Module, layers: Iterable[Site], settings: LoRASettings,
           seed: int | None = None) -> dict[str, Adapter]:
    """Wrap ``layers`` in fresh adapters (by module path); the rest of the module freezes."""
    remove(module)
    module.freeze()
    made: dict[str, Adapter] = {}
    chosen = sorted(layers, key=lambda site: site.name)
    keys = mx.random.split(mx.random.key(seed), len(chosen)) if seed is not None else None
    for index, site in enumerate(chosen):
        layer, key = get_layer(module, site.path), None if keys is None else keys[index]
        made[site.path] = (LoRASwitchLinear(layer, site, settings, key) if site.stacked
                           else LoRALinear(layer, site.name, settings, key))
    module.update_modules(tree_unflatten(list(made.items())))
    for adapter in made.values():  # built in training mode: their dropout would run at inference (train() sets it)
        adapter.eval()
    mx.eval(module.trainable_parameters())
    return made


def adapters(model_or_module: Adaptable) -> dict[str, Adapter]:
    """The adapted layers of a module, by module path."""
    return {path: layer for path, layer in module_of(model_or_module).named_modules()
            if isinstance(layer, (LoRALinear, LoRASwitchLinear))}


def remove(module: nn.Module) -> None:
    """Put the base layers back (the adapters are dropped)."""
    wrapped = adapters(module)
    if wrapped:
        module.update_modules(tree_unflatten([(path, layer.base) for path, layer in wrapped.items()]))


def fuse(module: nn.Module) -> int:
    """Replace each adapted layer by its base with the adapter added in; returns how many were fused."""
    wrapped = adapters(module)
    if wrapped:
        module.update_modules(tree_unflatten([(path, layer.fused()) for path, layer in wrapped.items()]))
        mx.eval(module.parameters())
    return len(wrapped)


def get_layer(module: nn.Module, path: str) -> nn.Module:
    node: Any = module
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return cast(nn.Module, node)


def _run(model_or_module: Adaptable, job: Any) -> Any:
    """Run ``job`` on a loaded model's worker (which owns its arrays; its prompt caches are then stale), or here
    for a bare module."""
    if isinstance(model_or_module, nn.Module):
        return job()
    try:
        return model_or_module.worker.run(job)
    finally:
        model_or_module.weights_version += 1
