"""``load_model``: a checkpoint folder or Hub repo id in, a ready :class:`GenerativeModel` out."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .architecture import Architecture
from .chat_template import ChatTemplate, read_template_source
from .checkpoint import read_json, read_weights, resolve_checkpoint
from .errors import CheckpointError, UnsupportedQuantizationError
from .generation import GenerationConfig
from .layers.quantized import quantize
from .model import GenerativeModel
from .registry import registry
from .runtime import default_dtype
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .session import ChatSession

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
_BITS = (2, 3, 4, 5, 6, 8)
_SHOWN = 6


def load_model(
    path_or_repo: str | os.PathLike[str] | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    revision: str | None = None,
) -> GenerativeModel:
    """Load a checkpoint (local folder or Hugging Face repo id; by default the demo model shipped in the
    package, :mod:`mlxchat.demo`) with the plugin its config.json names.

    ``dtype`` is what floating-point weights are computed in; by default the checkpoint's own on a GPU
    and float32 on the CPU (see :func:`mlxchat.runtime.default_dtype`). Quantized weights stay quantized.
    """
    if path_or_repo is None:
        from .demo import default_model_path

        path_or_repo = default_model_path()
    folder = resolve_checkpoint(path_or_repo, revision)
    raw = read_json(folder / "config.json")
    arch = registry().architecture_for_config(raw)
    weights = read_weights(folder)
    if not any(name.endswith("lm_head.weight") for name in weights):
        raw = {**raw, "tie_word_embeddings": True}
        if isinstance(raw.get("text_config"), dict):
            raw["text_config"] = {**raw["text_config"], "tie_word_embeddings": True}
    config = arch.config_class.from_hf(raw)
    module = arch.model_class(config)
    weights = module.sanitize(weights)
    quantization = _quantization(raw)
    if quantization is not None:
        _quantize(module, weights, quantization)
    _check_tensors(module, weights, folder)
    target = _target_dtype(dtype, weights)
    cast = getattr(module, "cast_predicate", lambda name: True)
    weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and cast(k) else v
               for k, v in weights.items()}
    module.load_weights(list(weights.items()), strict=True)
    module.eval()
    for parameter in dict(tree_flatten(module.parameters())).values():
        mx.eval(parameter)  # one at a time: a stored copy is freed as soon as its cast copy exists

    tokenizer = Tokenizer.from_folder(folder)
    source = read_template_source(folder)
    template = ChatTemplate(source, tokenizer) if source else None
    generation = read_json(folder / "generation_config.json", required=False)
    return GenerativeModel(
        module=module,
        config=config,
        architecture=arch,
        tokenizer=tokenizer,
        chat_template=template,
        defaults=_defaults(generation),
        eos_ids=_eos_ids(raw, generation, tokenizer, arch),
        path=folder,
        dtype=target,
        quantization=quantization,
    )


def load_session(
    path_or_repo: str | os.PathLike[str] | None = None,
    *,
    system: str | None = None,
    default_config: GenerationConfig | dict[str, Any] | None = None,
    tools: Sequence[Any] | None = None,
    **load_kwargs: Any,
) -> ChatSession:
    """Load a model and open a chat session over it in one step (``load_kwargs`` go to :func:`load_model`)."""
    model = load_model(path_or_repo, **load_kwargs)
    return model.chat_session(system=system, default_config=default_config, tools=tools)


def _quantization(raw: dict[str, Any]) -> dict[str, Any] | None:
    text = raw.get("text_config")
    for source in [raw, *([text] if isinstance(text, dict) else [])]:
        for key in ("quantization", "quantization_config"):
            value = source.get(key)
            if value is None:
                continue
            if not isinstance(value, dict) or "bits" not in value or "group_size" not in value:
                method = value.get("quant_method") if isinstance(value, dict) else value
                raise UnsupportedQuantizationError(
                    f"config.json: {key} {method!r} is not supported; mlxchat loads MLX-format quantized "
                    f"checkpoints (as `mlx_lm.convert -q` writes them: \"quantization\": {{\"group_size\", \"bits\"}})"
                )
            mode = value.get("mode", "affine")
            if mode not in _QUANT_MODES or value["bits"] not in _BITS:
                raise UnsupportedQuantizationError(
                    f"config.json: quantization mode {mode!r} with {value['bits']} bits is not supported "
                    f"(modes: {', '.join(_QUANT_MODES)}; bits 2-6 or 8)"
                )
            return value
    return None


def _quantize(module: nn.Module, weights: dict[str, mx.array], quantization: dict[str, Any]) -> None:
    """Quantize the layers the checkpoint stores quantized, each with the bits and group size its own
    tensors imply (per-layer overrides in config.json use the converter's module names, which need not
    be ours, so the shapes are the reliable record)."""
    mode = quantization.get("mode", "affine")

    def predicate(path: str, layer: nn.Module) -> bool | dict[str, Any]:
        scales = weights.get(f"{path}.scales")
        packed = weights.get(f"{path}.weight")
        if scales is None or packed is None or not hasattr(layer, "to_quantized"):
            return False
        in_dims = layer.weight.shape[-1]
        bits, group_size = packed.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1]
        if bits not in _BITS or packed.shape[-1] * 32 != bits * in_dims or group_size * scales.shape[-1] != in_dims:
            raise UnsupportedQuantizationError(
                f"{path}: quantized tensors of shapes {tuple(packed.shape)} and {tuple(scales.shape)} do not fit "
                f"a layer with {in_dims} inputs"
            )
        return {"group_size": group_size, "bits": bits, "mode": mode}

    quantize(module, predicate)


def _check_tensors(module: nn.Module, weights: dict[str, mx.array], folder: Path) -> None:
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(
        f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    for label, names in (("missing tensors", missing), ("unexpected tensors", extra), ("wrong shapes", wrong)):
        if names:
            shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise CheckpointError(f"{folder}: weights do not fit the model config ({'; '.join(problems)})")


def _target_dtype(dtype: str | mx.Dtype | None, weights: dict[str, mx.array]) -> mx.Dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype is not None:
        return dtype
    floating = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    stored = max(set(floating), key=floating.count) if floating else mx.float32
    return default_dtype(stored)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any], tokenizer: Tokenizer, arch: Architecture) -> set[int]:
    ids = set(_as_list(generation.get("eos_token_id"))) | set(_as_list(raw.get("eos_token_id")))
    text = raw.get("text_config")
    if isinstance(text, dict):
        ids |= set(_as_list(text.get("eos_token_id")))
    for token in (tokenizer.eos_token, *arch.chat.stop_tokens):
        token_id = tokenizer.token_id(token) if token else None
        if token_id is not None:
            ids.add(token_id)
    return ids


def _defaults(generation: dict[str, Any]) -> GenerationConfig:
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    values = {k: generation[k] for k in keys if generation.get(k) is not None}
    if generation.get("do_sample") is False:
        values["temperature"] = 0.0
    return GenerationConfig().merged(values)
