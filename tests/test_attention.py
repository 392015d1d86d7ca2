"""Attention through the fused native kernel (mlxchat.kernels.attention, core/native/attention.cpp) equals a
plain MLX attention: float32, float16 and 4/8-bit quantized caches, grouped-query heads, causal chunks of uneven
lengths and single tokens, sliding windows, cache lengths around the quantization groups and the kernel's
key blocks, batch rows of different lengths, on every instruction set the CPU has; it reads the cache in
place (no copy of the used part, no scores), Gemma 4's quantized layers included; it gives each row's
log-sum-exp, and decode rows that copied one prefix read it once (cascade attention) with their own outputs;
gradients, ``mx.compile`` and ``vmap`` work; and MLX's own attention runs where the kernel does not apply."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from mlxchat import kernels
from mlxchat.cache import (
    KVCache,
    PrefixedKeysValues,
    QuantizedKVCache,
    RowCaches,
    SlidingWindowCache,
    distinct_nbytes,
    padded,
)
from mlxchat.layers import attend, attend_over, fetch_attended

pytestmark = pytest.mark.skipif(kernels._native()[0] is None, reason=f"fused kernels: {kernels._native()[1]}")

ISAS = kernels._native()[0].attention_isas() if kernels._native()[0] else ["scalar"]
"""What the kernel's loops run on here, the last its own (avx512 vnni: packed keys scored in integers)."""


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    module = kernels._native()[0]
    assert module is not None
    module.set_attention_isa(request.param)
    yield request.param
    module.set_attention_isa(ISAS[-1])


def plain_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    window: int | None = None) -> mx.array:
    """Attention of the last positions over every key, K/V heads repeated, mask built whole, in MLX's ops."""
    length, total = queries.shape[2], keys.shape[2]
    repeat = queries.shape[1] // keys.shape[1]
    keys, values = mx.repeat(keys, repeat, 1), mx.repeat(values, repeat, 1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    position, key = mx.arange(total - length, total)[:, None], mx.arange(total)[None]
    visible = key <= position
    if window is not None:
        visible = visible & (position - key < window)
    probs = mx.softmax(mx.where(visible, scores, -mx.inf), axis=-1, precise=True)
    return probs @ values


def held(cache: KVCache) -> tuple[mx.array, mx.array]:
    """The float keys and values a cache holds (a quantized one's dequantized, features padded to groups)."""
    if not isinstance(cache, QuantizedKVCache):
        return cache.span(0, cache.offset)
    parts = []
    for i, tail in enumerate(cache.tail or (None, None)):
        whole = []
        if cache.held_quantized:
            packed = cache.packed_span(0, cache.held_quantized)[i]
            whole.append(mx.dequantize(*packed, group_size=cache.group_size, bits=cache.bits))
        if tail is not None:
            whole.append(padded(tail, cache.group_size))
        parts.append(mx.concatenate(whole, axis=2))
    return parts[0], parts[1]


def run_chunks(cache: KVCache, lengths: tuple[int, ...], heads: int, kv_heads: int, dims: int,
               window: int | None = None, seed: int = 0) -> list[float]:
    """Attend chunk after chunk through the cache; each output's max abs difference from plain attention
    over what the cache then holds plus the chunk."""
    rng = np.random.default_rng(seed)
    errors = []
    for length in lengths:
        q = mx.array(rng.standard_normal((1, heads, length, dims)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, kv_heads, length, dims)).astype(np.float32)) for _ in range(2))
        stored_k, stored_v = (x.astype(cache.dtype).astype(mx.float32) if cache.dtype else x for x in (k, v))
        if cache.offset:
            before_k, before_v = held(cache)
            before_k, before_v = before_k[..., :dims], before_v[..., :dims]
            all_k, all_v = mx.concatenate([before_k, stored_k], 2), mx.concatenate([before_v, stored_v], 2)
        else:
            all_k, all_v = stored_k, stored_v
        expected = plain_attention(q, all_k, all_v, dims**-0.5, window)
        got = attend(q, k, v, cache, dims**-0.5, window=window)
        errors.append(float(mx.abs(got - expected).max()))
    return errors


CHUNKS = (1, 70, 1, 1, 63, 1, 129, 2, 1, 300, 1)
"""Chunk lengths that end the cache before, on and after groups of 32 and 64 and the kernel's blocks of 64 keys."""


def tolerance(isa: str, kind: str) -> float:
    """Packed keys scored in integers see the query rounded to int16 (attention_dot.h): outputs off by ~1e-4."""
    return 2e-4 if isa == "avx512 vnni" and kind.endswith("-bit") else 2e-5


def make_cache(kind: str, group_size: int = 64) -> KVCache:
    if kind in ("float", "float16"):
        return KVCache(mx.float16 if kind == "float16" else None)
    return QuantizedKVCache(8 if kind == "8-bit" else 4, group_size)


@pytest.mark.parametrize("kind", ["float", "float16", "8-bit", "4-bit"])
@pytest.mark.parametrize(("heads", "kv_heads", "dims"), [(4, 4, 64), (4, 2, 128), (4, 2, 80), (6, 2, 48), (8, 1, 80)])
def test_attention_over_a_cache_equals_plain_attention(isa: str, kind: str, heads: int, kv_heads: int,
                                                       dims: int) -> None:
    """A float16 cache is read as it lies, each half converted exactly: as plain attention over the float16 values."""
    errors = run_chunks(make_cache(kind, 32 if dims == 80 else 64), CHUNKS, heads, kv_heads, dims)
    assert max(errors) < tolerance(isa, kind), errors


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_rows_in_groups_of_128(isa: str, bits: int) -> None:
    """A group longer than the 64 bytes integer scoring reads at a time (8-bit), or filling them (4-bit)."""
    for heads in (4, 2):
        errors = run_chunks(QuantizedKVCache(bits, 128), (1, 200, 1, 1), heads, 2, 256)
        assert max(errors) < tolerance(isa, f"{bits}-bit"), errors


@pytest.mark.parametrize(("bits", "dims"), [(4, 192), (8, 576)])
def test_packed_keys_of_a_partial_last_block_or_past_integer_scoring(isa: str, bits: int, dims: int) -> None:
    """Integer scoring reads 64 bytes at a time: 4-bit keys of 192 features end in half a block (its second
    group); 8-bit ones of 576 are more blocks than it takes, and are scored in float."""
    errors = run_chunks(QuantizedKVCache(bits, 64), (1, 70, 1, 1), 4, 2, dims)
    assert max(errors) < tolerance(isa, f"{bits}-bit"), errors


def test_a_query_of_tiny_values_over_packed_keys_attends_evenly(isa: str) -> None:
    """Its int16 scale stays a normal float: the scores come out about 0, not infinite."""
    cache, rng = QuantizedKVCache(8, 64), np.random.default_rng(4)
    k, v = (mx.array(rng.standard_normal((1, 2, 100, 64)).astype(np.float32)) for _ in range(2))
    cache.update_and_fetch(k, v)
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32)) * 1e-37
    new_k, new_v = (mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) for _ in range(2))
    got = attend(q, new_k, new_v, cache, 0.125)
    assert float(mx.abs(got - mx.repeat(held(cache)[1].mean(2, keepdims=True), 2, 1)).max()) < 1e-5


@pytest.mark.parametrize("dims", [40, 24])
def test_float_rows_of_features_not_a_multiple_of_16_are_staged(isa: str, dims: int) -> None:
    for kind in ("float", "float16"):
        assert max(run_chunks(make_cache(kind), (1, 70, 1, 65, 1), 4, 2, dims)) < 2e-5


def test_float16_keys_and_values_laid_out_otherwise_are_read_as_they_are(isa: str) -> None:
    """Features not contiguous (a transposed array): the kernel copies them as they are, two bytes each."""
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((1, 4, 3, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 2, 32, 90)).astype(np.float16)).swapaxes(2, 3) for _ in range(2))
    out = kernels.attention(q, k, v, 0.3)
    assert out is not None
    assert float(mx.abs(out - plain_attention(q, k.astype(mx.float32), v.astype(mx.float32), 0.3)).max()) < 2e-5


@pytest.mark.parametrize("window", [1, 7, 128, 200])
def test_sliding_windows_equal_plain_attention(isa: str, window: int) -> None:
    assert max(run_chunks(KVCache(), CHUNKS, 4, 2, 32, window)) < 2e-5


def test_a_sliding_window_cache_attends_like_the_window_mask() -> None:
    """A SlidingWindowCache hands single queries its slots in slot order and chunks the window before them;
    the kernel's window sees exactly what plain attention over the whole history does."""
    window, rng = 9, np.random.default_rng(5)
    cache, everything = SlidingWindowCache(window), []
    for length in (5, 1, 1, 12, 1, 1, 1, 3, 1):
        q, k, v = (mx.array(rng.standard_normal((1, h, length, 16)).astype(np.float32)) for h in (4, 2, 2))
        everything.append((k, v))
        all_k, all_v = (mx.concatenate([kv[i] for kv in everything], 2) for i in (0, 1))
        got = attend(q, k, v, cache, 0.25, window=window)
        assert float(mx.abs(got - plain_attention(q, all_k, all_v, 0.25, window)).max()) < 2e-5


def test_long_contexts_and_a_single_key() -> None:
    assert max(run_chunks(KVCache(), (1,), 2, 1, 16)) < 1e-6  # one query, one key
    assert max(run_chunks(QuantizedKVCache(8, 64), (5000, 1, 1, 257, 1), 16, 8, 128)) < 2e-5


def test_rows_of_different_lengths_each_attend_over_their_own(isa: str) -> None:
    rng = np.random.default_rng(2)
    for kind in ("float", "float16", "8-bit"):
        rows = [make_cache(kind, 32) for _ in range(3)]
        for row, length in zip(rows, (40, 3, 97), strict=True):
            k, v = (mx.array(rng.standard_normal((1, 2, length, 32)).astype(np.float32)) for _ in range(2))
            row.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((3, 4, 1, 32)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((3, 2, 1, 32)).astype(np.float32)) for _ in range(2))
        expected = []
        for i, row in enumerate(rows):
            before_k, before_v = (x[..., :32] for x in held(row))
            new_k, new_v = (x[i : i + 1].astype(row.dtype or mx.float32) for x in (k, v))
            expected.append(plain_attention(q[i : i + 1], mx.concatenate([before_k, new_k], 2).astype(mx.float32),
                                            mx.concatenate([before_v, new_v], 2).astype(mx.float32), 0.2))
        got = attend(q, k, v, RowCaches(rows), 0.2)  # type: ignore[arg-type]
        assert float(mx.abs(got - mx.concatenate(expected, 0)).max()) < tolerance(isa, kind)


@pytest.mark.parametrize("keys", [37, 4096])  # one task a KV head, and keys split among tasks (merged after)
def test_the_kernel_gives_each_rows_log_sum_exp(isa: str, keys: int) -> None:
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((2, 6, 3, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((2, 2, keys, 32)).astype(np.float32)) for _ in range(2))
    parts = kernels.attention_parts(q, k, v, 0.3)
    assert parts is not None
    out, lse = parts
    scores = (q * 0.3).reshape(2, 2, 3, 3, 32) @ k[:, :, None].swapaxes(-1, -2)  # [B, kv heads, group, L, keys]
    visible = mx.arange(keys)[None] <= mx.arange(keys - 3, keys)[:, None]
    expected = mx.logsumexp(mx.where(visible, scores, -mx.inf), axis=-1, keepdims=True).reshape(2, 6, 3, 1)
    assert float(mx.abs(lse - expected).max()) < 1e-4
    assert float(mx.abs(out - plain_attention(q, k, v, 0.3)).max()) < 2e-5
    if keys < 100:  # differentiable like the plain output (through the kernel's MLX reference)
        grad = mx.grad(lambda x: kernels.attention_parts(x, k, v, 0.3)[1].sum())(q)  # type: ignore[index]
        plain = mx.grad(lambda x: mx.logsumexp(mx.where(visible, (x * 0.3).reshape(2, 2, 3, 3, 32)
                                                        @ k[:, :, None].swapaxes(-1, -2), -mx.inf), axis=-1).sum())(q)
        assert float(mx.abs(grad - plain).max()) < 1e-4


@pytest.mark.parametrize(("prefix", "length", "window"), [(37, 5, 0), (3000, 1, 0), (3000, 40, 0), (300, 9, 50)])
def test_the_kernel_reads_a_prefix_and_the_rest_where_each_lies(isa: str, prefix: int, length: int,
                                                                window: int) -> None:
    """Keys and values in two parts (a shared prefix, a cache's own): as over the two joined, the log-sum-exp and
    a window across the parts included, and differentiable the same way."""
    rng = np.random.default_rng(prefix + length)
    q = mx.array(rng.standard_normal((1, 4, length, 32)).astype(np.float32))
    first, rest = random_kv(rng, prefix), random_kv(rng, length + 20)
    joined = [mx.concatenate([a, b], axis=2) for a, b in zip(first, rest, strict=True)]
    out = kernels.attention(q, *rest, 0.3, window or None, prefix=(first[0], first[1]))
    assert out is not None
    assert float(mx.abs(out - plain_attention(q, *joined, 0.3, window=window or None)).max()) < 2e-5
    if not window:
        parts = kernels.attention_parts(q, *rest, 0.3, (first[0], first[1]))
        whole = kernels.attention_parts(q, *joined, 0.3)
        assert parts is not None and whole is not None
        assert float(mx.abs(parts[1] - whole[1]).max()) < 1e-4
    if prefix < 100:
        grads = mx.grad(lambda x, k: kernels.attention(x, k, rest[1], 0.3, prefix=(first[0], first[1])).sum(),  # type: ignore[union-attr]
                        argnums=(0, 1))(q, rest[0])
        plain = mx.grad(lambda x, k: plain_attention(x, mx.concatenate([first[0], k], 2), joined[1], 0.3).sum(),
                        argnums=(0, 1))(q, rest[0])
        assert all(float(mx.abs(a - b).max()) < 1e-4 for a, b in zip(grads, plain, strict=True))


def random_kv(rng: np.random.Generator, length: int, heads: int = 2) -> list[mx.array]:
    """Keys and values of ``length`` positions."""
    return [mx.array(rng.standard_normal((1, heads, length, 32)).astype(np.float32)) for _ in range(2)]


@pytest.mark.parametrize("kind", ["float", "float16"])
def test_decode_rows_write_and_attend_in_one_node_in_place_unless_a_buffer_is_held_elsewhere(
        isa: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows of float caches run as one node (kernels.decode_rows): each output equals the row's own
    attention, each cache then holds its new key and value (a row at the end of its buffer grows first), buffers
    nothing else holds are written in place, and one something else holds is copied and left as it was."""
    def address(a: mx.array) -> int:
        return int(np.asarray(a).__array_interface__["data"][0])

    rng = np.random.default_rng(8)
    rows = [make_cache(kind) for _ in range(3)]
    for row, length in zip(rows, (40, KVCache.step, 97), strict=True):  # the second row's buffer is full
        row.update_and_fetch(*random_kv(rng, length))
    mx.eval([a for row in rows for a in (row.keys, row.values)])
    q = mx.array(rng.standard_normal((3, 4, 1, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((3, 2, 1, 32)).astype(np.float32)) for _ in range(2))
    expected, stored = [], []
    for i, row in enumerate(rows):
        new_k, new_v = (x[i : i + 1].astype(row.dtype or mx.float32) for x in (k, v))
        stored.append((new_k, new_v))
        before_k, before_v = held(row)
        expected.append(plain_attention(q[i : i + 1], mx.concatenate([before_k, new_k], 2).astype(mx.float32),
                                        mx.concatenate([before_v, new_v], 2).astype(mx.float32), 0.2))
    mx.eval(expected, stored)  # (lets go of the views of the buffers it read)
    del before_k, before_v
    in_place = address(rows[0].keys), address(rows[0].values)
    kept = rows[2].keys  # held elsewhere too (as a snapshot might)
    kept_before = np.array(kept)
    calls = []
    decode_rows = kernels.decode_rows
    monkeypatch.setattr(kernels, "decode_rows", lambda *a, **kw: calls.append(len(a[3])) or decode_rows(*a, **kw))
    got = attend(q, k, v, RowCaches(rows), 0.2)  # type: ignore[arg-type]
    mx.eval(got, [a for row in rows for a in (row.keys, row.values)])
    assert calls == [6]
    assert float(mx.abs(got - mx.concatenate(expected, 0)).max()) < 2e-5
    for row, length, (new_k, new_v) in zip(rows, (41, KVCache.step + 1, 98), stored, strict=True):
        assert row.offset == length and row.keys is not None and row.keys.shape[2] >= length
        last_k, last_v = (x[..., -1:, :] for x in row.span(0, length))
        assert mx.array_equal(last_k, new_k) and mx.array_equal(last_v, new_v)
    assert (address(rows[0].keys), address(rows[0].values)) == in_place
    assert np.array_equal(np.array(kept), kept_before, equal_nan=True)  # (its unwritten room: whatever it held)
    assert address(rows[2].keys) != address(kept)
    with pytest.raises(ValueError, match="start"):
        decode_rows(q[:1], k[:1].astype(kept.dtype), v[:1].astype(kept.dtype), [rows[0].keys, rows[0].values],
                    [rows[0].keys.shape[2]], 0.2)


def test_decode_rows_whose_buffers_differ_in_dtype_attend_one_by_one() -> None:
    """A float cache can hold another format's buffers (loaded from a float16 cache's state, as a pool's copy
    between formats does): such rows are not one node's (the keys' dtype must be every buffer's), and attend as
    each would alone."""
    rng = np.random.default_rng(4)
    half = KVCache(mx.float16)
    half.update_and_fetch(*random_kv(rng, 40))
    rows = [KVCache(), KVCache()]
    rows[0].load_state(*half.state_dict())
    rows[0].trim_to(30)
    rows[1].update_and_fetch(*random_kv(rng, 20))
    assert rows[0].keys is not None and rows[0].keys.dtype == mx.float16
    q = mx.array(rng.standard_normal((2, 4, 1, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((2, 2, 1, 32)).astype(np.float32)) for _ in range(2))
    expected = []
    for i, row in enumerate(rows):
        before_k, before_v = held(row)
        expected.append(plain_attention(q[i : i + 1], mx.concatenate([before_k.astype(mx.float32), k[i : i + 1]], 2),
                                        mx.concatenate([before_v.astype(mx.float32), v[i : i + 1]], 2), 0.2))
    got = attend(q, k, v, RowCaches(rows), 0.2)  # type: ignore[arg-type]
    assert float(mx.abs(got - mx.concatenate(expected, 0)).max()) < 2e-3  # (the new key stored as float16)
    assert [row.offset for row in rows] == [31, 21]


@pytest.mark.parametrize("one_by_one", [False, True])  # one node for every row, or (where it does not apply) not
def test_decode_rows_reading_one_shared_prefix_read_it_once_and_attend_as_alone(
        isa: str, one_by_one: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose caches read one shared prefix attend over it together (cascade attention); each row's output
    equals its own attention, a row that reads less of it, a row outside the group's and a row reading a prefix
    of its own (where it lies) included."""
    from mlxchat.layers import attention

    rng = np.random.default_rng(6)
    rows = [KVCache() for _ in range(5)]
    rows[0].update_and_fetch(*random_kv(rng, 305))
    rows[1].copy_from(rows[0], 300)  # the source moves its first 300 tokens into a shared prefix
    rows[2].copy_from(rows[0], 290)
    rows[2].update_and_fetch(*random_kv(rng, 70))
    rows[3].update_and_fetch(*random_kv(rng, 280))  # keys of its own
    elsewhere = KVCache()
    elsewhere.update_and_fetch(*random_kv(rng, 400))
    rows[4].copy_from(elsewhere, 350)  # a prefix no other row of the batch reads
    assert rows[0].shared is rows[1].shared is rows[2].shared is not None and rows[3].shared is None
    assert rows[4].shared is not None and rows[4].base == 350
    assert attention.shared_prefixes(rows) == [([0, 1, 2], 290)]
    q = mx.array(rng.standard_normal((5, 4, 1, 32)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((5, 2, 1, 32)).astype(np.float32)) for _ in range(2))
    expected = []
    for i, row in enumerate(rows):
        before_k, before_v = held(row)
        expected.append(plain_attention(q[i : i + 1], mx.concatenate([before_k, k[i : i + 1]], 2),
                                        mx.concatenate([before_v, v[i : i + 1]], 2), 0.2))
    groups, nodes = [], []
    shared, decode_rows = attention.shared_part, kernels.decode_rows
    monkeypatch.setattr(attention, "shared_part", lambda *a: groups.append(a[1]) or shared(*a))
    monkeypatch.setattr(kernels, "decode_rows", lambda *a, **kw: nodes.append(kw["lse"]) or (
        None if one_by_one else decode_rows(*a, **kw)))
    got = attend(q, k, v, RowCaches(rows), 0.2)  # type: ignore[arg-type]
    assert nodes == [True]  # every row's own part in one node, with its log-sum-exp
    assert groups == [[0, 1, 2]] * (2 if one_by_one else 1)  # (built for the node, then for the rows one by one)
    assert float(mx.abs(got - mx.concatenate(expected, 0)).max()) < 2e-5


@pytest.mark.parametrize("length", [1, 37])
def test_a_chunk_after_a_shared_prefix_attends_over_both_parts_as_over_one(isa: str, length: int) -> None:
    """A prompt chunk (or a decode token) of a cache that reads a shared prefix: every query sees the whole prefix,
    and its own part causally, as plain attention over the joined keys does."""
    rng = np.random.default_rng(length)
    source, copy = KVCache(), KVCache()
    source.update_and_fetch(*random_kv(rng, 400))
    copy.copy_from(source, 330)
    copy.update_and_fetch(*random_kv(rng, 20))
    before_k, before_v = copy.span(0, copy.offset)
    q = mx.array(rng.standard_normal((1, 4, length, 32)).astype(np.float32))
    k, v = random_kv(rng, length)
    held_now = fetch_attended(copy, k, v)
    assert isinstance(held_now, PrefixedKeysValues) and held_now.length == 330
    expected = plain_attention(q, mx.concatenate([before_k, k], 2), mx.concatenate([before_v, v], 2), 0.3)
    assert float(mx.abs(attend_over(q, held_now, 0.3) - expected).max()) < 2e-5
    assert float(mx.abs(attend_over(q, held_now, 0.3, window=64)  # a window reaching back across the two parts
                        - plain_attention(q, *held_now.joined(), 0.3, window=64)).max()) < 2e-5


@pytest.mark.parametrize("quantized", [False, True])
def test_a_cache_grows_by_eighths_of_its_length_and_makes_room_for_a_reserved_prompt_at_once(
        quantized: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    assert [KVCache.capacity(n) for n in (1, 256, 257, 4096, 4097, 5000, 16384, 16385)] == [
        256, 256, 512, 4096, 4608, 5120, 16384, 18432]
    sizes = range(1, 70_000, 97)
    assert all(KVCache.capacity(a) <= KVCache.capacity(b) for a, b in itertools.pairwise(sizes))
    assert all(n <= KVCache.capacity(n) <= max(n + KVCache.step, n * 9 // 8 + 1) for n in sizes)
    growths: list[int] = []
    grown = KVCache._grown

    def counted(self: KVCache, buffers: list[mx.array] | None, like: list[tuple[tuple[int, ...], mx.Dtype]],
                start: int, length: int) -> list[mx.array]:
        out = grown(self, buffers, like, start, length)
        growths.append(out[0].shape[2])
        return out

    monkeypatch.setattr(KVCache, "_grown", counted)
    rng = np.random.default_rng(5)
    cache = QuantizedKVCache(8, 64) if quantized else KVCache()
    cache.reserve(5000)  # a prompt of 4,999 tokens and its first decode step
    for _ in range(39):  # the prompt in chunks of 128 tokens, the last short
        cache.update_and_fetch(*random_kv(rng, 128))
    cache.update_and_fetch(*random_kv(rng, 5000 - 39 * 128 - 1))
    assert cache.offset == 4999 and growths == [5120]  # one allocation for all of it
    for _ in range(300):  # decoding past it grows by an eighth (5120 + 512 tokens), not by a step
        cache.update_and_fetch(*random_kv(rng, 1))
    assert growths == [5120, 5632]
    whole = cache.update_and_fetch(*random_kv(rng, 1))
    assert whole[0].shape[2] == 5300  # what it holds is still exactly the tokens written


def test_a_copy_reads_a_long_prefix_where_it_lies_and_holds_the_same_keys() -> None:
    rng = np.random.default_rng(3)
    source = KVCache()
    source.update_and_fetch(*random_kv(rng, 400))
    whole = [mx.array(a) for a in source.span(0, 400)]

    def same(cache: KVCache, length: int) -> bool:
        return cache.offset == length and all(mx.array_equal(a, b[..., :length, :]).item()
                                              for a, b in zip(cache.span(0, length), whole, strict=True))

    short = KVCache()
    short.copy_from(source, 200)  # too short to share: copied
    assert short.shared is None and source.shared is None and same(short, 200)
    first = KVCache()
    first.copy_from(source, 300)  # the source's first 300 tokens move into a shared prefix, both read it
    assert source.shared is first.shared is not None and (source.base, first.base) == (300, 300)
    assert source.keys is not None and source.keys.shape[2] == KVCache.step  # the 100 after it: its own buffer
    assert same(source, 400) and same(first, 300)
    second = KVCache()
    second.copy_from(source, 350)  # the prefix read, the 50 after it copied
    assert second.shared is source.shared and second.base == 300 and same(second, 350)
    assert distinct_nbytes([c.state for c in (source, first, second)]) < 2 * source.nbytes  # the prefix counts once
    first.trim_to(250)  # cut back into the prefix: reads less of it
    assert first.base == 250 and same(first, 250)
    first.update_and_fetch(*random_kv(rng, 10))
    assert first.base == 250 and first.offset == 260 and mx.array_equal(first.span(0, 250)[0], whole[0][..., :250, :])
    source.update_and_fetch(*random_kv(rng, 300))
    further = KVCache()
    further.copy_from(source, 580)  # 280 past the 300-token prefix: read it, copy the 280 (a new prefix: 580 again)
    assert further.shared is source.shared is second.shared and further.base == 300
    longer = KVCache()
    longer.copy_from(source, 650)  # 350 past it: the source makes a new prefix of its first 650
    assert longer.shared is source.shared is not second.shared and longer.base == 650
    assert all(mx.array_equal(a, b).item() for a, b in zip(longer.span(0, 650), source.span(0, 650), strict=True))
    saved, fields = second.state_dict()  # saved whole; loaded back as a cache of its own
    assert saved["keys"].shape[2] == 350
    second.load_state(saved, fields)
    assert second.shared is None and second.base == 0 and same(second, 350)
    first.trim_to(0)
    assert first.shared is None


@pytest.mark.parametrize("kind", ["float", "float16", "8-bit"])
def test_decoding_reads_the_cache_in_place(kind: str) -> None:
    """A decode step over 16k cached keys (16 MB or more) allocates its output and the new token: neither a copy
    of the cache's used part nor scores (1 MB in MLX's attention)."""
    cache = make_cache(kind)
    cache.update_and_fetch(mx.random.normal((1, 8, 16384, 64)), mx.random.normal((1, 8, 16384, 64)))
    mx.eval(cache.state)
    step = [mx.random.normal((1, 16, 1, 64)), mx.random.normal((1, 8, 1, 64)), mx.random.normal((1, 8, 1, 64))]
    mx.eval(step)
    for _ in range(2):  # the second step measures: the first may grow the buffers
        cache.trim_to(16384)
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        out = attend(*step, cache, 0.125)
        mx.eval(out, cache.state)
        grown = mx.get_peak_memory() - before
    assert grown < 1 << 16, grown


def test_gradients_compile_and_vmap_equal_plain_attention() -> None:
    q, k, v = mx.random.normal((2, 4, 40, 16)), mx.random.normal((2, 2, 40, 16)), mx.random.normal((2, 2, 40, 16))

    def loss(fn, q, k, v):  # noqa: ANN001, ANN202
        return (fn(q, k, v) * mx.arange(16)).sum()

    def ours(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        return attend(q, k, v, None, 0.25, window=9)

    def theirs(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        return plain_attention(q, k, v, 0.25, 9)

    got = mx.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, v)
    expected = mx.grad(lambda *a: loss(theirs, *a), argnums=(0, 1, 2))(q, k, v)
    assert all(float(mx.abs(a - b).max()) < 1e-4 for a, b in zip(got, expected, strict=True))
    assert float(mx.abs(mx.compile(ours)(q, k, v) - theirs(q, k, v)).max()) < 1e-5
    batched = mx.vmap(ours, in_axes=(0, None, None))(mx.stack([q, q * 2]), k, v)
    assert float(mx.abs(batched[1] - theirs(q * 2, k, v)).max()) < 1e-5
    tangent = mx.jvp(ours, (q, k, v), (mx.ones_like(q), mx.zeros_like(k), mx.zeros_like(v)))[1][0]
    expected_tangent = mx.jvp(theirs, (q, k, v), (mx.ones_like(q), mx.zeros_like(k), mx.zeros_like(v)))[1][0]
    assert float(mx.abs(tangent - expected_tangent).max()) < 1e-4


def test_mlx_attention_runs_where_the_kernel_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    half = mx.random.normal((1, 4, 3, 8)).astype(mx.float16)
    assert kernels.attention(half, half[:, :2], half[:, :2], 0.5) is None
    q, k, v = mx.random.normal((1, 4, 6, 32)), mx.random.normal((1, 2, 6, 32)), mx.random.normal((1, 2, 6, 32))
    fused = attend(q, k, v, None, 0.3, window=4)
    fused_half = attend(q, k, v, KVCache(mx.float16), 0.3)
    monkeypatch.setattr(kernels, "attention", lambda *args: None)
    assert float(mx.abs(attend(q, k, v, None, 0.3, window=4) - fused).max()) < 1e-5
    assert float(mx.abs(attend(q, k, v, KVCache(mx.float16), 0.3) - fused_half).max()) < 1e-5  # float16 keys cast


def test_gemma4_reads_a_quantized_cache_without_dequantizing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its global layers (and the KV-shared ones reading them) attend over the packed keys and values, with
    the logits of MLX's quantized products (the path off the CPU)."""
    from mlxchat.cache import QuantizedKeysValues
    from mlxchat.testing import load_fixture

    from conftest import FIXTURES

    model = load_fixture(FIXTURES / "gemma4")
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 90).tolist()

    def run() -> np.ndarray:
        cache, out, at = model.layer_caches(8, 32)[0](), [], 0
        for size in (40, 7, 1, 1, 41):
            logits = model.module(mx.array(ids[at : at + size])[None], cache)[0]
            mx.eval(logits)
            out.append(np.array(logits))
            at += size
        assert any(isinstance(layer, QuantizedKVCache) and layer.held_quantized for layer in cache)
        return np.concatenate(out)

    dequantizing = model.worker.run(lambda: _with(monkeypatch, kernels, "quantized_attention", run))
    monkeypatch.setattr(QuantizedKeysValues, "dequantized", lambda self: pytest.fail("dequantized the cache"))
    assert float(np.abs(model.worker.run(run) - dequantizing).max()) < 1e-4


def _with(monkeypatch: pytest.MonkeyPatch, module: object, name: str, run):  # noqa: ANN001, ANN202
    """``run()`` with ``module.name`` giving None (the caller's fallback path)."""
    with monkeypatch.context() as patch:
        patch.setattr(module, name, lambda *args: None)
        return run()


@pytest.mark.parametrize("fixture", ["qwen3", "qwen3_rope_yarn", "qwen3_rope_dynamic", "lfm2", "qwen3_5"])
def test_heads_and_a_lone_decode_row_in_one_node_give_the_logits_of_the_ops_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch, fixture: str) -> None:
    """Core's Attention makes a chunk's heads in one node (kernels.heads: norms, RoPE at the cache's offset, yarn's
    scale) and a lone sequence's decode step writes and attends in one node too (kernels.decode_rows): the logits
    of a prompt and decode steps, past a dynamic RoPE's window too, are those of the separate ops."""
    from mlxchat.testing import load_fixture

    from conftest import FIXTURES

    model = load_fixture(FIXTURES / fixture)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 80).tolist()

    def run() -> np.ndarray:
        cache, out, at = model.make_prompt_cache().layers, [], 0
        for size in (70, 1, 1, 1, 5, 1, 1):
            logits = model.module(mx.array(ids[at : at + size])[None], cache)[0]
            mx.eval(logits)
            out.append(np.array(logits))
            at += size
        return np.concatenate(out)

    calls = {"heads": 0, "decode_rows": 0}
    for name in calls:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k:
                            calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **k))
    fused = model.worker.run(run)
    assert calls["heads"] > 0 and calls["decode_rows"] > 0
    monkeypatch.setattr(kernels, "heads", lambda *a: None)
    monkeypatch.setattr(kernels, "decode_rows", lambda *a, **k: None)
    assert float(np.abs(model.worker.run(run) - fused).max()) < 1e-4


def test_attention_with_a_rotation_of_its_own_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin's rotation (a RoPE subclass of its own, Gemma's proportional RoPE) given to core's Attention is the one
    that turns its heads: the one-node heads (core's RoPE only) stand aside; an empty batch of rows finds no
    rotation either."""
    from mlxchat.config import RopeConfig
    from mlxchat.layers import Attention, ProportionalRoPE, RoPE

    class Still(RoPE):  # turns nothing
        def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
            return x

    calls = []
    heads = kernels.heads
    monkeypatch.setattr(kernels, "heads", lambda *a: calls.append(1) or heads(*a))
    x = mx.random.normal((1, 5, 32))
    plain = Attention(32, 4, 2, 8, RoPE(8, RopeConfig(), 64), qk_norm_eps=1e-6)
    turned = plain(x, KVCache())
    mx.eval(turned)
    assert calls == [1]
    for rope in (Still(8, RopeConfig(), 64), ProportionalRoPE(8, RopeConfig(rope_type="proportional",
                                                                            partial_rotary_factor=0.5))):
        layer = Attention(32, 4, 2, 8, rope, qk_norm_eps=1e-6)
        layer.update(plain.parameters())
        out = layer(x, KVCache())
        assert calls == [1] and out.shape == (1, 5, 32)
        if isinstance(rope, Still):  # no positions: not what plain RoPE gives
            assert float(mx.abs(out - turned).max()) > 1e-4
    assert RoPE(8, RopeConfig(), 64).rotation(mx.array([], dtype=mx.int32), 1) is None
    assert RoPE(8, RopeConfig(), 64)(mx.zeros((0, 2, 1, 8)), mx.array([], dtype=mx.int32)).shape == (0, 2, 1, 8)
