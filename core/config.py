"""Model configs: pydantic models over ``config.json`` that accept the transformers-4 and -5 dialects.

A plugin declares the fields its forward reads by subclassing :class:`ModelConfig`;
:meth:`ModelConfig.from_hf` flattens a multimodal wrapper (``text_config``) and maps the dialects onto
one shape before validation, so plugins never re-implement config fallbacks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import CheckpointError


class RopeConfig(BaseModel):
    """Rotary embedding parameters (transformers 5 ``rope_parameters``; 4.x ``rope_theta`` + ``rope_scaling``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    rope_type: str = "default"
    rope_theta: float = Field(10000.0, gt=0)
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    """Share of a head's features that rotate: more than all of them would rotate features past the head's."""
    factor: float | None = Field(None, gt=0)
    original_max_position_embeddings: int | None = Field(None, gt=0)
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
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise CheckpointError(f"config.json: {key} must be a JSON object, got {type(raw[key]).__name__}")
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", default_theta)
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in raw:
        params["partial_rotary_factor"] = raw["partial_rotary_factor"]
    if raw.get("original_max_position_embeddings") is not None:  # Phi-3 style: the top-level key wins
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return params


class ModelConfig(BaseModel):
    """Base of every plugin's config: the keys all decoder-only chat models share, and transformers'
    defaults for the ones many declare.

    A subclass that declares ``head_dim`` gets ``hidden_size // num_attention_heads`` when config.json has
    none (or null), one that declares ``num_key_value_heads`` gets ``num_attention_heads``, and one that
    declares ``layer_types`` gets :meth:`default_layer_types` (override it for older configs that name the
    pattern otherwise); the layer types must then be one per layer, and query heads must be a multiple of
    KV heads. A subclass's own ``mode="before"`` validators run first and can set other defaults.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    model_type: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    hidden_act: Literal["silu", "gelu", "gelu_pytorch_tanh"] = "silu"
    """Activation of the gated feed-forward, for families whose transformers class reads ``hidden_act``."""

    @classmethod
    def default_layer_types(cls, data: dict[str, Any]) -> list[str] | None:
        """The layer pattern of a config.json without ``layer_types`` (``None``: the key is required)."""
        return None

    @model_validator(mode="before")
    @classmethod
    def _transformers_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        fields = cls.model_fields
        heads, hidden = data.get("num_attention_heads"), data.get("hidden_size")
        if "head_dim" in fields and data.get("head_dim") is None and isinstance(heads, int) and heads > 0 \
                and isinstance(hidden, int):
            data["head_dim"] = hidden // heads
        if "num_key_value_heads" in fields and data.get("num_key_value_heads") is None:
            data["num_key_value_heads"] = heads
        if "layer_types" in fields and data.get("layer_types") is None and isinstance(data.get("num_hidden_layers"),
                                                                                    int):
            data["layer_types"] = cls.default_layer_types(data)
        return data

    @model_validator(mode="after")
    def _shared_checks(self) -> ModelConfig:
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be at least 1, got {self.max_position_embeddings}")
        if self.rms_norm_eps < 0:
            raise ValueError(f"rms_norm_eps must not be negative, got {self.rms_norm_eps}")
        types = getattr(self, "layer_types", None)
        if types is not None and len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_hidden_layers} layers")
        heads, kv_heads = getattr(self, "num_attention_heads", None), getattr(self, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads <= 0 or heads % kv_heads):
            raise ValueError(f"num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads "
                             f"({kv_heads})")
        return self

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, default_theta: float = 10000.0) -> ModelConfig:
        """Validate a ``config.json`` dict, reading the text model out of a multimodal wrapper."""
        if raw.get("text_config") is not None and not isinstance(raw["text_config"], dict):
            raise CheckpointError(f"config.json: text_config must be a JSON object, got "
                                  f"{type(raw['text_config']).__name__}")
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
