"""Model configs: pydantic models over ``config.json`` that accept the transformers-4 and -5 dialects.

A plugin declares the fields its forward reads by subclassing :class:`ModelConfig`;
:meth:`ModelConfig.from_hf` flattens a multimodal wrapper (``text_config``) and maps the dialects onto
one shape before validation, so plugins never re-implement config fallbacks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import CheckpointError


class RopeConfig(BaseModel):
    """Rotary embedding parameters (transformers 5 ``rope_parameters``; 4.x ``rope_theta`` + ``rope_scaling``)."""

    model_config = ConfigDict(extra="ignore")

    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @model_validator(mode="before")
    @classmethod
    def _legacy_type_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rope_type" not in data and "type" in data:
            data = {**data, "rope_type": data["type"]}
        return data


def normalize_rope(raw: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """One ``rope_parameters`` dict from either dialect (4.x top-level keys win only where 5.x has none)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", default_theta)
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in raw:
        params["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return params


class ModelConfig(BaseModel):
    """Base of every plugin's config: the keys all decoder-only chat models share."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    hidden_act: Literal["silu", "gelu_pytorch_tanh", "gelu"] = "silu"

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, default_theta: float = 10000.0) -> ModelConfig:
        """Validate a ``config.json`` dict, reading the text model out of a multimodal wrapper."""
        text = dict(raw.get("text_config") or {})
        merged = {**{k: v for k, v in raw.items() if k != "text_config"}, **text}
        if text:
            # A wrapper's tie flag is the one transformers honours; either flag set means tied.
            merged["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings")) or bool(
                text.get("tie_word_embeddings")
            )
        if "num_local_experts" in merged and "num_experts" not in merged:
            merged["num_experts"] = merged["num_local_experts"]
        if "rope" in cls.model_fields:
            merged["rope"] = normalize_rope(merged, default_theta)
        try:
            return cls.model_validate(merged)
        except Exception as exc:  # pydantic.ValidationError, reworded for the user
            raise CheckpointError(f"config.json does not describe a valid {cls.__name__}: {exc}") from exc
