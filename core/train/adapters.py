"""Adapters in peft's files: ``adapter_config.json`` and ``adapter_model.safetensors`` with peft's tensor names
(``base_model.model.<checkpoint name>.lora_A.weight``), so transformers + peft load what we train and we load
what peft trains. Everything in the files is checked against the model before it reaches MLX.

Stacked experts are written as peft (0.21, on transformers 5) reads them: per expert
(``...experts.<e>.gate_proj.lora_A.weight``) where the checkpoint names experts one by one, otherwise in peft's
``target_parameters`` layout for the fused tensor (``...experts.lora_A.weight`` ``[experts * r, in]`` and
``lora_B.weight`` ``[out, r * experts]``; a second tensor of the same module one ``base_layer.`` deeper, in the
order transformers registers them: ``gate_up_proj`` inside ``down_proj``). Either way the config names the fused
tensors (``target_parameters``) with the rank and alpha of each (``rank_pattern``, ``alpha_pattern``): peft joins
the gate and up adapters of a fused ``gate_up_proj`` along the rank (``B`` block-diagonal), as it converts
per-expert adapters itself. Read back, a fused adapter is split again (rank columns that are zero in one half of
``B`` dropped from it), so what we wrote loads back as it was.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint import resolve_checkpoint
from ..errors import AdapterError
from ..layers.moe import FUSED_EXPERTS
from .lora import (
    Adaptable,
    LoRALinear,
    LoRASettings,
    LoRASwitchLinear,
    adapters,
    attach,
    get_layer,
    layer_shape,
    module_of,
    sites,
)
from .sites import Site

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<name>.+)\.(?:(?P<ab>lora_A|lora_B)\.weight|lora_magnitude_vector)$")
_SHOWN = 6


def save_adapter(model_or_module: Adaptable, path: str | os.PathLike[str]) -> Path:
    """Write the adapter of a model :func:`~mlxchat.train.lora` (or :func:`load_adapter`) adapted, as peft does."""
    layers = adapters(model_or_module)
    if not layers:
        raise AdapterError("the model has no adapter to save: call mlxchat.train.lora(model) first")
    settings = next(iter(layers.values())).settings
    base = None if isinstance(model_or_module, nn.Module) else model_or_module.path
    linear = [layer for layer in layers.values() if isinstance(layer, LoRALinear)]
    fused: dict[str, list[LoRASwitchLinear]] = {}
    experts = [layer for layer in layers.values() if isinstance(layer, LoRASwitchLinear)]
    for layer in sorted(experts, key=lambda layer: layer.site.part):
        fused.setdefault(str(layer.site.parameter), []).append(layer)
    # what each peft module or fused parameter needs: its rank and scale (a fused one: its first part's scale)
    units = {layer.name: (layer.lora_a.shape[0], layer.scale) for layer in linear}
    units |= {p: (sum(layer.lora_a.shape[1] for layer in parts), parts[0].scale) for p, parts in fused.items()}

    def collect() -> dict[str, mx.array]:
        tensors = {}
        for layer in linear:
            prefix = f"{_PREFIX}{layer.name}"
            tensors[f"{prefix}.lora_A.weight"] = layer.lora_a.astype(mx.float32)
            tensors[f"{prefix}.lora_B.weight"] = layer.lora_b.astype(mx.float32)
            if layer.dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = layer.m.astype(mx.float32)
        for parameter, parts in fused.items():
            tensors |= _expert_tensors(parameter, parts, fused)
        mx.eval(tensors)
        return tensors

    if not os.fspath(path):
        raise AdapterError("save_adapter needs a folder to write to (an empty path would be the current one)")
    worker = None if isinstance(model_or_module, nn.Module) else model_or_module.worker
    tensors = worker.run(collect) if worker is not None else collect()
    out = Path(path)
    ranks = {re.escape(n): r for n, (r, _) in units.items() if r != settings.rank}
    alphas = {re.escape(n): a for n, (r, s) in units.items()
              if not math.isclose(a := settings.alpha_for(s, r), settings.alpha, rel_tol=1e-9)}
    names = sorted(layer.name for layer in linear)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base) if base else None,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        # Exactly the adapted layers (a full-match regex), not the targets given: from a list of names peft would
        # also wrap layers that have no adapter here.
        "target_modules": "^(?:" + "|".join(re.escape(n) for n in names) + ")$" if names else [],
        **({"target_parameters": sorted(fused)} if fused else {}),
        "use_dora": settings.dora, "use_rslora": settings.rslora, "rank_pattern": ranks, "alpha_pattern": alphas,
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True,
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / WEIGHTS_FILE), tensors, metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    except (OSError, RuntimeError) as exc:
        raise AdapterError(f"cannot write the adapter to {out} ({type(exc).__name__}: {exc})") from None
    return out


def _expert_tensors(parameter: str, parts: list[LoRASwitchLinear],
                    fused: dict[str, list[LoRASwitchLinear]]) -> dict[str, mx.array]:
    """peft's tensors for the stacked experts adapted as ``parameter`` (``parts``: its projections in order; one
    fused tensor: the gate and up projections of ``gate_up_proj`` joined along the rank, ``B`` block-diagonal,
    each half's scale folded into its ``B`` relative to the first's)."""
    site = parts[0].site
    if len(parts) != site.parts:
        raise AdapterError(f"{parameter}: only {len(parts)} of its {site.parts} projections have adapters; peft "
                           "adapts the fused tensor whole")
    scale = parts[0].scale
    a_parts = [layer.lora_a.astype(mx.float32) for layer in parts]
    b_parts = [layer.lora_b.astype(mx.float32) * (layer.scale / scale) for layer in parts]
    if site.experts:  # per expert, under the checkpoint's names (peft joins them into the fused tensor)
        tensors = {}
        for layer, a, b in zip(parts, a_parts, b_parts, strict=True):
            for e, name in enumerate(layer.site.experts):
                tensors[f"{_PREFIX}{name}.lora_A.weight"] = a[e]
                tensors[f"{_PREFIX}{name}.lora_B.weight"] = b[e]
        return tensors
    experts = a_parts[0].shape[0]
    a = mx.concatenate(a_parts, axis=1)  # [E, R, in]
    rows = []
    at = 0
    for b in b_parts:  # [E, out_k, r_k] into its columns of [E, out_k, R]
        r = b.shape[2]
        rows.append(mx.pad(b, [(0, 0), (0, 0), (at, a.shape[1] - at - r)]))
        at += r
    b = mx.concatenate(rows, axis=1)  # [E, out, R]
    container = parameter.rpartition(".")[0]
    siblings = sorted((p for p in fused if p.rpartition(".")[0] == container), key=_registered)
    key = f"{_PREFIX}{container}" + ".base_layer" * (len(siblings) - 1 - siblings.index(parameter))
    return {f"{key}.lora_A.weight": a.reshape(experts * a.shape[1], a.shape[2]),
            f"{key}.lora_B.weight": b.transpose(1, 2, 0).reshape(b.shape[1], -1)}


def _registered(parameter: str) -> tuple[int, str]:
    """Where transformers registers a fused expert tensor in its module (peft wraps the first innermost)."""
    leaf = parameter.rpartition(".")[2]
    order = list(FUSED_EXPERTS)
    return (order.index(leaf) if leaf in order else len(order), leaf)


def load_adapter(model_or_module: Adaptable, path_or_repo: str | os.PathLike[str]) -> list[str]:
    """Put the adapter in a folder (or Hub repo) peft or :func:`save_adapter` wrote on the model, unfused, in place
    of any adapter it has. Returns the checkpoint names adapted."""
    folder = resolve_checkpoint(path_or_repo)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.exists():
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (not a peft adapter folder)")
    if not weights_path.exists():
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (peft writes it with save_pretrained; .bin files are "
                           "not read)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"{config_path}: cannot read the adapter config: {exc}") from exc
    settings = settings_from(config, str(config_path))
    module = module_of(model_or_module)

    def apply() -> list[str]:  # on the model's worker: the tensors read belong to its stream
        try:
            tensors = cast(dict[str, mx.array], mx.load(str(weights_path)))
        except (OSError, ValueError, RuntimeError) as exc:
            raise AdapterError(f"{weights_path}: cannot read the adapter weights: {exc}") from exc
        source = str(weights_path)
        groups = _grouped(tensors, source)
        placed = _placed(model_or_module, groups, settings, source)
        made = attach(module, [p.site for p in placed], settings)
        for found in placed:
            layer = made[found.site.path]
            layer.lora_a, layer.lora_b = found.a, found.b
            if isinstance(layer, LoRASwitchLinear):
                layer.scale = found.scale
            elif found.magnitude is not None:
                layer.m = found.magnitude
        mx.eval(module.trainable_parameters())
        return sorted(p.site.name for p in placed)

    if isinstance(model_or_module, nn.Module):
        return apply()
    return model_or_module.worker.run(apply)  # type: ignore[no-any-return]


@dataclass
class _Placed:
    """An adapter read from the files, for one layer."""

    site: Site
    a: mx.array
    b: mx.array
    scale: float
    magnitude: mx.array | None = None


def _placed(model_or_module: Adaptable, groups: dict[str, dict[str, mx.array]], settings: LoRASettings,
            source: str) -> list[_Placed]:
    """Each group of tensors on the layer it adapts: a linear layer (its name), one expert of stacked experts
    (per-expert names) or a fused expert tensor (peft's ``target_parameters`` layout, told apart by shape among
    the tensors of its module that the config targets)."""
    candidates = {name: _parameters(name, settings.parameters) for name in groups}
    wanted = [f"{n}.weight" for n in groups] + sorted({p for ps in candidates.values() for p in ps})
    found = sites(model_or_module, wanted)
    module = module_of(model_or_module)
    linear = {s.name: s for s in found if not s.stacked}
    per_expert = {name: (s, e) for s in found for e, name in enumerate(s.experts)}
    fused: dict[str, list[Site]] = {}
    for s in found:
        if s.stacked and not s.experts:
            fused.setdefault(str(s.parameter), []).append(s)
    fits = {name: [p for p in candidates[name] if p in fused and _fits(groups[name], fused[p], module)]
            for name in groups if name not in linear and name not in per_expert}
    unplaced = sorted(name for name, found_in in fits.items() if len(found_in) != 1)
    if unplaced:  # experts of a stack the adapter covers in part trace only through the model's own names
        own = {name: (s, e) for s in sites(model_or_module) for e, name in enumerate(s.experts)}
        per_expert |= {name: own[name] for name in groups if name in own}
        unplaced = [name for name in unplaced if name not in per_expert]
    if unplaced:
        raise AdapterError(f"{source}: the adapter is for another model: {_listed(unplaced)} are not layers of this "
                           "one (or do not fit them)")
    placed: list[_Placed] = []
    experts: dict[str, dict[int, tuple[str, dict[str, mx.array]]]] = {}
    for name, parts in groups.items():
        _check_matrices(name, parts, source)
        if name in linear:
            site = linear[name]
            _check(name, parts, layer_shape(_layer(module, site.path)), settings, source)
            placed.append(_Placed(site, parts["lora_A"].astype(mx.float32), parts["lora_B"].astype(mx.float32),
                                  settings.scale_for(name), _magnitude(parts)))
        elif name in per_expert:
            site, e = per_expert[name]
            experts.setdefault(site.path, {})[e] = (name, parts)
        else:
            layers = sorted(fused[fits[name][0]], key=lambda s: s.part)
            placed.extend(_split(name, parts, layers, module, settings, source))
    by_path = {s.path: s for s, _ in per_expert.values()}
    placed.extend(_stacked(by_path[path], pieces, module, settings, source) for path, pieces in experts.items())
    seen = [p.site.path for p in placed]
    if len(seen) != len(set(seen)):
        raise AdapterError(f"{source}: some layers have two adapters (per expert and fused)")
    return placed


def _parameters(name: str, targets: Iterable[str]) -> list[str]:
    """The fused tensors peft may have adapted under tensor name ``name`` (``<module>[.base_layer...]``): those of
    the module the config's ``target_parameters`` name (peft's rule: the name, or ``.`` and it, ends it)."""
    container = name
    while container.endswith(".base_layer"):
        container = container[: -len(".base_layer")]
    found = {f"{container}.{target.rpartition('.')[2]}" for target in targets}
    return sorted(c for c in found if any(c == t or c.endswith("." + t) for t in targets))


def _fits(parts: dict[str, mx.array], layers: list[Site], module: nn.Module) -> bool:
    experts, _, in_dims = layer_shape(_layer(module, layers[0].path))
    out_dims = sum(layer_shape(_layer(module, s.path))[1] for s in layers)
    a, b = parts["lora_A"], parts["lora_B"]
    return (len(layers) == layers[0].parts and a.ndim == b.ndim == 2 and a.shape[1] == in_dims
            and b.shape[0] == out_dims
            and a.shape[0] == b.shape[1] and a.shape[0] % experts == 0)


def _split(name: str, parts: dict[str, mx.array], layers: list[Site], module: nn.Module, settings: LoRASettings,
           source: str) -> list[_Placed]:
    """A fused tensor's adapter (peft's flattened ``[E * R, in]``, ``[out, R * E]``) as one per projection it
    holds, each keeping the rank columns its half of ``B`` uses (all of them, unless some are zero throughout)."""
    parameter = str(layers[0].parameter)
    if "magnitude" in parts:
        raise AdapterError(f"{source}: {name}: DoRA on expert weights ({parameter}) is not supported (nor by peft)")
    experts = layer_shape(_layer(module, layers[0].path))[0]
    rank = parts["lora_A"].shape[0] // experts
    if rank != settings.rank_for(parameter):
        raise AdapterError(f"{source}: {name}: rank {rank} ({parameter}) does not match "
                           f"r={settings.rank_for(parameter)} in {CONFIG_FILE}")
    a = parts["lora_A"].astype(mx.float32).reshape(experts, rank, -1)
    b = parts["lora_B"].astype(mx.float32).reshape(-1, rank, experts).transpose(2, 0, 1)  # [E, out, R]
    scale = settings.scale_for(parameter)
    placed, at = [], 0
    for site in layers:
        rows = layer_shape(_layer(module, site.path))[1]
        half = b[:, at: at + rows]
        at += rows
        used = np.flatnonzero(np.any(np.array(half) != 0, axis=(0, 1)))
        keep = mx.array(used if used.size else np.arange(1))
        placed.append(_Placed(site, a[:, keep], half[:, :, keep], scale))
    return placed


def _stacked(site: Site, pieces: dict[int, tuple[str, dict[str, mx.array]]], module: nn.Module,
             settings: LoRASettings, source: str) -> _Placed:
    """Per-expert adapters stacked for their experts' layer (all experts, one rank and scale)."""
    experts, out_dims, in_dims = layer_shape(_layer(module, site.path))
    missing = sorted(set(range(experts)) - set(pieces))
    if len(site.experts) != experts or missing:
        raise AdapterError(f"{source}: {site.name}: adapters for {len(pieces)} of its {experts} experts; an adapter "
                           "of stacked experts covers them all")
    names = [pieces[e][0] for e in range(experts)]
    if any("magnitude" in pieces[e][1] for e in range(experts)):
        raise AdapterError(f"{source}: {names[0]}: DoRA on expert weights is not supported (nor by peft)")
    for name, parts in pieces.values():
        _check(name, parts, (out_dims, in_dims), settings, source)
    scales = {settings.scale_for(n) for n in names}
    if len({settings.rank_for(n) for n in names}) > 1 or len(scales) > 1:
        raise AdapterError(f"{source}: {site.name}: its experts' adapters differ in rank or alpha")
    a = mx.stack([pieces[e][1]["lora_A"] for e in range(experts)]).astype(mx.float32)
    b = mx.stack([pieces[e][1]["lora_B"] for e in range(experts)]).astype(mx.float32)
    return _Placed(site, a, b, scales.pop())


def settings_from(config: Any, source: str) -> LoRASettings:
    """The adapter settings of a peft ``adapter_config.json``, refusing what we would apply differently."""
    if not isinstance(config, dict):
        raise AdapterError(f"{source}: expected a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{source}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    refused: dict[str, tuple[Any, Any]] = {
        "bias": ("none", None), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
        "layers_to_transform": (None, []), "use_qalora": (False, None),
        "lora_bias": (False, None)}
    for key, allowed in refused.items():
        if config.get(key) not in allowed:
            raise AdapterError(f"{source}: {key}={config[key]!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{source}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{source}: lora_alpha must be a positive number, got {alpha!r}")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):
        targets = (targets,)  # a regex in peft; here only the names the weights list are adapted anyway
    if not isinstance(targets, list | tuple) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{source}: target_modules must be a name or a list of names")
    parameters = config.get("target_parameters") or []
    if not isinstance(parameters, list) or not all(isinstance(p, str) and p for p in parameters):
        raise AdapterError(f"{source}: target_parameters must be a list of tensor names")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not (isinstance(ranks, dict) and isinstance(alphas, dict)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ranks.values())
            and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                    for v in alphas.values())):
        raise AdapterError(f"{source}: rank_pattern and alpha_pattern must map names to positive numbers")
    for pattern in (*ranks, *alphas):
        try:
            re.compile(rf"(.*\.)?({pattern})$")  # as it is used (a global flag inside is an error there)
        except re.error as exc:
            raise AdapterError(f"{source}: {pattern!r} in rank_pattern or alpha_pattern is no pattern ({exc})") \
                from None
    dropout = config.get("lora_dropout") or 0.0
    if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise AdapterError(f"{source}: lora_dropout must be a number from 0 to below 1, got {dropout!r}")
    flags = {key: config.get(key, False) for key in ("use_dora", "use_rslora")}
    if not all(isinstance(value, bool) or value is None for value in flags.values()):
        raise AdapterError(f"{source}: use_dora and use_rslora must be true or false, got {flags}")
    return LoRASettings(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets),
                        parameters=tuple(parameters), dora=bool(flags["use_dora"]), rslora=bool(flags["use_rslora"]),
                        rank_pattern=dict(ranks), alpha_pattern=dict(alphas))


def _grouped(tensors: dict[str, mx.array], source: str) -> dict[str, dict[str, mx.array]]:
    """``{checkpoint name: {"lora_A": ..., "lora_B": ..., ["magnitude": ...]}}`` from peft's tensor names."""
    groups: dict[str, dict[str, mx.array]] = {}
    unknown = []
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            unknown.append(key)
            continue
        groups.setdefault(match["name"], {})[match["ab"] or "magnitude"] = value
    if unknown:
        raise AdapterError(f"{source}: tensors that are not peft LoRA weights: {_listed(sorted(unknown))}")
    if not groups:
        raise AdapterError(f"{source}: no LoRA tensors")
    incomplete = sorted(n for n, parts in groups.items() if not {"lora_A", "lora_B"} <= set(parts))
    if incomplete:
        raise AdapterError(f"{source}: lora_A or lora_B missing for {_listed(incomplete)}")
    return groups


def _check_matrices(name: str, parts: dict[str, mx.array], source: str) -> None:
    a, b = parts["lora_A"], parts["lora_B"]
    if a.ndim != 2 or b.ndim != 2 or not mx.issubdtype(a.dtype, mx.floating) or not mx.issubdtype(b.dtype,
                                                                                                   mx.floating):
        raise AdapterError(f"{source}: {name}: lora_A and lora_B must be floating-point matrices")
    if not all(mx.isfinite(part).all().item() for part in parts.values() if mx.issubdtype(part.dtype, mx.floating)):
        raise AdapterError(f"{source}: {name}: its weights hold NaN or infinite values (every logit would be NaN)")


def _magnitude(parts: dict[str, mx.array]) -> mx.array | None:
    magnitude = parts.get("magnitude")
    return None if magnitude is None else magnitude.astype(mx.float32)


def _check(name: str, parts: dict[str, mx.array], shape: tuple[int, ...], settings: LoRASettings, source: str) -> None:
    out_dims, in_dims = shape[-2:]
    rank = settings.rank_for(name)
    a, b = parts["lora_A"], parts["lora_B"]
    if a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"{source}: {name}: rank {a.shape[0]} (lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}) "
                           f"does not match r={rank} in {CONFIG_FILE}")
    if a.shape[1] != in_dims or b.shape[0] != out_dims:
        raise AdapterError(f"{source}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                           f"layer of {in_dims} inputs and {out_dims} outputs (an adapter for another base model)")
    magnitude = parts.get("magnitude")
    if settings.dora != (magnitude is not None):
        raise AdapterError(f"{source}: {name}: use_dora={settings.dora} but the magnitude vector is "
                           f"{'missing' if magnitude is None else 'present'}")
    if magnitude is not None and tuple(magnitude.shape) != (out_dims,):
        raise AdapterError(f"{source}: {name}: lora_magnitude_vector {tuple(magnitude.shape)} does not fit "
                           f"{out_dims} outputs")


def _layer(module: nn.Module, path: str) -> nn.Module:
    layer = get_layer(module, path)
    return layer.base if isinstance(layer, (LoRALinear, LoRASwitchLinear)) else layer


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
