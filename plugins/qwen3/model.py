"""Qwen3 and Qwen3-MoE: pre-norm decoder blocks of grouped-query attention (q/k RMSNorm before RoPE) and a
SwiGLU MLP, or a softmax top-k mixture of experts on the layers the config makes sparse."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from mlxchat.plugin import (
    Attention,
    CausalLM,
    Decoder,
    KVCache,
    ModelConfig,
    RMSNorm,
    RoPE,
    RopeConfig,
    SparseMoE,
    SwiGLU,
    stack_experts,
)


class Qwen3Config(ModelConfig):
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool = False
    rope: RopeConfig
    use_sliding_window: Literal[False] = False
    # qwen3_moe
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []

    def is_sparse(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


class Qwen3Block(nn.Module):
    def __init__(self, config: Qwen3Config, layer: int, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                   rope, qk_norm_eps=eps, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if config.is_sparse(layer):
            self.mlp: nn.Module = SparseMoE(h, config.moe_intermediate_size, config.num_experts,
                                            config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                                            activation=config.hidden_act)
        else:
            self.mlp = SwiGLU(h, config.intermediate_size, activation=config.hidden_act)

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3ForCausalLM(CausalLM):
    runs_ragged = True

    def __init__(self, config: Qwen3Config):
        rope = RoPE(config.head_dim, config.rope, config.max_position_embeddings)
        blocks = [Qwen3Block(config, i, rope) for i in range(config.num_hidden_layers)]
        super().__init__(config, Decoder(config.vocab_size, config.hidden_size, blocks,
                                         RMSNorm(config.hidden_size, config.rms_norm_eps)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return stack_experts(super().sanitize(weights))

