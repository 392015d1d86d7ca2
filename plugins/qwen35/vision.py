"""Qwen3.5's vision tower (``model.visual``): a ViT over ``temporal x patch x patch`` pixel patches with a
learned position table resampled to each image's grid, 2-D RoPE, and a merger that turns each
``merge x merge`` block of patches into one token of the text model's width. No deepstack (Qwen3-VL's
side outputs are not part of Qwen3.5).

Patches arrive in spatial-merge-block order (the processor's layout), so a block's patches are
consecutive rows and the merger only reshapes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxchat.plugin import AxialRoPE, attend_all

ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}


class Qwen35VisionConfig(BaseModel):
    """``vision_config`` of a Qwen3.5 checkpoint."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    depth: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    in_channels: int = 3
    patch_size: int = Field(16, ge=1)
    spatial_merge_size: int = Field(2, ge=1)
    temporal_patch_size: int = Field(2, ge=1)
    out_hidden_size: int = Field(ge=1)
    num_position_embeddings: int = Field(2304, ge=1)
    rope_theta: float = 10000.0

    @model_validator(mode="before")
    @classmethod
    def _rope(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("rope_parameters"), dict):
            data = {**data, "rope_theta": data["rope_parameters"].get("rope_theta", 10000.0)}
        return data

    @model_validator(mode="after")
    def _check(self) -> Qwen35VisionConfig:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.hidden_size % self.num_heads or self.in_channels != 3:
            raise ValueError("the vision tower needs hidden_size divisible by num_heads and 3 input channels")
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError("num_position_embeddings must be a square (a side x side position grid)")
        return self

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class PatchEmbed(nn.Module):
    """A Conv3d whose stride is its kernel is a linear map of each flattened ``(C, T, P, P)`` patch."""

    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_values, config.hidden_size, bias=True)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.proj(pixels)


class VisionAttention(nn.Module):
    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def __call__(self, x: mx.array, rope: AxialRoPE, positions: mx.array) -> mx.array:
        patches = x.shape[0]
        qkv = self.qkv(x).reshape(patches, 3, self.num_heads, self.head_dim).transpose(1, 2, 0, 3)
        q, k, v = qkv[0][None], qkv[1][None], qkv[2][None]
        # The rotation runs in float32 whatever the weights' dtype, as in transformers.
        q = rope(q.astype(mx.float32), positions).astype(x.dtype)
        k = rope(k.astype(mx.float32), positions).astype(x.dtype)
        out = attend_all(q, k, v, self.head_dim**-0.5)
        return self.proj(out[0].transpose(1, 0, 2).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self._act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self._act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(config)

    def __call__(self, x: mx.array, rope: AxialRoPE, positions: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), rope, positions)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each block of ``merge^2`` patches concatenated and sent through a GELU MLP
    to the text model's width."""

    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size, bias=True)
        self.merged = merged

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


def block_order(rows: int, cols: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch in spatial-merge-block order (blocks row-major, patches row-major
    inside a block)."""
    index = np.arange(rows * cols)
    in_col, in_row = index % merge, (index // merge) % merge
    block_col = (index // merge**2) % (cols // merge)
    block_row = index // (merge**2 * (cols // merge))
    return block_row * merge + in_row, block_col * merge + in_col


def bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two table rows and weights that bilinearly resample a ``side``-long table to ``size`` points
    (corners aligned) at ``index``; float32 as in transformers."""
    source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(source)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


class Qwen35VisionModel(nn.Module):
    def __init__(self, config: Qwen35VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config)
        self._rope = AxialRoPE(config.hidden_size // config.num_heads, config.rope_theta, split_head=False)

    def __call__(self, pixels: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """Features ``[h * w / merge^2, out_hidden_size]`` of one image's patches ``[h * w, values]``
        (``grid = (1, h, w)``: a still image is one temporal patch)."""
        _, rows, cols = grid
        row, col = block_order(rows, cols, self.config.spatial_merge_size)
        side = int(round(self.config.num_position_embeddings**0.5))
        row_taps, row_weights = bilinear_taps(row, rows, side)
        col_taps, col_weights = bilinear_taps(col, cols, side)
        taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weights = mx.array((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4))
        table = self.pos_embed(mx.array(taps))

        h = self.patch_embed(pixels.astype(table.dtype))
        h = h + (table * weights[..., None].astype(table.dtype)).sum(axis=1)
        positions = mx.array(np.stack([row, col], axis=-1))
        for block in self.blocks:
            h = block(h, self._rope, positions)
        return self.merger(h)
