"""Gemma 4's vision tower (``vision_tower``) and its projection into the text model (``embed_vision``).

Variable resolution: an image is a grid of ``patch x patch`` pixel patches (as many as its soft-token
budget allows, see :class:`mlxchat.images.Gemma4ImageProcessor`), each embedded linearly plus a learned
row and column embedding. The encoder blocks are Gemma's (four norms, q/k norms, a weightless value
norm, unscaled attention, a GELU-tanh GLU), attending bidirectionally over the whole image with 2-D RoPE
(one half of each head turns by the column, the other by the row). ``k x k`` patch blocks are then
average-pooled into one soft token, scaled by ``sqrt(hidden)``, optionally standardised, and projected to
the text width after a weightless RMS norm.

Linears may be "clippable": the checkpoint stores bounds for their inputs and outputs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxchat.plugin import AxialRoPE, RMSNorm, attend_all, gate_function, rms_norm


class Gemma4VisionConfig(BaseModel):
    """``vision_config`` of a Gemma 4 checkpoint."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    pooling_kernel_size: int = Field(3, ge=1)
    patch_size: int = Field(16, ge=1)
    position_embedding_size: int = Field(10240, ge=1)
    use_clipped_linears: bool = False
    standardize: bool = False

    @model_validator(mode="before")
    @classmethod
    def _rope(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("rope_parameters"), dict):
            data = {**data, "rope_theta": data["rope_parameters"].get("rope_theta", 100.0)}
        return data

    @model_validator(mode="after")
    def _check(self) -> Gemma4VisionConfig:
        gate_function(self.hidden_activation)
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 4:
            raise ValueError("vision heads must group evenly over the K/V heads, and head_dim be a multiple of 4")
        return self


class ClippableLinear(nn.Module):
    """A bias-free linear under ``linear``; with clipping, its input and output are clamped to the stored
    bounds."""

    def __init__(self, in_dims: int, out_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        if clipped:
            self.input_min = mx.array(-mx.inf)
            self.input_max = mx.array(mx.inf)
            self.output_min = mx.array(-mx.inf)
            self.output_max = mx.array(mx.inf)
        self.clipped = clipped

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min, self.input_max)
        return mx.clip(self.linear(x), self.output_min, self.output_max)


class VisionAttention(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        h, d, clip = config.hidden_size, config.head_dim, config.use_clipped_linears
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = ClippableLinear(h, self.num_heads * d, clip)
        self.k_proj = ClippableLinear(h, self.num_kv_heads * d, clip)
        self.v_proj = ClippableLinear(h, self.num_kv_heads * d, clip)
        self.o_proj = ClippableLinear(self.num_heads * d, h, clip)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.eps = config.rms_norm_eps

    def __call__(self, x: mx.array, rope: AxialRoPE, positions: mx.array) -> mx.array:
        patches = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(patches, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(patches, self.num_kv_heads, self.head_dim))
        v = rms_norm(self.v_proj(x).reshape(patches, self.num_kv_heads, self.head_dim), self.eps)
        q = rope(q.transpose(1, 0, 2), positions)[None]
        k = rope(k.transpose(1, 0, 2), positions)[None]
        out = attend_all(q, k, v.transpose(1, 0, 2)[None], scale=1.0)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        h, i, clip = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj = ClippableLinear(h, i, clip)
        self.up_proj = ClippableLinear(h, i, clip)
        self.down_proj = ClippableLinear(i, h, clip)
        self._gate = gate_function(config.hidden_activation)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._gate(self.gate_proj(x), self.up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = VisionAttention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = VisionMLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def __call__(self, x: mx.array, rope: AxialRoPE, positions: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, positions))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    """``input_proj`` of the pixels (mapped from ``[0, 1]`` to ``[-1, 1]``) plus the column and row
    embeddings ``position_embedding_table[0][x] + position_embedding_table[1][y]``."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = mx.ones((2, config.position_embedding_size, config.hidden_size))

    def __call__(self, pixels: mx.array, positions: mx.array) -> mx.array:
        h = self.input_proj((2 * (pixels - 0.5)).astype(self.position_embedding_table.dtype))
        return h + self.position_embedding_table[0][positions[:, 0]] + self.position_embedding_table[1][positions[:, 1]]


class Encoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.layers = [VisionBlock(config) for _ in range(config.num_hidden_layers)]


class Gemma4VisionModel(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = Encoder(config)
        if config.standardize:
            self.std_bias = mx.zeros((config.hidden_size,))
            self.std_scale = mx.ones((config.hidden_size,))
        self._rope = AxialRoPE(config.head_dim, config.rope_theta, split_head=True)

    def __call__(self, pixels: mx.array, rows: int, cols: int) -> mx.array:
        """Soft tokens ``[rows * cols / k^2, hidden]`` of one image's raster-order patches ``[rows * cols, values]``."""
        k = self.config.pooling_kernel_size
        ys, xs = mx.meshgrid(mx.arange(rows), mx.arange(cols), indexing="ij")
        positions = mx.stack([xs.reshape(-1), ys.reshape(-1)], axis=-1)  # (x, y) per patch
        h = self.patch_embedder(pixels, positions)
        for layer in self.encoder.layers:
            h = layer(h, self._rope, positions)
        # Average each k x k block of patches (row-major over blocks), then scale; float32 as in transformers.
        pooled = h.astype(mx.float32).reshape(rows // k, k, cols // k, k, -1).mean(axis=(1, 3))
        pooled = pooled.reshape(-1, h.shape[-1]) * (self.config.hidden_size**0.5)
        if self.config.standardize:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled.astype(h.dtype)


class MultimodalEmbedder(nn.Module):
    """``embedding_projection`` of the weightless-RMS-normed soft tokens into the text width."""

    def __init__(self, vision_size: int, text_size: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(vision_size, text_size, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(rms_norm(x, self.eps))
