"""Llama 3.x and Mistral: pre-norm decoder blocks of grouped-query attention (rotary embedding, with
Llama 3.1's ``llama3`` frequency scaling when the config says so) and a SwiGLU MLP. Mistral's
``sliding_window``, when set, limits every layer's attention to that many positions; those layers then
keep only their window in a sliding-window cache."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

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
    SlidingWindowCache,
    SwiGLU,
)


class LlamaConfig(ModelConfig):
    """The keys the forward reads; ``head_dim`` and ``num_key_value_heads`` default as in transformers."""

    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig
    sliding_window: int | None = None
    """Mistral: each position attends to itself and the ``sliding_window - 1`` before it (``None``: all)."""


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                   rope, bias=config.attention_bias, window=config.sliding_window)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.intermediate_size, bias=config.mlp_bias, activation=config.hidden_act)

    def __call__(self, x: mx.array, cache: LayerCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLM):
    config: LlamaConfig
    runs_ragged = True  # its only layers with a cache are core's Attention

    def __init__(self, config: LlamaConfig):
        rope = RoPE(config.head_dim, config.rope, config.max_position_embeddings)
        blocks = [LlamaBlock(config, rope) for _ in range(config.num_hidden_layers)]
        super().__init__(config, Decoder(config.vocab_size, config.hidden_size, blocks,
                                         RMSNorm(config.hidden_size, config.rms_norm_eps)))

    def make_cache(self) -> list[LayerCache]:
        window = self.config.sliding_window
        return [KVCache() if window is None else SlidingWindowCache(window) for _ in self.model.layers]
