"""Gemma 4 (text): decoder blocks that alternate sliding-window and global attention, with per-layer
embeddings and K/V shared by the last layers (E2B/E4B), or a dense MLP beside routed experts (26B-A4B).

Gemma 4 is not Gemma 3: every norm multiplies by ``w`` (not ``1 + w``), attention is unscaled (the q/k
norms do the scaling) and values get a weightless norm. Sliding layers use ``head_dim`` and plain RoPE;
global layers use ``global_head_dim`` and proportional RoPE, and with ``attention_k_eq_v`` read their
values off the key projection. Logits are soft-capped.

With a vision tower (:mod:`.vision`) image soft tokens replace the ``<|image|>`` embeddings; their
per-layer embeddings look up the pad token, and where the config asks for it
(``use_bidirectional_attention: "vision"``) an image's tokens see each other in both directions in the
sliding layers (so an image is prefilled in one chunk).
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Any, Literal, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from pydantic import model_validator

from mlxchat.plugin import (
    Attended,
    CausalLM,
    CheckpointError,
    Decoder,
    Gemma4ImageProcessor,
    ImageError,
    ImageTokens,
    KVCache,
    LayerCache,
    ModelConfig,
    MultimodalPrompt,
    ProcessedImage,
    Projections,
    ProportionalRoPE,
    RaggedRows,
    RMSNorm,
    RoPE,
    RopeConfig,
    RowCaches,
    RowParallelLinear,
    SlidingWindowCache,
    SwiGLU,
    SwitchGLU,
    VocabParallelEmbedding,
    all_reduce,
    attend_over,
    embed_with_images,
    fetch_attended,
    gelu_tanh_gate,
    head_split,
    rms_norm,
    shard_experts,
    slice_outputs,
    softmax_top_k,
    stack_experts,
    window_mask,
)

from .vision import Gemma4VisionConfig, Gemma4VisionModel, MultimodalEmbedder

LayerType = Literal["sliding_attention", "full_attention"]

# transformers' defaults, used where config.json is silent (released configs spell everything out).
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_PATTERN = 6  # five sliding layers, then a global one
_OVERRIDABLE = ("head_dim", "num_key_value_heads")


class Gemma4Config(ModelConfig):
    """``text_config`` of a Gemma 4 checkpoint, with the per-layer attention geometry resolved.

    transformers 5 writes the global layers' geometry only as ``per_layer_config`` (layer index ->
    overrides); released configs say ``global_head_dim`` / ``num_global_key_value_heads``. Both end up in
    ``layer_head_dims`` / ``layer_kv_heads``.
    """

    tie_word_embeddings: bool = True
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    layer_types: list[LayerType]
    sliding_window: int
    rope_parameters: dict[LayerType, RopeConfig]
    layer_head_dims: list[int]
    layer_kv_heads: list[int]
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 256
    """Width of the per-layer inputs (PLE); 0 for none (26B-A4B and 31B write null)."""
    vocab_size_per_layer_input: int = 262_144
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    use_bidirectional_attention: Literal["vision"] | None = None
    pad_token_id: int = 0
    # the multimodal wrapper (top level of config.json)
    vision_config: Gemma4VisionConfig | None = None
    image_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "hidden_size_per_layer_input" in data and data["hidden_size_per_layer_input"] is None:
            data["hidden_size_per_layer_input"] = 0
        layers = data.get("num_hidden_layers")
        if not isinstance(layers, int):
            return data  # the field check reports it
        if data.get("layer_types") is None:
            data["layer_types"] = ["full_attention" if (i + 1) % DEFAULT_PATTERN == 0 else "sliding_attention"
                                   for i in range(layers)]
        types = list(data["layer_types"])
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        types[-1] = "full_attention"  # transformers forces the last layer global
        data["layer_types"] = types
        data["rope_parameters"] = {**DEFAULT_ROPE, **(data.get("rope_parameters") or {})}
        data["layer_head_dims"], data["layer_kv_heads"] = _layer_geometry(data, types)
        return data

    @model_validator(mode="after")
    def _check(self) -> Gemma4Config:
        experts = (self.num_experts, self.top_k_experts, self.moe_intermediate_size)
        if self.enable_moe_block and not all(experts):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        owners = set(self.layer_types[: self.first_shared_layer])
        for i in range(self.first_shared_layer, self.num_hidden_layers):
            if self.layer_types[i] not in owners:
                raise ValueError(f"layer {i} reuses {self.layer_types[i]} keys and values that no earlier "
                                 "layer makes")
        return self

    @property
    def first_shared_layer(self) -> int:
        """Layers from here on reuse the K/V of the last earlier layer of their type (and have no cache)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_shared_layer

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None and None not in (self.image_token_id, self.boi_token_id,
                                                                self.eoi_token_id)

    def mlp_width(self, layer: int) -> int:
        double = self.use_double_wide_mlp and not self.owns_kv(layer)
        return self.intermediate_size * (2 if double else 1)


def _layer_geometry(data: dict[str, Any], types: list[str]) -> tuple[list[Any], list[Any]]:
    """Head dim and KV heads of every layer, from ``per_layer_config`` or the ``global_*`` keys (the
    field checks catch missing values)."""
    head_dim, kv_heads = data.get("head_dim"), data.get("num_key_value_heads")
    global_head_dim = data.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM
    global_kv_heads = data.get("num_global_key_value_heads") if data.get("attention_k_eq_v") else None
    dims = [global_head_dim if t == "full_attention" else head_dim for t in types]
    heads = [(global_kv_heads or kv_heads) if t == "full_attention" else kv_heads for t in types]
    overrides = data.get("per_layer_config") or {}
    for key in sorted(overrides, key=lambda k: str(k).isdigit()):  # layer-type keys first, indices win
        values = overrides[key] or {}
        unknown = sorted(set(values) - set(_OVERRIDABLE))
        if unknown:
            raise ValueError(f"per_layer_config[{key!r}] overrides {unknown}, which mlxchat does not support")
        if str(key).isdigit() and int(key) < len(types):
            chosen = [int(key)]
        elif key in types:
            chosen = [i for i, t in enumerate(types) if t == key]
        else:
            raise ValueError(f"per_layer_config key {key!r} is neither a layer index nor a layer type")
        for i in chosen:
            dims[i] = values.get("head_dim", dims[i])
            heads[i] = values.get("num_key_value_heads", heads[i])
    return dims, heads


def make_rope(head_dim: int, rope: RopeConfig, max_positions: int) -> nn.Module:
    """Proportional RoPE for the global layers; otherwise the whole head rotates (transformers ignores a
    partial factor there)."""
    if rope.rope_type == "proportional":
        return ProportionalRoPE(head_dim, rope)
    return RoPE(head_dim, rope, max_positions)


class SharedKV(NamedTuple):
    """What a layer that owns K/V left for the KV-shared layers of its type: the ragged rows its keys were split
    by (``None``: one sequence, or a batch of rows), and for each part the rotary offset of its queries and what
    each of its rows attends over."""

    ragged: RaggedRows | None
    parts: list[tuple[int | mx.array, list[Attended]]]


class Gemma4Attention(nn.Module):
    """Unscaled attention with q/k norms and a weightless value norm.

    A layer that owns K/V writes them to its cache and to ``shared`` (by layer type); a KV-shared layer
    has no K/V projections and attends over what the last owner of its type left there.
    """

    def __init__(self, config: Gemma4Config, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.kind = config.layer_types[layer]
        self.window = config.sliding_window if self.kind == "sliding_attention" else None
        self.num_heads, self.head_dim = config.num_attention_heads, config.layer_head_dims[layer]
        self.num_kv_heads, self.eps = config.layer_kv_heads[layer], eps
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.owns_kv = config.owns_kv(layer)
        self.values_from_keys = config.attention_k_eq_v and self.window is None
        if self.owns_kv:
            self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
            if not self.values_from_keys:
                self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
        owned = ("k_proj",) + (() if self.values_from_keys else ("v_proj",)) if self.owns_kv else ()
        self._qkv = Projections("q_proj", *owned)
        rope = config.rope_parameters[self.kind]
        self.rope = make_rope(self.head_dim, rope, config.max_position_embeddings)

    def __call__(self, x: mx.array, offset: int | mx.array, cache: LayerCache | None,
                 shared: dict[str, SharedKV], blocks: mx.array | None = None) -> mx.array:
        """``blocks``: image block id per token (-1 for text) where image tokens attend bidirectionally. With
        the caches of several sequences each attends over its own: ``RowCaches`` (batched decoding, a row
        each) or ``RaggedRows`` (a step's sequences end to end, each at its own offset)."""
        batch, length, _ = x.shape
        q, *kv = self._qkv(self, x)
        q = self.q_norm(q.reshape(batch, length, self.num_heads, self.head_dim)).transpose(0, 2, 1, 3)
        if self.owns_kv:
            k = kv[0].reshape(batch, length, self.num_kv_heads, self.head_dim)
            v = k if self.values_from_keys else kv[1].reshape(batch, length, self.num_kv_heads, -1)
            k, v = self.k_norm(k).transpose(0, 2, 1, 3), rms_norm(v, self.eps).transpose(0, 2, 1, 3)
            ragged = cache if isinstance(cache, RaggedRows) else None
            parts: list[tuple[LayerCache | None, int | mx.array, list[mx.array]]] = [(cache, offset, [k, v])]
            if ragged:  # each sequence (or the batch of decode rows) from its own offset, read before its update
                parts = [(part, part.offset, arrays) for part, arrays in ragged.split(k, v, axis=2)]
            shared[self.kind] = SharedKV(ragged, [self._own(part, at, k_i, v_i) for part, at, (k_i, v_i) in parts])
        owned = shared[self.kind]  # a KV-shared layer reads what its owner left
        queries = owned.ragged.split(q, axis=2) if owned.ragged else [(cache, [q])]
        outs = [self._attend(self.rope(q_i, at), rows, blocks)
                for (_, (q_i,)), (at, rows) in zip(queries, owned.parts, strict=True)]
        out = owned.ragged.join(outs, axis=2) if owned.ragged else outs[0]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _own(self, cache: LayerCache | None, at: int | mx.array, k: mx.array,
             v: mx.array) -> tuple[int | mx.array, list[Attended]]:
        """This layer's keys (rotated from ``at``) and values added to ``cache`` (a sequence's, or a batch of
        rows'), and what each row's queries attend over."""
        k = self.rope(k, at)
        rows: list[LayerCache | None] = list(cache.caches) if isinstance(cache, RowCaches) else [cache]
        pairs = [(k, v)] if len(rows) == 1 else [(k[i : i + 1], v[i : i + 1]) for i in range(len(rows))]
        return at, [fetch_attended(row, *pair) for row, pair in zip(rows, pairs, strict=True)]  # type: ignore[arg-type]

    def _attend(self, q: mx.array, rows: list[Attended], blocks: mx.array | None) -> mx.array:
        outs = []
        for i, held in enumerate(rows):
            mask = None
            if self.window is not None and blocks is not None:  # sliding caches hold floats
                mask = window_mask(q.shape[2], held[0].shape[2], self.window, blocks)  # type: ignore[index]
            outs.append(attend_over(q if len(rows) == 1 else q[i : i + 1], held, 1.0, mask, self.window))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel by heads; a KV-shared layer splits like the owner of its K/V (same head counts), so
        each rank's shared K/V are the heads its queries read."""
        split = head_split(self.num_heads, self.num_kv_heads, group.size())
        (q0, q1), (k0, k1) = split[group.rank()]
        d = self.head_dim
        slice_outputs(self.q_proj, [(q0 * d, q1 * d)])
        if self.owns_kv:
            slice_outputs(self.k_proj, [(k0 * d, k1 * d)])
            if not self.values_from_keys:
                slice_outputs(self.v_proj, [(k0 * d, k1 * d)])
        self.o_proj = RowParallelLinear(self.o_proj, [(a * d, b * d) for (a, b), _ in split], group)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0


class Gemma4Router(nn.Module):
    """Softmax over all experts of the weightless-normed, ``scale``-weighted input; top-k renormalised, then
    scaled per expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = mx.ones((hidden_size,))
        self.per_expert_scale = mx.ones((num_experts,))
        self.top_k, self.eps, self.root = top_k, eps, hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = rms_norm(x, self.eps, self.scale * self.root)
        weights, indices = softmax_top_k(self.proj(x), self.top_k, normalize=True)
        return weights * self.per_expert_scale[indices], indices


class Gemma4Block(nn.Module):
    """Attention and feed-forward, each sandwiched between two norms; then the layer's per-layer-embedding
    residual, and the whole hidden state times ``layer_scalar``."""

    group: mx.distributed.Group | None = None

    def __init__(self, config: Gemma4Config, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Gemma4Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.mlp_width(layer), activation="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.moe = config.enable_moe_block
        if self.moe:
            assert config.num_experts and config.top_k_experts and config.moe_intermediate_size
            self.router = Gemma4Router(h, config.num_experts, config.top_k_experts, eps)
            self.switch_mlp = SwitchGLU(h, config.moe_intermediate_size, config.num_experts, activation="gelu_tanh")
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.per_layer = bool(config.hidden_size_per_layer_input)
        if self.per_layer:
            p = config.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(h, p, bias=False)
            self.per_layer_projection = nn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, per_layer_input: mx.array | None, offset: int | mx.array, cache: LayerCache | None,
                 shared: dict[str, SharedKV], blocks: mx.array | None = None) -> mx.array:
        attended = self.self_attn(self.input_layernorm(x), offset, cache, shared, blocks)
        h = x + self.post_attention_layernorm(attended)
        f = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            weights, indices = self.router(h)
            experts = self.switch_mlp(self.pre_feedforward_layernorm_2(h), indices)
            experts = all_reduce((experts * weights[..., None]).sum(-2), self.group)
            f = self.post_feedforward_layernorm_1(f) + self.post_feedforward_layernorm_2(experts)
        h = h + self.post_feedforward_layernorm(f)
        if per_layer_input is not None:
            gated = gelu_tanh_gate(self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel: attention by heads, the MLP by hidden units, the experts (router whole) with their
        own all-reduce before their norm; the per-layer-input projections are small and stay whole."""
        self.self_attn.shard(group)
        self.mlp.shard(group)
        if self.moe:
            shard_experts(self.switch_mlp, group)
            self.group = group


class Gemma4TextModel(Decoder):
    """Scaled token embedding, per-layer embeddings (PLE) for every block, the blocks and the final norm.

    PLE gives each layer a small input of its own: a per-token row of ``embed_tokens_per_layer`` plus a
    projection of the token embedding, normalised, mixed and fed into the layer's residual.
    """

    def __init__(self, config: Gemma4Config):
        h = config.hidden_size
        blocks = [Gemma4Block(config, i) for i in range(config.num_hidden_layers)]
        super().__init__(config.vocab_size, h, blocks, RMSNorm(h, config.rms_norm_eps))
        self.image_token_id, self.pad_token_id = config.image_token_id, config.pad_token_id
        self.bidirectional_images = config.use_bidirectional_attention == "vision"
        self.embed_scale = math.sqrt(h)
        self.ple_dim = config.hidden_size_per_layer_input
        if self.ple_dim:
            n, p = config.num_hidden_layers, self.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, n * p)
            self.per_layer_model_projection = nn.Linear(h, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)
        # Layer i's cache index (None: it reuses another layer's K/V).
        owners = [i for i in range(config.num_hidden_layers) if config.owns_kv(i)]
        self.cache_slots = [owners.index(i) if i in owners else None for i in range(config.num_hidden_layers)]

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        return h * mx.array(self.embed_scale, h.dtype)  # the scale rounds to the weights' dtype, as in HF

    def per_layer_inputs(self, tokens: mx.array, embeddings: mx.array) -> mx.array:
        """``[batch, length, layers, ple_dim]``: token rows plus the normalised embedding projection."""
        shape = (*tokens.shape, len(self.layers), self.ple_dim)
        # The table stays in the checkpoint's dtype (see cast_predicate); its rows join the compute dtype.
        rows = self.embed_tokens_per_layer(tokens).astype(embeddings.dtype)
        rows = (rows * mx.array(math.sqrt(self.ple_dim), rows.dtype)).reshape(shape)
        context = self.per_layer_model_projection(embeddings) * (embeddings.shape[-1] ** -0.5)
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + rows) * (2**-0.5)

    def __call__(self, tokens: mx.array, cache: list[LayerCache] | None = None,  # type: ignore[override]
                 embeddings: mx.array | None = None) -> mx.array:
        """``embeddings``: the chunk's input embeddings with image soft tokens in place (see
        :meth:`Gemma4ForCausalLM.image_inputs`); the image placeholders' per-layer inputs then use the
        pad token, and the image blocks their bidirectional mask."""
        blocks = None
        if embeddings is None:
            h, ple_tokens = self.embed(tokens), tokens
        else:
            h = embeddings
            images = tokens == self.image_token_id
            ple_tokens = mx.where(images, self.pad_token_id, tokens)
            if self.bidirectional_images:
                blocks = image_blocks(images[0])
        per_layer = self.per_layer_inputs(ple_tokens, h) if self.ple_dim else None
        offset = cache[0].offset if cache else 0  # over ragged rows each sequence reads its own (Gemma4Attention)
        shared: dict[str, SharedKV] = {}
        for i, (layer, slot) in enumerate(zip(self.layers, self.cache_slots, strict=True)):
            layer_cache = cache[slot] if cache is not None and slot is not None else None
            layer_input = per_layer[..., i, :] if per_layer is not None else None
            h = layer(h, layer_input, offset, layer_cache, shared, blocks)
        return self.norm(h)


def image_blocks(images: mx.array) -> mx.array:
    """Block id of each token: runs of image tokens numbered from 0, -1 elsewhere."""
    starts = images & ~mx.concatenate([mx.array([False]), images[:-1]])
    return mx.where(images, mx.cumsum(starts.astype(mx.int32)) - 1, -1)


class Gemma4ForCausalLM(CausalLM):
    """The text model under ``model`` and the tied head, soft-capped; with ``vision_tower`` and
    ``embed_vision`` when the checkpoint has them."""

    model: Gemma4TextModel
    vision_parts = ("vision_tower", "embed_vision")
    runs_ragged = True

    def __init__(self, config: Gemma4Config):
        super().__init__(config, Gemma4TextModel(config))
        self.embeds_on_every_rank = bool(config.hidden_size_per_layer_input)  # per-layer inputs read them
        self.softcap = config.final_logit_softcapping
        self.atomic_images = config.use_bidirectional_attention == "vision"
        if config.has_vision:
            vision = config.vision_config
            assert vision is not None
            self.vision_tower = Gemma4VisionModel(vision)
            self.embed_vision = MultimodalEmbedder(vision.hidden_size, config.hidden_size, vision.rms_norm_eps)
            assert config.image_token_id is not None and config.boi_token_id is not None
            assert config.eoi_token_id is not None
            self.image_tokens = ImageTokens(config.image_token_id, (config.boi_token_id,), (config.eoi_token_id,))

    def cast_predicate(self, name: str) -> bool:
        """The per-layer embedding table (262144 x 8960 in E2B: 9.4 GB as float32) is only ever looked up,
        a few rows a token: keep it in the checkpoint's dtype."""
        return "embed_tokens_per_layer" not in name

    def project(self, h: mx.array) -> mx.array:
        logits = super().project(h)
        if self.softcap:
            logits = softcap(logits, mx.array(self.softcap, logits.dtype))
        return logits

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel (see :meth:`CausalLM.shard`); the per-layer embedding table splits by vocabulary too."""
        super().shard(group)
        if self.model.ple_dim:
            self.model.embed_tokens_per_layer = VocabParallelEmbedding(self.model.embed_tokens_per_layer, group)

    def pipeline_units(self) -> list[range]:
        """KV-shared layers stay on the rank of the layers whose K/V they read (and of those in between)."""
        config: Gemma4Config = self.config  # type: ignore[assignment]
        first, count = config.first_shared_layer, config.num_hidden_layers
        if first >= count:
            return super().pipeline_units()
        owners = [max(i for i in range(first) if config.layer_types[i] == kind)
                  for kind in set(config.layer_types[first:])]
        start = min(owners)
        return [range(i, i + 1) for i in range(start)] + [range(start, count)]

    def make_cache(self) -> list[LayerCache]:
        """One cache per layer that owns K/V: sliding layers keep their window, global layers everything."""
        config: Gemma4Config = self.config  # type: ignore[assignment]
        return [SlidingWindowCache(config.sliding_window) if t == "sliding_attention" else KVCache()
                for i, t in enumerate(config.layer_types) if config.owns_kv(i)]

    # -- images (see mlxchat.architecture.VisionModule) ---------------------------------------------

    @property
    def supports_images(self) -> bool:
        return "vision_tower" in self

    def image_processor(self, settings: dict[str, Any]) -> Gemma4ImageProcessor:
        vision: Gemma4VisionConfig = self.vision_tower.config
        processor = Gemma4ImageProcessor.from_config(settings, patch_size=vision.patch_size,
                                                     pooling_kernel_size=vision.pooling_kernel_size)
        if (processor.patch_size, processor.pooling_kernel_size) != (vision.patch_size, vision.pooling_kernel_size):
            raise CheckpointError(f"preprocessor_config.json: patch size and pooling kernel "
                                  f"{processor.patch_size, processor.pooling_kernel_size} do not fit the vision "
                                  f"tower's {vision.patch_size, vision.pooling_kernel_size}")
        return processor

    def encode_image(self, image: ProcessedImage) -> mx.array:
        vision: Gemma4VisionConfig = self.vision_tower.config
        _, rows, cols = image.grid
        k, p = vision.pooling_kernel_size, vision.patch_size
        too_big = max(rows, cols) > vision.position_embedding_size
        if image.pixels.shape[1] != 3 * p * p or rows % k or cols % k or too_big:
            raise ImageError(f"{image} was not preprocessed for this vision tower")
        return self.embed_vision(self.vision_tower(mx.array(image.pixels), rows, cols))

    def image_inputs(self, prompt: MultimodalPrompt, start: int, end: int,
                     features: dict[str, mx.array]) -> dict[str, mx.array]:
        config: Gemma4Config = self.config  # type: ignore[assignment]
        return {"embeddings": embed_with_images(self.model.embed, prompt, start, end, features, config.pad_token_id)}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        config: Gemma4Config = self.config  # type: ignore[assignment]
        text = {}
        for key, value in text_weights(weights).items():
            match = _SHARED_KV.match(key)
            if match and not config.owns_kv(int(match.group(1))):
                continue  # KV-shared layers: some checkpoints keep projections they never use
            text[key.replace(".experts.switch_glu.", ".switch_mlp.")] = value
        if self.supports_images:
            tower = vision_weights(weights, config.vision_config)  # type: ignore[arg-type]
            if tower:
                text.update(tower)
            else:  # a text-only copy of the checkpoint: serve it as a text model
                del self.vision_tower
                del self.embed_vision
        return stack_experts(super().sanitize(text))


@partial(mx.compile, shapeless=True)
def softcap(logits: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(logits / cap) * cap


_SHARED_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm|v_norm)\.")
# Multimodal parts of a released checkpoint; the text model skips them (a vision plugin would take them).
TOWERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.",
          "vision_embedder.")
# Where the text model sits: HF wrapper, mlx-lm conversions of the wrapper, text-only checkpoints.
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.", ""), ("model.", "model."), ("lm_head.", "lm_head."))


_CLIP_BOUNDS = (".input_min", ".input_max", ".output_min", ".output_max")


def vision_weights(weights: dict[str, mx.array], vision: Gemma4VisionConfig) -> dict[str, mx.array]:
    """The vision tower's and ``embed_vision``'s tensors under this module's names (released and mlx-vlm
    layouts); clipping bounds only where the tower clips."""
    out = {}
    for key, value in weights.items():
        bare = key.removeprefix("model.")
        if not bare.startswith(("vision_tower.", "embed_vision.")):
            continue
        if bare.endswith(_CLIP_BOUNDS) and not vision.use_clipped_linears:
            continue
        out[bare] = value
    return out


def text_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The text model's tensors under this module's names; multimodal towers left out."""
    out = {}
    for key, value in weights.items():
        bare = key.removeprefix("model.")
        if bare.startswith(TOWERS):
            continue
        for prefix, replacement in TEXT_PREFIXES:
            if key.startswith(prefix):
                out[replacement + key[len(prefix):]] = value
                break
        else:
            raise CheckpointError(f"tensor {key!r} is not part of a Gemma 4 checkpoint's text model")
    return out
