"""Qwen3.5 and Qwen3.5-MoE: a hybrid decoder. Most layers mix tokens with a Gated DeltaNet (linear
attention, a fixed-size state); every few layers one uses softmax attention whose output is gated by a
sigmoid of a second query projection. The feed-forward is a SwiGLU MLP, or in the MoE variant a softmax
top-k mixture of experts plus a sigmoid-gated shared expert in every layer.

Checkpoints are released as a vision-language model: the text model sits under ``text_config`` and
``model.language_model.*``; the vision tower and the multi-token-prediction head are not used here.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import model_validator

from mlxchat.plugin import (
    CausalLM,
    CheckpointError,
    Decoder,
    GatedDeltaNet,
    KVCache,
    LayerCache,
    ModelConfig,
    RMSNorm,
    RoPE,
    RopeConfig,
    SparseMoE,
    StateCache,
    SwiGLU,
    attend,
    stack_experts,
)

LayerType = Literal["linear_attention", "full_attention"]


class Qwen35Config(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool = False
    rope: RopeConfig
    layer_types: list[LayerType]
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 0
    # qwen3_5_moe: every layer is sparse
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def default_layer_types(cls, data: dict[str, Any]) -> list[str]:
        """transformers writes layer_types; older configs only give the interval (every n-th is full)."""
        n = data.get("full_attention_interval") or 4
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(data["num_hidden_layers"])]

    @model_validator(mode="before")
    @classmethod
    def _rope_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("rope"), dict):
            rope = dict(data["rope"])
            rope.setdefault("partial_rotary_factor", 0.25)
            if rope.get("rope_type") == "mrope":  # text-only positions make mRoPE plain 1-D RoPE
                rope["rope_type"] = "default"
            data["rope"] = rope
        return data

    @model_validator(mode="after")
    def _check(self) -> Qwen35Config:
        if self.num_experts == 0 and self.intermediate_size == 0:
            raise ValueError("neither intermediate_size (dense) nor num_experts (MoE) is set")
        return self

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)


class GatedAttention(nn.Module):
    """Grouped-query attention with q/k RMSNorm, partial RoPE and an output gate: ``q_proj`` yields
    ``[q_h | gate_h]`` per head and the output is ``o_proj(attn * sigmoid(gate))``."""

    def __init__(self, config: Qwen35Config, rope: RoPE):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KVCache | None = None) -> mx.array:
        batch, length, _ = x.shape
        queries = self.q_proj(x).reshape(batch, length, self.num_heads, 2 * self.head_dim)
        q, gate = mx.split(queries, 2, axis=-1)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        q, k, v = self.q_norm(q).swapaxes(1, 2), self.k_norm(k).swapaxes(1, 2), v.swapaxes(1, 2)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        out = attend(q, k, v, cache, self.head_dim**-0.5).swapaxes(1, 2)
        return self.o_proj((out * mx.sigmoid(gate)).reshape(batch, length, -1))


class Qwen35Block(nn.Module):
    def __init__(self, config: Qwen35Config, layer: int, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[layer] == "linear_attention"
        self.input_layernorm = RMSNorm(h, eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(h, config.linear_num_key_heads, config.linear_num_value_heads,
                                             config.linear_key_head_dim, config.linear_value_head_dim,
                                             config.linear_conv_kernel_dim, eps)
        else:
            self.self_attn = GatedAttention(config, rope)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if config.num_experts:
            shared = config.shared_expert_intermediate_size or None
            self.mlp: nn.Module = SparseMoE(h, config.moe_intermediate_size, config.num_experts,
                                            config.num_experts_per_tok, norm_topk_prob=True,
                                            shared_intermediate_size=shared, activation=config.hidden_act)
        else:
            self.mlp = SwiGLU(h, config.intermediate_size, activation=config.hidden_act)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# Norms that HF-layout checkpoints store zero-centred (the forward multiplies by 1 + w). The gated norm
# of the DeltaNet (`linear_attn.norm`) is not one of them.
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
_SKIPPED = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, config: Qwen35Config):
        rope = RoPE(config.rotary_dims, config.rope, config.max_position_embeddings)
        blocks = [Qwen35Block(config, i, rope) for i in range(config.num_hidden_layers)]
        super().__init__(config, Decoder(config.vocab_size, config.hidden_size, blocks,
                                         RMSNorm(config.hidden_size, config.rms_norm_eps)))

    def make_cache(self) -> list[LayerCache]:
        return [StateCache(2) if block.is_linear else KVCache() for block in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Released (HF) and mlx-lm-converted checkpoints to this module's names and conventions.

        HF layout is told apart by its PyTorch conv weights ``[C, 1, K]``; only then are the conv weights
        moved to MLX's ``[C, K, 1]`` and the zero-centred norms given their ``1 +`` (mlx-lm folds both in
        when it converts, so its checkpoints already have them).
        """
        renamed = {}
        for key, value in weights.items():
            if key.startswith("model.language_model."):
                key = "model." + key[len("model.language_model."):]
            elif key.startswith("language_model."):  # mlx-lm: language_model.{model,lm_head}.*
                key = key[len("language_model."):]
            if not key.startswith(_SKIPPED):
                renamed[key] = value
        convs = {k: v for k, v in renamed.items() if k.endswith("linear_attn.conv1d.weight")}
        for key, value in convs.items():
            if value.ndim != 3 or 1 not in value.shape[1:]:
                raise CheckpointError(f"{key}: a depthwise conv weight is [C, 1, K] or [C, K, 1], "
                                      f"got {tuple(value.shape)}")
        hf_layout = any(v.shape[1] == 1 and v.shape[2] > 1 for v in convs.values())
        if hf_layout:
            for key, value in renamed.items():
                if key in convs:
                    renamed[key] = value.swapaxes(1, 2)
                elif key.endswith(_ZERO_CENTRED) and value.ndim == 1:
                    renamed[key] = value + 1.0
        return stack_experts(super().sanitize(renamed))
