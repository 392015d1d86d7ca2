"""Where adapters can go, by checkpoint name: the linear layers and stacked expert layers of a plugin's module,
each with the name peft knows it by.

The names are the checkpoint's, as peft sees them in transformers (``model.layers.0.self_attn.q_proj``), not the
module's: a plugin's ``sanitize`` maps checkpoint tensors to its parameters, and we run it on one small stand-in
tensor per checkpoint tensor to learn where each goes. So every plugin gets adapters with no code of its own,
and targets mean what they mean to peft (LFM2's feed-forward is ``w1``/``w2``/``w3`` in its checkpoint, so peft's
default targets leave it alone, here too).

A linear layer takes its checkpoint tensor as it is, found by identity. A stacked expert layer (``[experts, out,
in]``, :class:`~mlxchat.layers.moe.SwitchLinear`) is built from many tensors (``...experts.<e>.gate_proj``
stacked) or from a part of one (``...experts.gate_up_proj`` split), found by value: each stand-in holds its own
number (and its row's), so the built tensor says which stand-ins it came from, in which order.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..layers.moe import FUSED_EXPERTS, QuantizedSwitchLinear, SwitchLinear


@dataclass(frozen=True)
class Site:
    """A layer an adapter can go on: its module path, and how the checkpoint names it."""

    path: str
    """The layer's module path (``model.layers.0.mlp.switch_mlp.gate_proj``)."""
    name: str
    """Its checkpoint name: a linear layer's module name (``model.layers.0.self_attn.q_proj``); for stacked
    experts ``<...>.experts.<projection>`` (``model.layers.0.mlp.experts.gate_proj``). Targets match it."""
    experts: tuple[str, ...] = ()
    """Stacked experts the checkpoint names one by one: their module names, expert ``e`` at ``e``."""
    parameter: str | None = None
    """Stacked experts: the fused tensor peft adapts them as (its ``target_parameters``; transformers keeps per-expert
    checkpoints fused too), e.g. ``model.layers.0.mlp.experts.gate_up_proj`` ..."""
    part: int = 0
    parts: int = 1
    """... of which this layer holds the rows ``part`` of ``parts`` along the output axis."""

    @property
    def stacked(self) -> bool:
        return self.parameter is not None

    def matches(self, targets: Iterable[str]) -> bool:
        """peft's rule for a list of targets: a name is one, or ends with ``.`` and one (for experts the fused
        tensor's name counts too: ``gate_up_proj`` targets the gate and up projections)."""
        names = [self.name] if self.parameter is None else [self.name, self.parameter]
        return any(n == t or n.endswith("." + t) for n in names for t in targets)


def is_linear(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.Linear, nn.QuantizedLinear))


def is_stacked(layer: nn.Module) -> bool:
    return isinstance(layer, (SwitchLinear, QuantizedSwitchLinear))


def find_sites(module: nn.Module, path: Path | None, names: Iterable[str] | None = None,
               adapted: dict[str, nn.Module] | None = None) -> list[Site]:
    """The adaptable layers of ``module`` that ``names`` (checkpoint tensor names) place: by default the
    checkpoint's own (its tensor names, when ``path`` is a checkpoint folder) or, without one, the module's
    parameter names (what :func:`mlxchat.train.save_checkpoint` writes). ``adapted``: layers already wrapped,
    by module path, to stand for their base layer."""
    layers = {p: lay for p, lay in module.named_modules() if is_linear(lay) or is_stacked(lay)}
    layers |= adapted or {}
    layers = {p: lay for p, lay in layers.items() if not any(p.startswith(q + ".") for q in layers if q != p)}
    stacked = {p for p, lay in layers.items() if is_stacked(lay)}
    if names is None:
        if path is None:
            names = [f"{p}.weight" for p in layers]
        else:
            from ..checkpoint import tensor_names

            names = sorted(tensor_names(path))
    names = list(names)
    renamed, built = _traced(module, names)
    sites: list[Site] = []
    for tensor, target in renamed.items():
        layer = target.removesuffix(".weight")
        if not target.endswith(".weight") or layer not in layers:
            continue
        if layer in stacked:
            sites.append(Site(layer, tensor.removesuffix(".weight"), parameter=tensor))
        elif tensor.endswith(".weight"):
            sites.append(Site(layer, tensor[: -len(".weight")]))
    for target, source in built.items():
        layer = target.removesuffix(".weight")
        if target.endswith(".weight") and layer in stacked:
            sites.append(_stacked_site(layer, source))
    # A name sanitize does not know may still be the module's own path (transformers renames some checkpoints
    # as it loads them: Qwen3.5's model.language_model.layers are model.layers in its Qwen3_5ForCausalLM).
    placed = {site.name for site in sites}
    for tensor in names:
        name = tensor.removesuffix(".weight")
        if tensor.endswith(".weight") and name not in placed and name in layers and name not in stacked:
            sites.append(Site(name, name))
    return sites


@dataclass(frozen=True)
class _Built:
    """Where sanitize took a stacked expert weight from: per-expert tensors stacked (their names, in expert order),
    or rows ``part`` of ``parts`` of one fused tensor."""

    experts: tuple[str, ...] = ()
    fused: str = ""
    part: int = 0
    parts: int = 1


def _stacked_site(layer: str, built: _Built) -> Site:
    projection = layer.rpartition(".")[2]
    if built.fused:
        container = built.fused.rpartition(".")[0]
        return Site(layer, f"{container}.{projection}", parameter=built.fused, part=built.part, parts=built.parts)
    experts = tuple(n.removesuffix(".weight") for n in built.experts)
    container = _without_index(experts)
    fused, projections = next(((f, ps) for f, ps in FUSED_EXPERTS.items() if projection in ps),
                              (projection, (projection,)))
    return Site(layer, f"{container}.{experts[0].rpartition('.')[2]}", experts=experts,
                parameter=f"{container}.{fused}", part=projections.index(projection), parts=len(projections))


def _without_index(experts: tuple[str, ...]) -> str:
    """``model.layers.0.mlp.experts`` of ``model.layers.0.mlp.experts.<e>.gate_proj``: the experts' container."""
    return experts[0].rpartition(".")[0].rpartition(".")[0]


def _traced(module: nn.Module, names: list[str]) -> tuple[dict[str, str], dict[str, _Built]]:
    """What ``sanitize`` makes of the checkpoint tensors ``names``: ``{tensor: module parameter}`` for tensors
    it passes on as they are (renamed or not), and ``{module parameter: source}`` for stacked expert weights it
    builds (:func:`_source`). Tensors sanitize refuses (a conv weight needs its real shape) are left out:
    families of tensors (names equal but for their numbers) are traced apart when all at once fails, then
    their tensors one by one. A shallow copy of the module is traced, as sanitize may drop parts the stand-ins
    lack (a vision tower, an MTP head) from its module."""
    if not hasattr(module, "sanitize"):
        return {n: n for n in names}, {}
    tracer = copy.copy(module)

    def trace(batch: list[str]) -> tuple[dict[str, str], dict[str, _Built]]:
        # Stand-in i holds i on its first row and i + 0.5 on its second: exact in float32 below 2**22 names.
        stand_ins = {n: mx.array([[i, i], [i + 0.5, i + 0.5]], mx.float32) for i, n in enumerate(batch)}
        by_id = {id(v): k for k, v in stand_ins.items()}
        out = tracer.sanitize(dict(stand_ins))
        renamed = {by_id[id(v)]: k for k, v in out.items() if id(v) in by_id}
        built = {k: _source(v, batch) for k, v in out.items() if id(v) not in by_id and k.endswith(".weight")}
        return renamed, {k: s for k, s in built.items() if s is not None}

    try:
        return trace(names)
    except Exception:  # some tensor needs its real shape: trace families, then tensors, apart
        pass
    families: dict[str, list[str]] = {}
    for name in names:
        families.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name), []).append(name)
    renamed: dict[str, str] = {}
    built: dict[str, _Built] = {}
    for family in families.values():
        for batch in [family] if len(family) == 1 else [family, *([n] for n in family)]:
            try:
                found, made = trace(batch)
            except Exception:
                continue
            renamed |= found
            built |= made
            if batch is family:
                break
    return renamed, built


def _source(value: mx.array, batch: list[str]) -> _Built | None:
    """Which stand-ins a tensor sanitize built came from: per-expert stand-ins stacked (``[E, 2, 2]``), or one row
    of one split in two along its output axis (``[1, 2]``)."""
    if not isinstance(value, mx.array) or value.dtype != mx.float32:
        return None
    rows = np.array(value, dtype=np.float64)
    if rows.ndim == 3 and rows.shape[1:] == (2, 2):
        ids = rows[:, 0, 0]
        if np.all(rows[:, 1, :] == ids[:, None] + 0.5) and np.all(rows[:, 0, :] == ids[:, None]) \
                and np.all(ids == np.floor(ids)) and np.all((ids >= 0) & (ids < len(batch))):
            return _Built(experts=tuple(batch[int(i)] for i in ids))
    if rows.shape == (1, 2) and rows[0, 0] == rows[0, 1]:
        index = math.floor(rows[0, 0])
        if 0 <= index < len(batch):
            return _Built(fused=batch[index], part=int(round((rows[0, 0] - index) * 2)), parts=2)
    return None
