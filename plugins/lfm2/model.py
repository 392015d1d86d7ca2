"""LFM2 / LFM2.5 (``lfm2``) and LFM2-MoE (``lfm2_moe``): pre-norm blocks whose token mixer is either a
gated short convolution or grouped-query attention (q/k RMSNorm before RoPE), followed by a SwiGLU
feed-forward, or from ``num_dense_layers`` on in ``lfm2_moe``, a sigmoid-routed mixture of experts."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import model_validator

from mlxchat.plugin import (
    Attention,
    CausalLM,
    Decoder,
    KVCache,
    LayerCache,
    ModelConfig,
    RMSNorm,
    RoPE,
    RopeConfig,
    ShortConv,
    SparseMoE,
    StateCache,
    SwiGLU,
    depthwise_weight,
    stack_experts,
)

LayerType = Literal["conv", "full_attention"]


class Lfm2Config(ModelConfig):
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: list[LayerType]
    rope: RopeConfig
    conv_L_cache: int = 3
    conv_bias: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 128_000
    # lfm2: the feed-forward width is derived from intermediate_size (``block_ff_dim``)
    block_auto_adjust_ff_dim: bool = True
    block_ffn_dim_multiplier: float | None = 1.0
    block_multiple_of: int = 256
    # lfm2_moe
    num_dense_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, default_theta: float = 1e6) -> ModelConfig:
        return super().from_hf(raw, default_theta=default_theta)

    @classmethod
    def default_layer_types(cls, data: dict[str, Any]) -> list[str]:
        """Older (v1) configs list the attention layers in ``full_attn_idxs``; without it every layer attends."""
        layers = data["num_hidden_layers"]
        attention = data.get("full_attn_idxs")
        attention = range(layers) if attention is None else attention
        return ["full_attention" if i in attention else "conv" for i in range(layers)]

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        """Keys transformers' ``Lfm2Config`` accepts besides its own, and its defaults where they matter."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        hidden = data.get("hidden_size")
        if data.get("block_dim") not in (None, hidden):
            raise ValueError(f"block_dim {data['block_dim']} differs from hidden_size {hidden}")
        if "tie_embedding" in data:
            data["tie_word_embeddings"] = data["tie_embedding"]
        if data.get("block_ff_dim") is not None:
            data["intermediate_size"] = data["block_ff_dim"]
        data["rms_norm_eps"] = data.get("norm_eps", 1e-5)
        return data

    def is_sparse(self, layer: int) -> bool:
        return self.model_type == "lfm2_moe" and layer >= self.num_dense_layers

    @property
    def feed_forward_width(self) -> int:
        """The dense feed-forward width: LFM2 shrinks ``intermediate_size`` to 2/3 and rounds it up."""
        width = self.intermediate_size
        if self.model_type == "lfm2_moe" or not self.block_auto_adjust_ff_dim:
            return width
        width = int(2 * width / 3)
        if self.block_ffn_dim_multiplier is not None:  # transformers rounds only in this case
            width = int(self.block_ffn_dim_multiplier * width)
            width = self.block_multiple_of * math.ceil(width / self.block_multiple_of)
        return width


class Lfm2MoE(SparseMoE):
    """Experts chosen by sigmoid scores plus ``expert_bias``; weighted by the unbiased scores, renormalised
    and scaled by ``routed_scaling_factor``."""

    def __init__(self, config: Lfm2Config):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob)
        self.routed_scaling_factor = config.routed_scaling_factor
        if config.use_expert_bias:
            self.expert_bias = mx.zeros((config.num_experts,))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        choice = scores + self.expert_bias if "expert_bias" in self else scores
        indices = mx.stop_gradient(mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
        return (weights * self.routed_scaling_factor).astype(x.dtype), indices


class Lfm2Block(nn.Module):
    def __init__(self, config: Lfm2Config, layer: int, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.operator_norm = RMSNorm(h, eps)
        self.is_attention = config.layer_types[layer] == "full_attention"
        if self.is_attention:
            self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim, rope, qk_norm_eps=eps)
        else:
            self.conv = ShortConv(h, config.conv_L_cache, bias=config.conv_bias)
        self.ffn_norm = RMSNorm(h, eps)
        if config.is_sparse(layer):
            self.feed_forward: nn.Module = Lfm2MoE(config)
        else:
            self.feed_forward = SwiGLU(h, config.feed_forward_width)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        mixer = self.self_attn if self.is_attention else self.conv
        h = x + mixer(self.operator_norm(x), cache)
        return h + self.feed_forward(self.ffn_norm(h))


# Checkpoint names (transformers' and mlx-lm's) of the modules core layers name otherwise.
_RENAMES = {
    "model.embedding_norm": "model.norm",  # applied after the last layer: the final norm
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}
_RENAME_RE = re.compile(r"(?<![^.])(" + "|".join(map(re.escape, _RENAMES)) + r")(?=\.)")


class Lfm2ForCausalLM(CausalLM):
    runs_ragged = True

    def __init__(self, config: Lfm2Config):
        rope = RoPE(config.head_dim, config.rope, config.max_position_embeddings)
        blocks = [Lfm2Block(config, i, rope) for i in range(config.num_hidden_layers)]
        super().__init__(config, Decoder(config.vocab_size, config.hidden_size, blocks,
                                         RMSNorm(config.hidden_size, config.rms_norm_eps)))

    def make_cache(self) -> list[LayerCache]:
        return [KVCache() if layer.is_attention else StateCache(1) for layer in self.model.layers]

    def cast_predicate(self, name: str) -> bool:
        """``expert_bias`` only ranks experts: keep it as stored (a bfloat16 cast can reorder close scores)."""
        return not name.endswith("expert_bias")

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for key, value in super().sanitize(weights).items():
            key = _RENAME_RE.sub(lambda m: _RENAMES[m.group(1)], key)
            if key.endswith(".conv.conv.weight"):
                value = depthwise_weight(key, value)
            out[key] = value
        return stack_experts(out)

