"""Softmax attention over a KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..cache import (
    KeysValues,
    KVCache,
    LayerCache,
    PrefixedKeysValues,
    QuantizedKeysValues,
    QuantizedKVCache,
    RaggedRows,
    RowCaches,
    SharedPrefix,
    each_sequence,
    padded,
)
from .fused import Projections
from .norms import RMSNorm
from .parallel import RowParallelLinear, head_split, slice_outputs
from .rope import MRoPE, RoPE

Attended = tuple[mx.array, mx.array] | PrefixedKeysValues | QuantizedKeysValues
"""What a chunk's queries attend over: float keys and values, those of a shared prefix and a cache's own
(:meth:`~mlxchat.cache.KVCache.update_and_fetch_parts`), or a quantized cache's packed ones and float tail
(:meth:`~mlxchat.cache.QuantizedKVCache.update_and_fetch_quantized`)."""


def fetch_attended(cache: KeysValues | None, keys: mx.array, values: mx.array) -> Attended:
    """Add this chunk's keys and values to the cache (when there is one); give what its queries attend over,
    a quantized cache's packed part as it is stored, a shared prefix where it lies."""
    if cache is None:
        return keys, values
    if isinstance(cache, QuantizedKVCache):
        return cache.update_and_fetch_quantized(keys, values)
    if isinstance(cache, KVCache):
        return cache.update_and_fetch_parts(keys, values)
    return cache.update_and_fetch(keys, values)


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: KeysValues | RowCaches | None,
    scale: float,
    mask: mx.array | str | None = None,
    window: int | None = None,
) -> mx.array:
    """Causal attention of ``[B, heads, L, D]`` queries over the cache plus this chunk's keys and values;
    with a ``window``, each query sees only itself and the ``window - 1`` positions before it.

    Keys and values keep their own (fewer) heads: grouped-query attention is done by the kernel. With the
    caches of several sequences (:class:`~mlxchat.cache.RowCaches`) each row attends over its own, but decode
    rows whose caches read one shared prefix read it once for all (:func:`attend_shared`); decode rows, and a lone
    sequence's decode step over a float KV cache, write and attend in one node (:func:`attend_rows`).
    """
    if isinstance(cache, RowCaches):
        rows: list[KeysValues] = cache.caches  # type: ignore[assignment]
        decoding = window is None and (mask is None or isinstance(mask, str)) and queries.shape[2] == 1
        groups = shared_prefixes(rows) if decoding else []
        together = attend_rows(queries, keys, values, rows, scale, groups) if decoding else None
        if together is not None:
            return together
        held = [fetch_attended(row, keys[i : i + 1], values[i : i + 1]) for i, row in enumerate(rows)]
        out: list[mx.array | None] = [None] * len(rows)
        for members, length in groups:
            for i, row_out in zip(members, attend_shared(queries, held, members, length, scale) or (), strict=False):
                out[i] = row_out
        return mx.concatenate([row_out if row_out is not None else
                               attend_over(queries[i : i + 1], held[i], scale, mask, window)
                               for i, row_out in enumerate(out)], axis=0)
    if type(cache) is KVCache and window is None and not isinstance(mask, mx.array) and queries.shape[:3:2] == (1, 1):
        alone = attend_rows(queries, keys, values, [cache], scale, [])  # one node, as a batch's rows
        if alone is not None:
            return alone
    return attend_over(queries, fetch_attended(cache, keys, values), scale, mask, window)


def attend_rows(queries: mx.array, keys: mx.array, values: mx.array, rows: Sequence[KeysValues], scale: float,
                groups: list[tuple[list[int], int]]) -> mx.array | None:
    """Decode rows' attention ``[B, heads, 1, Dv]`` in one native node that also writes each row's key and value
    into its cache (:func:`mlxchat.kernels.decode_rows`): rows of float KV caches of one dtype, each reading its
    shared prefix where it lies; the members of each of ``groups`` (:func:`shared_prefixes`) read the first keys
    of theirs together instead (:func:`shared_part`). ``None`` where it does not apply (the rows then attend one
    by one)."""
    if not rows or any(type(row) is not KVCache for row in rows):
        return None
    caches: list[KVCache] = rows  # type: ignore[assignment]
    if len({row.dtype for row in caches}) != 1:
        return None
    keys, values = caches[0].stored(keys), caches[0].stored(values)
    parts = []
    for members, length in groups:  # what the groups read together (read first: nothing is written if it cannot be)
        shared = caches[members[0]].shared
        part = None if shared is None else shared_part(queries, members, shared, length, scale)
        if part is None:
            return None
        parts.append(part)
    like: list[tuple[Sequence[int], mx.Dtype]] = [((1, *keys.shape[1:]), keys.dtype),
                                                  ((1, *values.shape[1:]), values.dtype)]
    starts = [row.make_room(1, like) for row in caches]  # (kept by the one-by-one path where it does not apply)
    together = {i: length for members, length in groups for i in members}
    prefixes: list[mx.array] = []
    spans: list[int] = []
    for i, row in enumerate(caches):
        first = together.get(i, 0)
        if row.shared is not None and first < row.base:
            prefixes += [row.shared.keys, row.shared.values]
            spans += [first, row.base]
        else:
            spans += [0, 0]
    held = [buffer for row in caches for buffer in (row.keys, row.values) if buffer is not None]
    if any(a.dtype != keys.dtype for a in (*held, *prefixes)):  # (a cache loaded from another format's state)
        return None
    made = kernels.decode_rows(queries, keys, values, held, starts, scale, prefixes, spans, lse=bool(groups))
    if made is None:
        return None
    out, *buffers = made
    for i, row in enumerate(caches):
        row.written(buffers[2 * i], buffers[2 * i + 1], 1)
    if not groups:
        return out
    merged = out[..., :-1]
    for (members, _), part in zip(groups, parts, strict=True):
        index = mx.array(members)
        own = out[index]
        merged[index] = merge_parts(own[..., :-1], own[..., -1:], *part)
    return merged


SHARED_PREFIX_MIN = 256
"""Keys decode rows must share (:func:`shared_prefixes`) before they read them once for all: the extra kernel calls
and merge cost what reading 256 keys per row saves (8 rows of Qwen3-0.6B on a 2-core EPYC: 1.01x at 256 shared
keys, 1.14x at 512, 1.81x at 4,096; ``python -m benchmarks.shared_prefix``)."""


def shared_prefixes(rows: Sequence[LayerCache]) -> list[tuple[list[int], int]]:
    """Groups of two or more rows (their indices) whose float KV caches read one shared prefix
    (:attr:`~mlxchat.cache.KVCache.shared`) for at least :data:`SHARED_PREFIX_MIN` tokens, and the length all of
    them read."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, row in enumerate(rows):
        if type(row) is KVCache and row.shared is not None and row.base >= SHARED_PREFIX_MIN:
            groups.setdefault(id(row.shared), []).append((i, row.base))
    return [([i for i, _ in members], min(length for _, length in members))
            for members in groups.values() if len(members) > 1]


def shared_part(queries: mx.array, members: list[int], shared: SharedPrefix, length: int,
                scale: float) -> tuple[mx.array, mx.array] | None:
    """The decode queries ``queries[i]`` of the rows ``members`` over the first ``length`` keys of the prefix they
    share, read once by every member's heads together (cascade attention, as FlashInfer and SGLang do for shared
    prefixes): the outputs ``[count, heads, 1, Dv]`` and their log-sum-exps ``[count, heads, 1, 1]``. ``None``
    where the native kernel does not apply."""
    _, heads, _, dims = queries.shape
    kv_heads = shared.keys.shape[1]
    rep, count = heads // kv_heads, len(members)

    def by_member(x: mx.array) -> mx.array:
        """``[1, kv_heads * count * rep, 1, F]`` (every member's query heads of a KV head together) back to
        ``[count, heads, 1, F]``."""
        return x.reshape(kv_heads, count, rep, -1).transpose(1, 0, 2, 3).reshape(count, heads, 1, -1)

    grouped = queries[mx.array(members)].reshape(count, kv_heads, rep, dims).transpose(1, 0, 2, 3)
    together = kernels.attention_parts(grouped.reshape(1, kv_heads * count * rep, 1, dims),
                                       shared.keys[..., :length, :], shared.values[..., :length, :], scale)
    return None if together is None else (by_member(together[0]), by_member(together[1]))


def merge_parts(out: mx.array, lse: mx.array, other_out: mx.array, other_lse: mx.array) -> mx.array:
    """Attention over two parts of the keys merged from each part's outputs and log-sum-exps."""
    return out + mx.sigmoid(other_lse - lse) * (other_out - out)  # the other part's share of each row


def attend_shared(queries: mx.array, held: list[Attended], members: list[int], length: int,
                  scale: float) -> list[mx.array] | None:
    """The outputs ``[1, heads, 1, Dv]`` of the decode queries ``queries[i]`` of the rows ``members``, which read one
    shared prefix for at least ``length`` tokens: its first ``length`` keys read once for all (:func:`shared_part`),
    each row's keys after them by themselves, the parts merged by their log-sum-exps. ``None`` where the native
    kernel does not apply."""
    rows: list[PrefixedKeysValues] = [held[i] for i in members]  # type: ignore[misc]
    part = shared_part(queries, members, rows[0].shared, length, scale)
    own = [kernels.attention_parts(queries[i : i + 1], row.keys, row.values, scale,  # the prefix it reads further too
                                   None if row.length == length else row.span(length))
           for i, row in zip(members, rows, strict=True)]
    if part is None or any(mine is None for mine in own):
        return None
    out = merge_parts(mx.concatenate([mine[0] for mine in own]),  # type: ignore[index]
                      mx.concatenate([mine[1] for mine in own]), *part)  # type: ignore[index]
    return [out[j : j + 1] for j in range(len(members))]


def attend_over(queries: mx.array, held: Attended, scale: float, mask: mx.array | str | None = None,
                window: int | None = None) -> mx.array:
    """Causal attention of ``[B, heads, L, D]`` queries (the last ``L`` positions) over what
    :func:`fetch_attended` gave, within the last ``window`` positions when one is given; a ``mask`` array
    (``[L, keys]``, true where a query sees a key) replaces the causal and window masks.

    On a CPU (float32) one fused native kernel reads float or packed keys and values where they lie, a shared
    prefix and a cache's own in one pass (:func:`mlxchat.kernels.attention`); elsewhere MLX's attention runs
    (over a quantized cache: :func:`quantized_attend`; over a shared prefix: the two parts joined).
    """
    causal = mask is None or isinstance(mask, str)
    if isinstance(held, PrefixedKeysValues):
        fused = kernels.attention(queries, held.keys, held.values, scale, window, held.span()) if causal else None
        if fused is not None:
            return fused
        held = held.joined()
    if isinstance(held, QuantizedKeysValues):
        if causal:
            fused = kernels.quantized_attention(queries, held, scale, window)
            if fused is not None:
                return fused
            if window is None:
                return quantized_attend(queries, held, scale)
        keys, values = held.dequantized()
    else:
        keys, values = held
    if causal:
        fused = kernels.attention(queries, keys, values, scale, window)
        if fused is not None:
            return fused
        if window is not None:
            mask = window_mask(queries.shape[2], keys.shape[2], window)
        elif queries.shape[2] > 1:
            mask = "causal"
    if keys.dtype != queries.dtype:  # a float16 cache (kv_bits=16) where the kernel does not read it
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def quantized_attend(queries: mx.array, held: QuantizedKeysValues, scale: float) -> mx.array:
    """Causal attention over a quantized cache with MLX's operations (where the native kernel does not run:
    a GPU, other dtypes or bits): the scores of the packed keys and the weighted sum of the packed values
    are ``mx.quantized_matmul`` products (no float copy of the cache), the float tail attended as floats,
    one softmax over both."""
    batch, heads, length, dims = queries.shape
    kv_heads, dims_v = held.keys.shape[1], held.values.shape[-1]
    grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads * length, dims)  # heads of a KV head
    scores = mx.concatenate([*(mx.quantized_matmul(padded(grouped, held.group_size), *part[0], transpose=True,
                                                   group_size=held.group_size, bits=held.bits) for part in held.packed),
                             grouped @ held.keys.swapaxes(-1, -2)], -1)
    total = scores.shape[-1]
    if length > 1:
        last = mx.arange(heads // kv_heads * length)[:, None] % length + total - length
        scores = mx.where(mx.arange(total)[None] <= last, scores, -mx.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(scores.dtype)
    start = total - held.keys.shape[2]
    out = probs[..., start:] @ held.values
    for part in reversed(held.packed):
        count = part[1][0].shape[2]
        out = out + mx.quantized_matmul(probs[..., start - count : start], *part[1], transpose=False,
                                        group_size=held.group_size, bits=held.bits)[..., :dims_v]
        start -= count
    return out.reshape(batch, heads, length, dims_v)


class Attention(nn.Module):
    """Grouped-query attention with optional per-head q/k RMSNorm before the rotary embedding, over all
    earlier positions or (``window``) the last few: give such a layer a
    :class:`~mlxchat.cache.SlidingWindowCache` of that window.

    Attribute names are the checkpoint's (``q_proj`` ... ``o_proj``, ``q_norm``, ``k_norm``); q/k/v run as one
    product once loaded (:mod:`mlxchat.layers.fused`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RoPE,
        *,
        qk_norm_eps: float | None = None,
        bias: bool = False,
        scale: float | None = None,
        window: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj: nn.Module = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self._qkv = Projections("q_proj", "k_proj", "v_proj")
        self.qk_norm = qk_norm_eps is not None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KeysValues | RowCaches | RaggedRows | None = None) -> mx.array:
        parts = self._qkv.parts(self, x)
        return self.o_proj(each_sequence(self._attend, cache, *parts, axis=1))  # each sequence over its own cache

    def _attend(self, *arrays: Any) -> mx.array:
        """One sequence's (or a batch of decode rows') attention, its heads side by side ``[B, L, heads * Dv]``,
        from the q/k/v product's parts (:meth:`~mlxchat.layers.fused.Projections.parts`) and its cache (last)."""
        *parts, cache = arrays
        batch, length, _ = parts[0].shape
        made = self._heads(parts, cache)
        if made is None:
            q, k, v = self._qkv.split(parts)
            q = q.reshape(batch, length, self.num_heads, self.head_dim)
            k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
            v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
            offset = cache.offset if cache is not None else 0
            made = self.rope(q, offset), self.rope(k, offset), v
        out = attend(*made, cache, self.scale, window=self.window)  # [B, heads, L, Dv]: one position is laid out so
        return (out if length == 1 else out.transpose(0, 2, 1, 3)).reshape(batch, length, -1)

    def _heads(self, parts: list[mx.array],
               cache: KeysValues | RowCaches | None) -> tuple[mx.array, mx.array, mx.array] | None:
        """The heads, normalized and turned, in one node where it applies (:func:`fused_heads`)."""
        at = cache.offset if cache is not None else 0
        return fused_heads(parts, self.num_heads, self.num_kv_heads, self.rope, at,
                           (self.q_norm, self.k_norm) if self.qk_norm else None)

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel: each rank keeps some query heads and the KV heads they read (see
        :func:`~mlxchat.layers.parallel.head_split`); the output projection sums the ranks' heads."""
        split = head_split(self.num_heads, self.num_kv_heads, group.size())
        (q0, q1), (k0, k1) = split[group.rank()]
        d = self.head_dim
        slice_outputs(self.q_proj, [(q0 * d, q1 * d)])
        slice_outputs(self.k_proj, [(k0 * d, k1 * d)])
        slice_outputs(self.v_proj, [(k0 * d, k1 * d)])
        self.o_proj = RowParallelLinear(self.o_proj, [(a * d, b * d) for (a, b), _ in split], group)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0


def fused_heads(parts: list[mx.array], heads: int, kv_heads: int, rope: nn.Module, at: int | mx.array,
                norms: tuple[nn.Module, nn.Module] | None, span: int = 1) -> tuple[mx.array, mx.array, mx.array] | None:
    """Attention's heads ``[B, heads, L, D]`` from a q/k/v product's parts (:meth:`Projections.parts
    <mlxchat.layers.fused.Projections.parts>`) in one node (:func:`mlxchat.kernels.heads`): the q and k ``norms``
    (RMS norms of one eps), then ``rope`` at ``at`` (the first position, or each row's). ``None`` where it does not
    apply: another rotation (a plugin's own), positions the kernel does not take, other norms (their ops run).
    ``span`` 2: each query head is followed in the product by a gate (Qwen3.5's)."""
    if type(rope) not in (RoPE, MRoPE):
        return None
    q, k, v = (parts[0], None, None) if len(parts) == 1 else parts
    turn = rope.rotation(at, q.shape[1])  # type: ignore[attr-defined]
    if turn is None:
        return None
    weights = None
    if norms is not None:
        q_norm, k_norm = norms
        if type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm or q_norm.eps != k_norm.eps:
            return None
        weights = (q_norm.weight, k_norm.weight, q_norm.eps)
    return kernels.heads(q, k, v, heads, kv_heads, weights, turn, span)


def window_mask(length: int, key_length: int, window: int, blocks: mx.array | None = None) -> mx.array | None:
    """Sliding-window causal mask: ``length`` queries, the last positions of ``key_length`` contiguous keys,
    each seeing itself and the ``window - 1`` keys before it. ``None`` when that is every key.

    ``blocks [length]`` (block id per query, -1 for none) also lets the queries of one block see each
    other's keys in both directions, still within the window: an image's tokens attending to the whole
    image. The keys before the chunk belong to no block.
    """
    if length == 1 and key_length <= window and blocks is None:
        return None
    queries = mx.arange(key_length - length, key_length)[:, None]
    keys = mx.arange(key_length)[None]
    visible = keys <= queries
    if blocks is not None:
        key_blocks = mx.concatenate([mx.full((key_length - length,), -1, blocks.dtype), blocks])
        visible = visible | ((blocks[:, None] == key_blocks[None]) & (blocks[:, None] >= 0))
    return visible & (queries - keys < window)
