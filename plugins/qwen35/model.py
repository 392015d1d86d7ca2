"""Qwen3.5 and Qwen3.5-MoE: a hybrid decoder. Most layers mix tokens with a Gated DeltaNet (linear
attention, a fixed-size state); every few layers one uses softmax attention whose output is gated by a
sigmoid of a second query projection. The feed-forward is a SwiGLU MLP, or in the MoE variant a softmax
top-k mixture of experts plus a sigmoid-gated shared expert in every layer.

Checkpoints are released as a vision-language model: the text model sits under ``text_config`` and
``model.language_model.*``, the vision tower (:mod:`.vision`) under ``model.visual.*``. Image features
replace the ``<|image_pad|>`` embeddings, and the attention layers then rotate by 3-D positions
(multimodal RoPE, see :mod:`mlxchat.multimodal`); text-only prompts run exactly as a text model. A
checkpoint without the tower (mlx-lm's conversions) loads as a text model.

Released checkpoints carry a multi-token-prediction head (``mtp.*``, :class:`MultiTokenPredictor`);
speculative decoding uses it as its draft (:mod:`mlxchat.speculative`). Checkpoints without it (mlx-lm
drops it when converting) load without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from pydantic import model_validator

from mlxchat.plugin import (
    CausalLM,
    CheckpointError,
    Decoder,
    GatedDeltaNet,
    ImageError,
    ImageTokens,
    KVCache,
    LayerCache,
    ModelConfig,
    MRoPE,
    MultimodalPrompt,
    ProcessedImage,
    Projections,
    Qwen2VLImageProcessor,
    RaggedRows,
    RMSNorm,
    RoPE,
    RopeConfig,
    RowCaches,
    RowParallelLinear,
    SparseMoE,
    StateCache,
    SwiGLU,
    attend,
    each_sequence,
    embed_with_images,
    fused_heads,
    head_split,
    slice_outputs,
    stack_experts,
)

from .vision import Qwen35VisionConfig, Qwen35VisionModel

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
    # the vision-language wrapper (top level of config.json)
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    vision_config: Qwen35VisionConfig | None = None
    image_token_id: int | None = None
    # the multi-token-prediction head (released checkpoints: one layer, the decoder's embedding)
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

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
            if rope.get("mrope_section") is not None:
                data.setdefault("mrope_section", rope["mrope_section"])
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

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None and self.image_token_id is not None

    @property
    def has_mtp(self) -> bool:
        """A head mlxchat runs: one layer that shares the decoder's embedding (what Qwen releases)."""
        return self.mtp_num_hidden_layers == 1 and not self.mtp_use_dedicated_embeddings


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
        self._qkv = Projections("q_proj", "k_proj", "v_proj")
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KVCache | RowCaches | RaggedRows | None,
                 positions: int | mx.array | None = None) -> mx.array:
        """``positions``: every token's 3-D position ``[3, L]`` (an image chunk) or the first token's rotary
        position; ``None``: the cache's position (each sequence's own over ragged rows; 0 without a cache)."""
        batch, length, _ = x.shape
        parts = self._qkv.parts(self, x)
        d = self.head_dim
        gate = parts[0][..., : 2 * self.num_heads * d].reshape(batch, length, self.num_heads, 2 * d)[..., d:]
        out = each_sequence(partial(self._attend, positions=positions), cache, *parts, axis=1)
        return self.o_proj((out * mx.sigmoid(gate)).reshape(batch, length, -1))

    def _attend(self, *arrays: Any, positions: int | mx.array | None) -> mx.array:
        """One sequence's (or a batch of decode rows') attention ``[B, L, heads, D]`` from the q/k/v product's parts
        and its cache (last): the heads in one node where it applies (:func:`mlxchat.kernels.heads`, each query
        head beside its gate), else the ops."""
        *parts, cache = arrays
        batch, length, _ = parts[0].shape
        at = positions if positions is not None else (cache.position if cache is not None else 0)
        made = fused_heads(parts, self.num_heads, self.num_kv_heads, self.rope, at, (self.q_norm, self.k_norm),
                           span=2) if positions is None else None
        if made is None:
            queries, k, v = self._qkv.split(parts)
            q = queries.reshape(batch, length, self.num_heads, 2 * self.head_dim)[..., : self.head_dim]
            k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
            v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
            q, k, v = self.q_norm(q).swapaxes(1, 2), self.k_norm(k).swapaxes(1, 2), v.swapaxes(1, 2)
            made = self.rope(q, at), self.rope(k, at), v
        return attend(*made, cache, self.head_dim**-0.5).swapaxes(1, 2)



    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel by heads (``q_proj``'s rows hold each head's query and gate side by side)."""
        split = head_split(self.num_heads, self.num_kv_heads, group.size())
        (q0, q1), (k0, k1) = split[group.rank()]
        d = self.head_dim
        slice_outputs(self.q_proj, [(2 * q0 * d, 2 * q1 * d)])
        slice_outputs(self.k_proj, [(k0 * d, k1 * d)])
        slice_outputs(self.v_proj, [(k0 * d, k1 * d)])
        self.o_proj = RowParallelLinear(self.o_proj, [(a * d, b * d) for (a, b), _ in split], group)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0


class Qwen35Block(nn.Module):
    def __init__(self, config: Qwen35Config, kind: LayerType, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = kind == "linear_attention"
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

    def __call__(self, x: mx.array, cache: LayerCache | None, positions: int | mx.array | None = None) -> mx.array:
        normed = self.input_layernorm(x)
        if self.is_linear:
            h = x + self.linear_attn(normed, cache)
        else:
            h = x + self.self_attn(normed, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen35Model(Decoder):
    """The decoder; its attention layers rotate text by their KV cache's position and image chunks by the
    explicit 3-D ``positions`` given with their ``embeddings``."""

    def __call__(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None,  # type: ignore[override]
                 embeddings: mx.array | None = None, positions: mx.array | None = None) -> mx.array:
        h = self.embed(tokens) if embeddings is None else embeddings
        caches = list(cache) if cache is not None else [None] * len(self.layers)
        attention = [c for layer, c in zip(self.layers, caches, strict=True) if not layer.is_linear and c is not None]
        for layer, layer_cache in zip(self.layers, caches, strict=True):
            h = layer(h, layer_cache, positions)
        if positions is not None and attention:
            # Text after this chunk continues one past its last token's largest coordinate.
            shift = int(np.array(positions[:, -1]).max()) + 1 - attention[0].offset
            for kv in attention:
                kv.shift_positions(shift)
        return self.norm(h)


class MultiTokenPredictor(nn.Module):
    """The multi-token-prediction head (``mtp.*``, as Qwen3-Next's): the decoder's output at position ``i``
    (after its final norm) and the embedding of token ``i + 1``, each RMS-normed, concatenated
    ``[embedding | hidden]`` and projected back to the hidden size by ``fc``, go through one more decoder
    layer (full attention, with its own KV cache) and a final norm; the shared ``lm_head`` then predicts
    token ``i + 2``. Fed its own output, it goes on to predict further tokens (vLLM's MTP proposer)."""

    def __init__(self, config: Qwen35Config, rope: RoPE):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [Qwen35Block(config, "full_attention", rope)]
        self.norm = RMSNorm(h, eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: Sequence[KVCache]) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)],
                                   axis=-1))
        x = self.layers[0](x, cache[0], cache[0].position)
        return self.norm(x)


def mrope_positions(prompt: MultimodalPrompt, start: int, end: int, merge: int) -> np.ndarray:
    """3-D rotary positions ``[3, end - start]`` of a prompt slice, as transformers' ``get_rope_index``:
    text at its index plus the shift so far; an image at ``(s, s + row, s + column)`` of its merged grid,
    ``s`` being where the text would have continued; text after it at ``s + max(rows, columns)``."""
    out = np.empty((3, end - start), np.int32)

    def fill(first: int, values: np.ndarray) -> None:
        a, b = max(first, start), min(first + values.shape[1], end)
        if a < b:
            out[:, a - start : b - start] = values[:, a - first : b - first]

    shift, cursor = 0, 0
    for span in prompt.images:
        if cursor >= end:
            break
        fill(cursor, np.repeat(np.arange(cursor, span.start)[None] + shift, 3, axis=0))
        _, grid_h, grid_w = span.image.grid
        rows, cols = grid_h // merge, grid_w // merge
        first = span.start + shift
        row, col = np.divmod(np.arange(rows * cols), cols)
        fill(span.start, np.stack([np.full(rows * cols, first), first + row, first + col]))
        shift = first + max(rows, cols) - span.end
        cursor = span.end
    if cursor < end:
        fill(cursor, np.repeat(np.arange(cursor, end)[None] + shift, 3, axis=0))
    return out


# Norms that HF-layout checkpoints store zero-centred (the forward multiplies by 1 + w). The gated norm
# of the DeltaNet (`linear_attn.norm`) is not one of them.
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.pre_fc_norm_embedding.weight")
# Where the MTP head sits: released layout (top level), some conversions (under model.).
_MTP = ("mtp.", "model.mtp.")
# Where the vision tower sits: released (HF) layout, mlx-vlm's conversions.
_VISUAL = ("model.visual.", "visual.", "vision_tower.")
# Qwen3-VL / Qwen3.5 preprocessor_config.json values, for checkpoints that ship none.
PROCESSOR_DEFAULTS = {"image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "min_pixels": 65536,
                      "max_pixels": 16777216}


class Qwen35ForCausalLM(CausalLM):
    """The text decoder and ``lm_head``; with a vision tower (``visual``) when the checkpoint has one."""

    model: Qwen35Model
    runs_ragged = True
    atomic_images = False  # the text model is causal over image tokens: a chunk may end inside an image
    vision_parts = ("visual",)

    def __init__(self, config: Qwen35Config):
        if config.has_vision:
            rope: RoPE = MRoPE(config.rotary_dims, config.rope, config.mrope_section, config.max_position_embeddings)
        else:
            rope = RoPE(config.rotary_dims, config.rope, config.max_position_embeddings)
        blocks = [Qwen35Block(config, kind, rope) for kind in config.layer_types]
        super().__init__(config, Qwen35Model(config.vocab_size, config.hidden_size, blocks,
                                             RMSNorm(config.hidden_size, config.rms_norm_eps)))
        if config.has_vision:
            assert config.vision_config is not None and config.image_token_id is not None
            self.visual = Qwen35VisionModel(config.vision_config)
            self.image_tokens = ImageTokens(config.image_token_id)
        if config.has_mtp:
            self.mtp = MultiTokenPredictor(config, rope)

    def make_cache(self) -> list[LayerCache]:
        return [StateCache(2) if block.is_linear else KVCache() for block in self.model.layers]

    # -- the multi-token-prediction head (see mlxchat.speculative.MtpDrafter) ------------------------

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    def make_mtp_cache(self) -> list[KVCache]:
        return [KVCache()]

    def mtp_step(self, hidden: mx.array, tokens: mx.array, cache: Sequence[KVCache]) -> mx.array:
        """The head's output ``[1, L, H]`` for target (or its own) states ``hidden [1, L, H]`` and the tokens
        after them ``[1, L]``, one row per position, appended to its cache."""
        return self.mtp(hidden, self.model.embed(tokens), cache)

    # -- images (see mlxchat.architecture.VisionModule) ---------------------------------------------

    @property
    def supports_images(self) -> bool:
        return "visual" in self

    def image_processor(self, settings: dict[str, Any]) -> Qwen2VLImageProcessor:
        vision: Qwen35VisionConfig = self.visual.config
        processor = Qwen2VLImageProcessor.from_config(
            settings, **PROCESSOR_DEFAULTS, patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size, merge_size=vision.spatial_merge_size)
        tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        if (processor.patch_size, processor.temporal_patch_size, processor.merge_size) != tower:
            raise CheckpointError(f"preprocessor_config.json: patch, temporal patch and merge sizes "
                                  f"{processor.patch_size, processor.temporal_patch_size, processor.merge_size} "
                                  f"do not fit the vision tower's {tower}")
        return processor

    def encode_image(self, image: ProcessedImage) -> mx.array:
        vision: Qwen35VisionConfig = self.visual.config
        merge = vision.spatial_merge_size
        _, rows, cols = image.grid
        if image.pixels.shape[1] != vision.patch_values or rows % merge or cols % merge or image.grid[0] != 1:
            raise ImageError(f"{image} was not preprocessed for this vision tower")
        return self.visual(mx.array(image.pixels), image.grid)

    def image_inputs(self, prompt: MultimodalPrompt, start: int, end: int,
                     features: dict[str, mx.array]) -> dict[str, mx.array]:
        marker = self.image_tokens.marker
        merge = self.visual.config.spatial_merge_size
        return {"embeddings": embed_with_images(self.model.embed, prompt, start, end, features, marker),
                "positions": mx.array(mrope_positions(prompt, start, end, merge))}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Released (HF) and mlx-lm-converted checkpoints to this module's names and conventions.

        HF layout is told apart by its PyTorch conv weights ``[C, 1, K]``; only then are the conv weights
        moved to MLX's ``[C, K, 1]`` and the zero-centred norms given their ``1 +`` (mlx-lm folds both in
        when it converts, so its checkpoints already have them).
        """
        renamed, tower = {}, {}
        for key, value in weights.items():
            prefix = next((p for p in _VISUAL if key.startswith(p)), None)
            if prefix is not None:
                tower["visual." + key[len(prefix):]] = value
                continue
            mtp = next((p for p in _MTP if key.startswith(p)), None)
            if mtp is not None:
                key = "mtp." + key[len(mtp):]
            elif key.startswith("model.language_model."):
                key = "model." + key[len("model.language_model."):]
            elif key.startswith("language_model."):  # mlx-lm: language_model.{model,lm_head}.*
                key = key[len("language_model."):]
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
        if "visual" in self:
            if tower:
                renamed.update(self._sanitize_tower(tower))
            else:
                del self.visual  # a text-only copy of the checkpoint: serve it as a text model
        if "mtp" not in self or not any(k.startswith("mtp.") for k in renamed):
            renamed = {k: v for k, v in renamed.items() if not k.startswith("mtp.")}
            if "mtp" in self:
                del self.mtp  # a checkpoint without the head (mlx-lm's conversions)
        return stack_experts(super().sanitize(renamed))

    def _sanitize_tower(self, tower: dict[str, mx.array]) -> dict[str, mx.array]:
        """The patch embedding's Conv3d weight as our linear map: PyTorch ``[out, C, T, P, P]`` or mlx-vlm's
        channels-last ``[out, T, P, P, C]``, flattened in the ``(C, T, P, P)`` order of the pixel values."""
        key = "visual.patch_embed.proj.weight"
        weight = tower.get(key)
        if weight is not None and weight.ndim == 5:
            channels = self.visual.config.in_channels
            if weight.shape[-1] == channels and weight.shape[1] != channels:
                weight = weight.transpose(0, 4, 1, 2, 3)
            tower[key] = weight.reshape(weight.shape[0], -1)
        return tower
