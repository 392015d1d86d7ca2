"""Saving a trained model as a Hugging Face checkpoint folder that mlxchat and transformers both load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import CheckpointError
from ..tokenizer import Tokenizer

_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def save_checkpoint(
    folder: str | os.PathLike[str],
    module: nn.Module,
    *,
    config: dict[str, Any],
    tokenizer: Tokenizer,
    chat_template: str | None = None,
    generation_config: dict[str, Any] | None = None,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (in ``dtype``), ``tokenizer.json``,
    ``tokenizer_config.json`` (the tokenizer's special-token settings, its added tokens and
    ``chat_template``) and ``generation_config.json``.

    Tensors are saved under the module's parameter names, which are the checkpoint names for plugins whose
    ``sanitize`` only drops or ties tensors (dense decoders such as Qwen3); a tied output projection is
    left out, as transformers saves it. Quantized layers keep their packed weights (``dtype`` applies to
    floating-point tensors only): with the source's ``quantization`` config they load back as they were.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_NAMES.values())}, got {dtype}")
    out = Path(folder)
    try:  # a full disk, a folder not writable: a CheckpointError saying where
        out.mkdir(parents=True, exist_ok=True)
        weights = {name: value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
                   for name, value in dict(tree_flatten(module.parameters())).items()}
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        _write_json(out / "config.json", {**config, "dtype": _DTYPE_NAMES[dtype]})

        tokenizer.backend.save(str(out / "tokenizer.json"))
        added = {
            str(index): {"content": tok.content, "special": tok.special, "lstrip": tok.lstrip,
                         "rstrip": tok.rstrip, "normalized": tok.normalized, "single_word": tok.single_word}
            for index, tok in sorted(tokenizer.backend.get_added_tokens_decoder().items())
        }
        settings = {k: v for k, v in tokenizer.config.items()
                    if k not in ("added_tokens_decoder", "chat_template", "tokenizer_class")}
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **settings,
                            "added_tokens_decoder": added}
        if chat_template is not None:
            tokenizer_config["chat_template"] = chat_template
        _write_json(out / "tokenizer_config.json", tokenizer_config)
        if generation_config is not None:
            _write_json(out / "generation_config.json", generation_config)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot write the checkpoint to {out} ({type(exc).__name__}: {exc})") from None
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
