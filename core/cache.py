"""Per-layer caches. Every kind answers the same three questions, so one session mechanism serves all:

- ``can_trim_to(position)``: can the cache be cut back to hold only the first ``position`` tokens?
- ``snapshot()``: what must be kept to return to the current position later (``None`` when trimming
  suffices)? Snapshots hold references to immutable MLX arrays, so taking one copies nothing.
- ``restore(snapshot)``: go back to a snapshot's position.

Every kind also says what saving it takes (``state_dict``: named arrays and JSON fields) and takes that
back (``load_state``, checking it, array shapes included against ``like``: the arrays this model's layer
holds, one token run through it lazily), so a prompt cache can go to disk and come back exactly
(:mod:`mlxchat.persistence`).

A full-attention KV cache trims to any earlier position. A state that summarises the whole past (a conv
window, a linear-attention matrix) cannot be trimmed and returns to earlier positions only through
snapshots; :class:`mlxchat.prompt_cache.PromptCache` takes those at turn boundaries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .errors import InvalidInputError, SavedStateError
from .extensions import kernels_extension

Arrays = dict[str, mx.array]


class LayerCache:
    """Base of the layer caches: ``offset`` is the number of tokens the layer has seen."""

    trimmable = True
    offset = 0
    held: tuple[mx.array, ...] = ()
    """Arrays to evaluate with the cache that it does not store: in pipeline parallel, what this rank sent
    to the next one during the last forward (see :mod:`mlxchat.layers.pipeline`)."""

    def advance(self, tokens: int) -> None:
        """Record ``tokens`` that went by without this cache holding them: the cache of a layer another
        rank runs (pipeline parallel) keeps its position, and so its answers to the three questions,
        in step with the real one."""
        self.offset += tokens

    def can_trim_to(self, position: int) -> bool:
        return position <= self.offset if self.trimmable else position == self.offset

    def reserve(self, tokens: int) -> None:
        """The layer will soon hold ``tokens`` tokens: a cache that grows makes room for them all at its next
        growth (one copy instead of one a chunk). A state of fixed size has nothing to do."""

    def trim_to(self, position: int) -> None:
        if not self.can_trim_to(position):
            raise ValueError(f"{type(self).__name__} at {self.offset} cannot be cut back to {position}")
        self.offset = position

    def snapshot(self) -> Any:
        return None

    def restore(self, snapshot: Any) -> None:
        raise NotImplementedError

    @property
    def state(self) -> list[mx.array | None]:
        """The arrays the cache holds (evaluated after each prefill chunk)."""
        return []

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state if a is not None)

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        """The arrays (by name) and the JSON fields that hold this cache's state."""
        return {}, {"offset": self.offset}

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: Arrays | None = None) -> None:
        """Take back what :meth:`state_dict` gave (read from a file: checked, :class:`SavedStateError`);
        ``like``: this model's arrays of the layer, whose shapes and dtypes the saved ones must have (but
        for the token axis of keys and values)."""
        self.offset = _count(fields, "offset")


def _count(fields: dict[str, Any], name: str) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SavedStateError(f"a layer cache's {name} must be a non-negative integer, got {value!r}")
    return value


def _shifts(fields: dict[str, Any], offset: int) -> list[tuple[int, int]]:
    """A KV cache's saved :attr:`KVCache.shifts`, checked."""
    shifts = fields.get("shifts")
    if not isinstance(shifts, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
            and 0 <= s[0] <= offset and abs(s[1]) < 2**31 for s in shifts):
        raise SavedStateError("a KV cache's shifts must be [index, shift] pairs within its tokens (shifts of 32 bits)")
    return [(index, shift) for index, shift in shifts]


def _pair(arrays: Arrays, tokens: int | None, owner: str,
          like: Arrays | None) -> tuple[mx.array | None, mx.array | None]:
    """Saved keys and values: both or neither, ``[batch, heads, tokens, dim]`` of one batch, head count and
    token count (``tokens``, when it is known), and the heads, dims and dtype of ``like``'s."""
    keys, values = arrays.get("keys"), arrays.get("values")
    if keys is None and values is None:
        return None, None
    if keys is None or values is None or keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3] \
            or (tokens is not None and keys.shape[2] != tokens):
        raise SavedStateError(f"{owner}: saved keys and values do not fit each other or the cache's position")
    for name, saved in (("keys", keys), ("values", values)):
        mine = (like or {}).get(name)
        if mine is not None and (_without_tokens(saved) != _without_tokens(mine) or saved.dtype != mine.dtype):
            _misfit(owner, name, saved, mine)
    return keys, values


def _without_tokens(array: mx.array) -> tuple[int, ...]:
    return (*array.shape[:2], *array.shape[3:])


def _misfit(owner: str, name: str, saved: mx.array, mine: mx.array) -> None:
    raise SavedStateError(f"{owner}: saved {name} of shape {list(saved.shape)} ({saved.dtype}) do not fit this "
                          f"model's {list(mine.shape)} ({mine.dtype}): saved by another model or another split of "
                          f"it (a tensor-parallel rank's holds a part of the heads); load it where it was saved")


class KeysValues(LayerCache):
    """A cache of attention keys and values (``None`` until the first chunk)."""

    keys: mx.array | None
    values: mx.array | None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add this chunk's keys and values; return those its queries attend to."""
        raise NotImplementedError

    @property
    def state(self) -> list[mx.array | None]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """The keys and values of a prompt prefix that several KV caches read where they lie
    (:meth:`KVCache.copy_from`): stored once, never written to, kept while a cache reads it."""

    keys: mx.array
    values: mx.array


@dataclass(frozen=True)
class PrefixedKeysValues:
    """What a chunk's queries attend over in a KV cache that reads a shared prefix: the prefix's first ``length``
    keys and values (every query sees them all) and the cache's own after them, which end with the chunk."""

    shared: SharedPrefix
    length: int
    keys: mx.array
    values: mx.array

    def span(self, start: int = 0) -> tuple[mx.array, mx.array]:
        """The shared prefix's keys and values this cache reads, from token ``start`` on (views)."""
        return self.shared.keys[..., start : self.length, :], self.shared.values[..., start : self.length, :]

    def joined(self) -> tuple[mx.array, mx.array]:
        """Every key and value in one array each (a copy: for attention that cannot read the two parts)."""
        keys, values = self.span()
        return mx.concatenate([keys, self.keys], axis=2), mx.concatenate([values, self.values], axis=2)


class KVCache(KeysValues):
    """Keys and values of a full-attention layer, ``[batch, kv_heads, tokens, head_dim]``.

    The buffer grows in steps so that decode writes in place instead of concatenating every token. A cache
    that copied a long prefix from another (:meth:`copy_from`) reads it where it lies, in a
    :class:`SharedPrefix` the two (and every later copy) hold once; its buffer holds only the tokens after it.
    ``dtype``: what keys and values are stored as (``None``: as they come; ``mx.float16``, ``kv_bits=16``,
    halves a float32 model's cache and what each decode step reads of it; a bfloat16 model's it only narrows).
    """

    step = 256
    """The finest allocation granularity in tokens (:meth:`capacity`)."""
    share_from = 256
    """Tokens a copy must take before it reads them where they lie instead of copying them (below this the
    saving is small and every attention call would read two parts)."""

    def __init__(self, dtype: mx.Dtype | None = None) -> None:
        self.dtype = dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.shifts: list[tuple[int, int]] = []
        """``(index, shift)`` pairs: from token ``index`` on, a text token's rotary position is its index plus
        ``shift``. Multimodal RoPE (Qwen-VL) continues text after an image at the image's largest position
        + 1, not at the token index; the shift travels with the keys so that decoding, and a cache cut back
        to any position, continue at the right position."""
        self.shared: SharedPrefix | None = None
        self.base = 0
        """The first ``base`` tokens are :attr:`shared`'s first ``base`` (read in place, none without one); the
        buffer (:attr:`keys`, :attr:`values`) holds the tokens after them."""
        self.room = 0
        """The tokens the next growth makes room for at least (:meth:`reserve`; 0 once it did)."""

    @classmethod
    def capacity(cls, tokens: int) -> int:
        """The tokens a buffer that must hold ``tokens`` is allocated for: whole steps (:attr:`step`), and past 4,096
        tokens whole eighths of the power of two below. A growth copies the whole buffer (and touches fresh
        memory), so a long cache grows every eighth of its length rather than every step (a decode step that grew
        Qwen3-0.6B's float32 cache at 4k tokens took 0.5 s instead of 0.08; per token added, at most 8 are
        copied), leaving at most an eighth unused; the same for any history, so memory estimates
        (:mod:`mlxchat.server.admission`) count exactly what is allocated."""
        grain = max(cls.step, 1 << max(0, tokens.bit_length() - 4))
        return -(-tokens // grain) * grain

    def reserve(self, tokens: int) -> None:
        self.room = tokens

    @property
    def position(self) -> int:
        """Rotary position of the next text token (the offset, unless an image shifted it)."""
        return self.offset + (self.shifts[-1][1] if self.shifts else 0)

    def shift_positions(self, shift: int) -> None:
        """From the current offset on, text positions are the token index plus ``shift``."""
        if shift != (self.shifts[-1][1] if self.shifts else 0):
            self.shifts.append((self.offset, shift))

    def trim_to(self, position: int) -> None:
        super().trim_to(position)
        while self.shifts and self.shifts[-1][0] > position:
            self.shifts.pop()
        if position < self.base:
            self.base = position
            if not position:
                self.shared = None

    @property
    def state(self) -> list[mx.array | None]:
        shared = [] if self.shared is None else [self.shared.keys, self.shared.values]
        return [*shared, *super().state]

    def span(self, start: int, stop: int) -> tuple[mx.array, mx.array]:
        """Keys and values of tokens ``start`` to ``stop`` (views where they lie in one part, else joined)."""
        parts = []
        if self.shared is not None and start < self.base:
            end = min(stop, self.base)
            parts.append((self.shared.keys[..., start:end, :], self.shared.values[..., start:end, :]))
        if stop > self.base:
            assert self.keys is not None and self.values is not None
            first, last = max(start, self.base) - self.base, stop - self.base
            parts.append((self.keys[..., first:last, :], self.values[..., first:last, :]))
        if len(parts) == 1:
            return parts[0]
        return (mx.concatenate([k for k, _ in parts], axis=2), mx.concatenate([v for _, v in parts], axis=2))

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        held = {} if not self.offset else dict(zip(("keys", "values"), self.span(0, self.offset), strict=True))
        return held, {"offset": self.offset, "shifts": [list(s) for s in self.shifts]}

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: Arrays | None = None) -> None:
        offset = _count(fields, "offset")
        self.keys, self.values = _pair(arrays, offset, "a KV cache", like)
        if offset and (self.keys is None or self.values is None):
            raise SavedStateError("a KV cache that holds tokens was saved without its keys and values")
        if self.dtype is not None and self.keys is not None and self.values is not None:
            self.keys, self.values = self.stored(self.keys), self.stored(self.values)
        self.offset = offset
        self.shifts = _shifts(fields, offset)
        self.shared, self.base = None, 0

    def can_copy_from(self, source: LayerCache) -> bool:
        """Whether :meth:`copy_from` takes ``source`` (a cache of this kind and format)."""
        return type(source) is type(self) and str(source.dtype) == str(self.dtype)  # type: ignore[attr-defined]

    def copy_from(self, source: KVCache, length: int) -> None:
        """Become a copy of ``source``'s first ``length`` tokens. A copy of :attr:`share_from` tokens or more reads
        them where they lie: in ``source``'s shared prefix, what it takes beyond that copied, or, where ``source``
        has none or the copy goes further past it than the prefix is long (a new prefix then costs less than
        copying the rest), in one that ``source`` first makes of what it holds (its content unchanged, its
        buffer then holding only the tokens after it)."""
        if not 0 < length <= source.offset:
            raise ValueError(f"a KV cache at {source.offset} has no first {length} tokens to copy")
        if length - source.base >= max(self.share_from, source.base):
            source._share(length)
        self.keys = self.values = None
        self.shared, self.base = source.shared, min(length, source.base)
        self.offset = self.base
        self.shifts = [shift for shift in source.shifts if shift[0] <= length]
        if length > self.base:
            self._append(*source.span(self.base, length))

    def _share(self, length: int) -> None:
        """Move the first ``length`` tokens into a new shared prefix, the rest into a new buffer."""
        shared, rest = self.span(0, length), self.span(length, self.offset) if length < self.offset else None
        self.shared = SharedPrefix(mx.contiguous(shared[0]), mx.contiguous(shared[1]))
        self.keys = self.values = None
        self.base = self.offset = length
        if rest is not None:
            self._append(*rest)
        mx.eval(self.state)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this chunk's keys and values; return everything cached so far (joined after a shared prefix:
        :meth:`update_and_fetch_parts` gives them where they lie)."""
        held = self.update_and_fetch_parts(keys, values)
        return held.joined() if isinstance(held, PrefixedKeysValues) else held

    def update_and_fetch_parts(self, keys: mx.array,
                               values: mx.array) -> tuple[mx.array, mx.array] | PrefixedKeysValues:
        """Append this chunk's keys and values; return everything cached so far as it lies: a shared prefix's
        part and the cache's own, or (without one) the cache's keys and values."""
        own = self._append(keys, values)
        return own if self.shared is None else PrefixedKeysValues(self.shared, self.base, *own)

    def _grown(self, buffers: list[mx.array] | None, like: list[tuple[Sequence[int], mx.Dtype]], start: int,
               length: int) -> list[mx.array]:
        """New buffers (of the shapes and dtypes in ``like`` but for the token axis) of :meth:`capacity` for
        ``start`` tokens, a chunk of ``length`` and what :attr:`room` asks for (once), holding ``buffers``' first
        ``start`` tokens."""
        size = self.capacity(max(start + length, self.room - self.base))
        self.room = 0  # (taken: a later growth is sized by what it holds then)
        grown = [blank((*shape[:2], size, shape[3]), dtype) for shape, dtype in like]
        if buffers is not None and start:
            for new, old in zip(grown, buffers, strict=True):
                new[..., :start, :] = old[..., :start, :]
        return grown

    def stored(self, x: mx.array) -> mx.array:
        """``x`` as :attr:`dtype` (float16 saturating at its largest value rather than becoming infinite; clipped
        in float32, where that value is exact: bfloat16 would round it past float16's range)."""
        if self.dtype is None or x.dtype == self.dtype:
            return x
        top = mx.finfo(self.dtype).max
        return mx.clip(x.astype(mx.float32), -top, top).astype(self.dtype)

    def make_room(self, length: int, like: list[tuple[Sequence[int], mx.Dtype]]) -> int:
        """Grow the buffers (in :meth:`capacity`'s steps) where ``length`` more tokens would not fit, for keys and
        values shaped and typed as ``like`` says (but for the token axis); return where in them the tokens go."""
        start = self.offset - self.base
        if self.keys is None or self.values is None or start + length > self.keys.shape[2]:
            held = None if self.keys is None or self.values is None else [self.keys, self.values]
            self.keys, self.values = self._grown(held, like, start, length)
        return start

    def written(self, keys: mx.array, values: mx.array, length: int) -> None:
        """Take the buffers a kernel wrote ``length`` tokens into, where :meth:`make_room` said
        (:func:`mlxchat.kernels.decode_rows`)."""
        self.keys, self.values = keys, values
        self.offset += length

    def _append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write a chunk after the held tokens into the buffer (grown in :meth:`capacity`'s steps); return the
        buffer's used part."""
        keys, values = self.stored(keys), self.stored(values)
        length = keys.shape[2]
        start = self.make_room(length, [(keys.shape, keys.dtype), (values.shape, values.dtype)])
        assert self.keys is not None and self.values is not None
        self.offset += length
        end = start + length
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]


KV_BITS = (2, 3, 4, 5, 6, 8)
"""Bits a quantized KV cache may store per value (those ``mx.quantize`` takes)."""
KV_HALF = 16
"""``kv_bits`` of a KV cache that stores float16 keys and values (no groups)."""
KV_GROUP_SIZES = (32, 64, 128)

Quantized = tuple[mx.array, mx.array, mx.array]
"""``mx.quantize``'s packed values, scales and biases, ``[batch, heads, tokens, ...]``."""


def check_kv_format(bits: Any, group_size: Any) -> None:
    """A KV format mlxchat can run, float16 or quantized (:class:`InvalidInputError` naming what would)."""
    if isinstance(bits, bool) or bits not in (*KV_BITS, KV_HALF):
        raise InvalidInputError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (quantized), {KV_HALF} "
                                f"(float16) or None (the model's float keys and values), got {bits!r}")
    if bits != KV_HALF and (isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES):
        raise InvalidInputError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                                f"got {group_size!r}")


@dataclass(frozen=True, eq=False)
class SharedPackedPrefix:
    """The packed keys and values of a prompt prefix that several quantized KV caches read where they lie
    (:meth:`QuantizedKVCache.copy_from`): stored once, never written to, kept while a cache reads it."""

    keys: Quantized
    values: Quantized


def _rows(packed: Quantized, start: int, stop: int) -> Quantized:
    """Tokens ``start`` to ``stop`` of packed keys or values (views)."""
    return packed[0][..., start:stop, :], packed[1][..., start:stop, :], packed[2][..., start:stop, :]


class QuantizedKVCache(KVCache):
    """Keys and values of a full-attention layer stored group-wise quantized (affine, ``mx.quantize``'s
    layout: each token's head vector in groups of ``group_size`` features, zero-padded to whole groups,
    ``bits`` a value, a float scale and bias a group), so that a long conversation holds about 0.28x
    (8-bit) or 0.16x (4-bit, groups of 64) of float32's memory.

    The newest tokens stay in full precision (:attr:`tail`) until ``group_size`` of them have gathered;
    they are quantized together after the forward that completed the group, so a chunk's queries always
    read the chunk's own keys unrounded. :func:`mlxchat.layers.attend` reads the packed values where they lie
    (:meth:`update_and_fetch_quantized`; no float copy of the cache); :meth:`update_and_fetch` gives float
    keys and values for layers that attend otherwise (a float copy per call, the stored cache staying
    quantized). It cuts back to any position like a float cache
    (tokens cut from the quantized part are simply dropped; later tokens gather in the tail again). A copy of
    a long prefix of another (:meth:`copy_from`) reads its packed tokens where they lie, in a
    :class:`SharedPackedPrefix`, as a float cache does.
    """

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        super().__init__()
        check_kv_format(bits, group_size)
        if bits == KV_HALF:
            raise InvalidInputError("a quantized KV cache stores 2-8 bits a value (float16 is KVCache(mx.float16))")
        self.bits, self.group_size = bits, group_size
        self.packed_prefix: SharedPackedPrefix | None = None
        """Holds the first :attr:`base` tokens (read in place; none without one)."""
        self.quantized: tuple[Quantized, Quantized] | None = None
        """Buffers of the quantized keys and values after :attr:`base` (grown in steps); tokens up to
        :attr:`held_quantized` are valid."""
        self.held_quantized = 0
        self.tail: tuple[mx.array, mx.array] | None = None
        """Float keys and values of the tokens after the quantized ones."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add this chunk; return every token's keys and values in float (the quantized ones dequantized):
        for layers that attend without :func:`mlxchat.layers.attend`."""
        return self.update_and_fetch_quantized(keys, values).dequantized()

    def update_and_fetch_quantized(self, keys: mx.array, values: mx.array) -> QuantizedKeysValues:
        """Add this chunk; return the quantized keys and values (views of the buffers' used part) and the float
        tail, which ends with this chunk. Full groups of the tail are quantized afterwards."""
        if self.tail is not None:
            keys = mx.concatenate([self.tail[0], keys], axis=2)
            values = mx.concatenate([self.tail[1], values], axis=2)
        shared = self.packed_span(0, self.base) if self.base else None
        prefix = self.packed_span(self.base, self.held_quantized) if self.held_quantized > self.base else None
        self.offset = self.held_quantized + keys.shape[2]
        full = keys.shape[2] // self.group_size * self.group_size
        self.tail = (keys, values)
        if full:
            self._store(keys[..., :full, :], values[..., :full, :])
            self.tail = (keys[..., full:, :], values[..., full:, :]) if full < keys.shape[2] else None
        return QuantizedKeysValues(prefix, keys, values, self.bits, self.group_size, shared)

    def _store(self, keys: mx.array, values: mx.array) -> None:
        """Quantize ``keys``/``values`` into the buffers after the tokens held there (a head size that is not
        a multiple of the group size padded with zeros, which add nothing to a score and are cut from an
        output)."""
        new = [mx.quantize(padded(x, self.group_size), group_size=self.group_size, bits=self.bits)
               for x in (keys, values)]
        self._write((new[0], new[1]))  # type: ignore[arg-type]

    def _write(self, packed: tuple[Quantized, Quantized]) -> None:
        """Put packed keys and values into the buffers after the tokens held there."""
        start, length = self.held_quantized - self.base, packed[0][0].shape[2]
        if self.quantized is None or start + length > self.quantized[0][0].shape[2]:
            held = None if self.quantized is None else [*self.quantized[0], *self.quantized[1]]
            grown = self._grown(held, [(a.shape, a.dtype) for a in (*packed[0], *packed[1])], start,
                                 packed[0][0].shape[2])
            self.quantized = (tuple(grown[:3]), tuple(grown[3:]))  # type: ignore[assignment]
        assert self.quantized is not None
        for buffers, part in zip(self.quantized, packed, strict=True):
            for buffer, array in zip(buffers, part, strict=True):
                buffer[..., start : start + length, :] = array
        self.held_quantized += length

    def can_copy_from(self, source: LayerCache) -> bool:
        return super().can_copy_from(source) and (source.bits, source.group_size) == (  # type: ignore[attr-defined]
            self.bits, self.group_size)

    def packed_span(self, start: int, stop: int) -> tuple[Quantized, Quantized]:
        """Packed keys and values of tokens ``start`` to ``stop`` of the quantized ones (views where they lie in
        one part, else joined)."""
        parts = []
        if self.packed_prefix is not None and start < self.base:
            end = min(stop, self.base)
            parts.append((_rows(self.packed_prefix.keys, start, end), _rows(self.packed_prefix.values, start, end)))
        if stop > self.base:
            assert self.quantized is not None
            first, last = max(start, self.base) - self.base, stop - self.base
            parts.append((_rows(self.quantized[0], first, last), _rows(self.quantized[1], first, last)))
        if len(parts) == 1:
            return parts[0]
        joined = [tuple(mx.concatenate([a, b], axis=2) for a, b in zip(x, y, strict=True))
                  for x, y in zip(parts[0], parts[1], strict=True)]
        return joined[0], joined[1]  # type: ignore[return-value]

    def copy_from(self, source: KVCache, length: int) -> None:
        """Become a copy of ``source``'s (a quantized cache of this format) first ``length`` tokens, as
        :meth:`KVCache.copy_from` does: a long prefix of its packed tokens is read where it lies."""
        if not self.can_copy_from(source):
            raise ValueError(f"a {self.bits}-bit KV cache (groups of {self.group_size}) copies only one of its format")
        assert isinstance(source, QuantizedKVCache)
        if not 0 < length <= source.offset:
            raise ValueError(f"a KV cache at {source.offset} has no first {length} tokens to copy")
        packed = min(length, source.held_quantized)
        if packed - source.base >= max(self.share_from, source.base):
            source._share(packed)
        self.quantized = self.tail = None
        self.base = min(packed, source.base)
        self.packed_prefix = source.packed_prefix if self.base else None
        self.held_quantized = self.offset = self.base
        self.shifts = [shift for shift in source.shifts if shift[0] <= length]
        if packed > self.base:
            self._write(source.packed_span(self.base, packed))
        if length > packed:
            assert source.tail is not None
            kept = length - packed
            self.tail = (source.tail[0][..., :kept, :], source.tail[1][..., :kept, :])
        self.offset = length

    def _share(self, length: int) -> None:
        """Move the first ``length`` packed tokens into a new shared prefix, the rest into new buffers."""
        shared = self.packed_span(0, length)
        rest = self.packed_span(length, self.held_quantized) if length < self.held_quantized else None
        self.packed_prefix = SharedPackedPrefix(*(tuple(mx.contiguous(a) for a in part)  # type: ignore[arg-type]
                                                  for part in shared))
        self.quantized = None
        self.base = self.held_quantized = length
        if rest is not None:
            self._write(rest)
        mx.eval(self.state)

    def trim_to(self, position: int) -> None:
        super().trim_to(position)
        if not self.base:
            self.packed_prefix = None
        if position >= self.held_quantized:
            kept = position - self.held_quantized
            self.tail = None if self.tail is None or not kept else tuple(  # type: ignore[assignment]
                x[..., :kept, :] for x in self.tail)
        else:
            self.held_quantized, self.tail = position, None

    @property
    def state(self) -> list[mx.array | None]:
        parts = [*((self.packed_prefix.keys, self.packed_prefix.values) if self.packed_prefix else ()),
                 *(self.quantized or ())]
        return [*(a for part in parts for a in part), *(self.tail or ())]

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        arrays: Arrays = {}
        if self.held_quantized:
            for name, part in zip(("keys", "values"), self.packed_span(0, self.held_quantized), strict=True):
                arrays.update({f"{name}.{field}": a for field, a in zip(("packed", "scales", "biases"), part,
                                                                         strict=True)})
        if self.tail is not None:
            arrays.update({"keys": self.tail[0], "values": self.tail[1]})
        return arrays, {"offset": self.offset, "shifts": [list(s) for s in self.shifts], "bits": self.bits,
                        "group_size": self.group_size, "quantized": self.held_quantized}

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: Arrays | None = None) -> None:
        if (fields.get("bits"), fields.get("group_size")) != (self.bits, self.group_size):
            raise SavedStateError(f"a {self.bits}-bit KV cache (groups of {self.group_size}) was saved with "
                                  f"bits {fields.get('bits')!r}, group size {fields.get('group_size')!r}")
        held, offset = _count(fields, "quantized"), _count(fields, "offset")
        if held > offset:
            raise SavedStateError(f"a quantized KV cache holds {held} quantized tokens of {offset}")
        tail = _pair(arrays, offset - held, "a quantized KV cache's float tail", like)
        if offset > held and tail[0] is None:
            raise SavedStateError("a quantized KV cache was saved without its float tail")
        names = [f"{n}.{f}" for n in ("keys", "values") for f in ("packed", "scales", "biases")]
        parts = [arrays.get(n) for n in names]
        if held and (any(a is None or a.ndim != 4 or a.shape[2] != held for a in parts)
                     or any(a.shape[:2] != parts[0].shape[:2] for a in parts)  # type: ignore[union-attr]
                     or parts[0].dtype != mx.uint32 or parts[3].dtype != mx.uint32  # type: ignore[union-attr]
                     or any(p.shape[3] * 32 != s.shape[3] * self.group_size * self.bits  # type: ignore[union-attr]
                            for p, s in ((parts[0], parts[1]), (parts[3], parts[4])))):
            raise SavedStateError("a quantized KV cache's saved arrays do not fit each other or its format")
        mine = (like or {}).get("keys")  # this model's float keys: the packed ones have as many rows and heads
        if held and mine is not None and parts[0].shape[:2] != mine.shape[:2]:  # type: ignore[union-attr]
            _misfit("a quantized KV cache", "packed keys", parts[0], mine)  # type: ignore[arg-type]
        floats = [a for a in (parts[1], parts[2], parts[4], parts[5]) if a is not None]  # scales and biases
        dtype = mine.dtype if mine is not None else tail[0].dtype if tail[0] is not None else floats[0].dtype \
            if floats else None
        if held and (parts[1].shape != parts[2].shape or parts[4].shape != parts[5].shape  # type: ignore[union-attr]
                     or any(a.dtype != dtype or not mx.issubdtype(a.dtype, mx.floating) for a in floats)):
            raise SavedStateError("a quantized KV cache's saved scales and biases are not of one shape and of the "
                                  "keys' float type")
        self.offset, self.shifts = offset, _shifts(fields, offset)
        self.tail = None if tail[0] is None else tail  # type: ignore[assignment]
        self.held_quantized = held
        self.packed_prefix, self.base = None, 0
        if not held:
            self.quantized = None
            return
        self.quantized = (tuple(parts[:3]), tuple(parts[3:]))  # type: ignore[assignment]


@dataclass(frozen=True)
class QuantizedKeysValues:
    """What a chunk's queries attend over in a :class:`QuantizedKVCache`: the packed keys and values held
    before it (``None`` while there are none; ``mx.quantize``'s arrays, head size padded to whole groups), after
    the packed ones of a shared prefix it reads (``shared``, where it lies), and the float ones after them (the
    tail, which ends with the chunk)."""

    prefix: tuple[Quantized, Quantized] | None
    keys: mx.array
    values: mx.array
    bits: int
    group_size: int
    shared: tuple[Quantized, Quantized] | None = None

    @property
    def packed(self) -> list[tuple[Quantized, Quantized]]:
        """The packed parts in order: the shared prefix's, then the cache's own."""
        return [part for part in (self.shared, self.prefix) if part is not None]

    @property
    def length(self) -> int:
        """Keys attended over."""
        return sum(part[0][0].shape[2] for part in self.packed) + self.keys.shape[2]

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Every key and value in float: a float copy of the packed ones (for attention that cannot read them)."""
        if not self.packed:
            return self.keys, self.values
        whole = [mx.concatenate([*(mx.dequantize(*part[i], group_size=self.group_size, bits=self.bits)
                                   [..., : x.shape[-1]].astype(x.dtype) for part in self.packed), x], axis=2)
                 for i, x in enumerate((self.keys, self.values))]
        return whole[0], whole[1]


def blank(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A cache buffer of ``shape``, its contents undefined where nothing was written: memory allocated, not
    written, on the CPU with the native kernels (the kernel maps its pages as tokens are written into them; zeros
    would map them all in one step, a second or more for a long prompt's reserved cache, the streams decoding
    beside it stalled meanwhile); zeros elsewhere. Caches read their buffers only up to the tokens they hold."""
    uninitialized = getattr(kernels_extension()[0], "uninitialized", None)  # (None in a build from before it)
    if uninitialized is None or mx.default_device().type != mx.DeviceType.cpu:
        return mx.zeros(shape, dtype)
    return uninitialized(list(shape), dtype)  # type: ignore[no-any-return]


def padded(x: mx.array, group_size: int) -> mx.array:
    """``x`` with its last axis padded with zeros to a multiple of ``group_size``."""
    pad = -x.shape[-1] % group_size
    return x if not pad else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def kv_formatted(make_layers: Callable[[], list[LayerCache]], bits: int, group_size: int
                 ) -> Callable[[], list[LayerCache]]:
    """``make_layers`` with every full-attention :class:`KVCache` it makes replaced by one of this format: a
    float16 one (``bits`` 16) or a :class:`QuantizedKVCache` (sliding windows, recurrent states and subclasses
    stay as they are)."""
    check_kv_format(bits, group_size)

    def one() -> LayerCache:
        return KVCache(mx.float16) if bits == KV_HALF else QuantizedKVCache(bits, group_size)

    def make() -> list[LayerCache]:
        return [one() if type(layer) is KVCache else layer for layer in make_layers()]

    return make


class StateCache(LayerCache):
    """Fixed-size recurrent state of a layer (conv window, linear-attention matrix, ...).

    ``cache[i]`` are the arrays the layer reads; it replaces them through :meth:`update`. It only moves
    forward: returning to an earlier position needs a snapshot.
    """

    trimmable = False

    def __init__(self, size: int) -> None:
        self.arrays: list[mx.array | None] = [None] * size
        self.offset = 0

    def __getitem__(self, index: int) -> mx.array | None:
        return self.arrays[index]

    def update(self, *arrays: mx.array, tokens: int) -> None:
        """Replace the state after the layer consumed ``tokens`` more tokens."""
        self.arrays = list(arrays)
        self.offset += tokens

    def snapshot(self) -> Any:
        return (self.offset, tuple(self.arrays))

    def restore(self, snapshot: Any) -> None:
        self.offset, arrays = snapshot
        self.arrays = list(arrays)

    @property
    def state(self) -> list[mx.array | None]:
        return self.arrays

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        return ({str(i): a for i, a in enumerate(self.arrays) if a is not None},
                {"offset": self.offset, "size": len(self.arrays)})

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: Arrays | None = None) -> None:
        if fields.get("size") != len(self.arrays) or set(arrays) - {str(i) for i in range(len(self.arrays))}:
            raise SavedStateError(f"a state cache of {len(self.arrays)} arrays was saved with "
                                  f"{fields.get('size')!r}")
        for name, saved in arrays.items():
            mine = (like or {}).get(name)
            if mine is not None and (saved.shape != mine.shape or saved.dtype != mine.dtype):
                _misfit("a state cache", f"state {name}", saved, mine)
        self.offset = _count(fields, "offset")
        if self.offset and set(like or {}) - set(arrays):  # read as zeros, it would answer wrongly, not fail
            raise SavedStateError(f"a state cache at position {self.offset} was saved without its state "
                                  f"{sorted(set(like or {}) - set(arrays))}")
        self.arrays = [arrays.get(str(i)) for i in range(len(self.arrays))]


def distinct_nbytes(held: Iterable[Any]) -> int:
    """Bytes of the arrays in ``held`` (nested lists and tuples of them), each counted once however often it
    appears: a shared prefix several caches read, a state a snapshot still holds."""
    seen: dict[int, int] = {}
    stack: list[Any] = list(held)
    while stack:
        item = stack.pop()
        if isinstance(item, mx.array):
            seen[id(item)] = item.nbytes
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sum(seen.values())


def cache_arrays(layers: list[LayerCache]) -> list[mx.array]:
    """Every array the layer caches hold (and what they were handed to evaluate with them), to evaluate after
    a prefill chunk."""
    return [a for layer in layers for a in (*layer.state, *layer.held) if a is not None]


class SlidingWindowCache(KeysValues):
    """Keys and values of a sliding-window attention layer, which attends to the last ``window`` tokens
    only; just those are kept, so memory stays at the window however long the conversation grows.

    Position ``p`` lives in slot ``p % window``. Decoding writes each token over the one that just left the
    window, and a single query needs no mask. A multi-token chunk is attended over the kept tokens, in
    order, followed by the chunk (the window plus one chunk, transiently; see :func:`window_mask`), after
    which the last ``window`` tokens are kept. Updates never write into an existing array (MLX reuses
    the buffer when nothing else holds it), so a snapshot is references and an offset.

    Tokens that left the window are gone: the cache cuts back only as far as the window before the
    new position is still held; further rewinds need a snapshot.
    """

    trimmable = False

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = 0
        """Oldest position still held: the valid positions are ``[start, offset)``."""

    def can_trim_to(self, position: int) -> bool:
        return position <= self.offset and max(0, position - self.window + 1) >= self.start

    def advance(self, tokens: int) -> None:
        # Whatever the write, the oldest position held afterwards is the window before the new position.
        self.offset += tokens
        self.start = max(0, self.offset - self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add this chunk; return the keys and values its queries attend to.

        One token: every held slot (all within its window; slot order, which a single query ignores).
        Several: the window before the chunk and the chunk, in position order.
        """
        if keys.shape[2] == 1 and self.keys is not None and self.values is not None:
            return self._write_one(keys, values)
        return self._write_chunk(keys, values)

    def _write_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        slot = mx.array([self.offset % self.window])
        self.keys = mx.slice_update(self.keys, keys, slot, axes=(2,))
        self.values = mx.slice_update(self.values, values, slot, axes=(2,))
        self.offset += 1
        self.start = max(self.start, self.offset - self.window)
        held = min(self.offset, self.window)
        return self.keys[..., :held, :], self.values[..., :held, :]

    def _write_chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        first = max(0, self.offset - self.window + 1)
        if self.keys is not None and self.values is not None and first < self.offset:
            slots = mx.arange(first, self.offset) % self.window
            keys = mx.concatenate([mx.take(self.keys, slots, axis=2), keys], axis=2)
            values = mx.concatenate([mx.take(self.values, slots, axis=2), values], axis=2)
        self.offset += keys.shape[2] - (self.offset - first)
        kept = min(self.window, keys.shape[2])
        self.start = self.offset - kept
        self.keys = self._slotted(keys[..., -kept:, :])
        self.values = self._slotted(values[..., -kept:, :])
        return keys, values

    def _slotted(self, tail: mx.array) -> mx.array:
        """The last tokens in a ``window``-slot buffer with position ``p`` in slot ``p % window``."""
        if tail.shape[2] < self.window:  # nothing has left the window yet: position p is at index p
            return mx.pad(tail, [(0, 0), (0, 0), (0, self.window - tail.shape[2]), (0, 0)])
        return mx.roll(tail, self.offset % self.window, 2)

    def snapshot(self) -> Any:
        return (self.offset, self.start, self.keys, self.values)

    def restore(self, snapshot: Any) -> None:
        self.offset, self.start, self.keys, self.values = snapshot

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        held = {} if self.keys is None or self.values is None else {"keys": self.keys, "values": self.values}
        return held, {"offset": self.offset, "start": self.start, "window": self.window}

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: Arrays | None = None) -> None:
        offset, start = _count(fields, "offset"), _count(fields, "start")
        if fields.get("window") != self.window or not max(0, offset - self.window) <= start <= offset:
            raise SavedStateError(f"a sliding-window cache of {self.window} tokens was saved with window "
                                  f"{fields.get('window')!r}, start {start} and offset {offset}")
        keys, values = _pair(arrays, self.window if offset else None, "a sliding-window cache", like)
        if offset and keys is None:
            raise SavedStateError("a sliding-window cache that holds tokens was saved without its keys and values")
        self.offset, self.start, self.keys, self.values = offset, start, keys, values


class RowCaches(LayerCache):
    """One layer's caches of several sequences run together, row ``i`` of the batch holding ``caches[i]``
    (batched decoding: each sequence keeps its own cache, with its own length and position).

    A layer reads ``offset``/``position`` as one entry per row. State caches read as their rows stacked and
    are updated row by row, so a layer's own code serves a batch unchanged; keys and values differ in length
    from row to row, each row attending over its own (:func:`mlxchat.layers.attend`: float KV caches' rows in one
    node, :func:`~mlxchat.layers.attention.attend_rows`; others row by row).
    """

    def __init__(self, caches: list[LayerCache]):
        self.caches = list(caches)

    @property
    def offset(self) -> mx.array:  # type: ignore[override]
        return mx.array([c.offset for c in self.caches])

    @property
    def position(self) -> mx.array:
        """Rotary positions of the rows' next tokens (a KV cache's position, shifted after images)."""
        return mx.array([getattr(c, "position", c.offset) for c in self.caches])

    def __getitem__(self, index: int) -> mx.array | None:
        arrays = [c[index] for c in self.caches]  # type: ignore[index]
        if all(a is None for a in arrays):
            return None
        if any(a is None for a in arrays):
            raise ValueError("rows of a batch hold state of different kinds (a row has not been prefilled)")
        return mx.concatenate(arrays, axis=0)  # type: ignore[arg-type]

    def update(self, *arrays: mx.array, tokens: int) -> None:
        for row, cache in enumerate(self.caches):
            cache.update(*(a[row : row + 1] for a in arrays), tokens=tokens)  # type: ignore[attr-defined]


class RaggedRows(LayerCache):
    """One layer's caches of several sequences whose tokens of one step lie end to end along the sequence
    axis of a single batch row: ``lengths[i]`` tokens of sequence ``i`` (one for a decoding sequence, a prompt
    chunk for one being prefilled) go through ``caches[i]``. The worker's step runs decode tokens and prompt
    chunks this way (:mod:`mlxchat.batching`), so every product reads the weights once for all of them.

    A layer that holds a cache takes it apart with :meth:`split` and puts its outputs back with :meth:`join`; a
    module whose layers all do says so with ``runs_ragged`` (see :class:`~mlxchat.architecture.ModelModule`).
    """

    def __init__(self, caches: list[LayerCache], lengths: list[int], rows: int = 0):
        self.caches = list(caches)
        if len(lengths) != len(self.caches) or min(lengths, default=1) < 1:
            raise ValueError(f"{len(self.caches)} rows need a positive length each, got {lengths}")
        if any(n != 1 for n in lengths[:rows]):
            raise ValueError(f"the first {rows} sequences decode a token each, got lengths {lengths}")
        self.lengths = list(lengths)
        self.rows = rows if rows >= 2 else 0
        """The leading sequences that decode a token each (two or more; else 0), which :meth:`split` gives as
        one batch. A one-token prompt chunk is not one of them: its cache may hold no state yet."""

    @property
    def ends(self) -> list[int]:
        """Where each sequence's tokens end along the sequence axis (its last token is at ``end - 1``)."""
        return list(itertools.accumulate(self.lengths))

    def split(self, *arrays: mx.array, axis: int) -> list[tuple[LayerCache, list[mx.array]]]:
        """The parts of this step, each a cache with its slices of ``arrays`` along ``axis`` (the sequence
        axis): the decode rows (:attr:`rows`) as one batch, their tokens moved to the batch axis, with their
        :class:`RowCaches` (a layer's batched decoding serves them), then each other sequence with its cache."""
        lead = (slice(None),) * axis
        parts: list[tuple[LayerCache, list[mx.array]]] = []
        if self.rows:
            parts.append((RowCaches(self.caches[: self.rows]),
                          [mx.swapaxes(a[(*lead, slice(0, self.rows))], 0, axis) for a in arrays]))
        for cache, start, length in zip(self.caches[self.rows :], self.ends[self.rows :], self.lengths[self.rows :],
                                        strict=True):
            parts.append((cache, [a[(*lead, slice(start - length, start))] for a in arrays]))
        return parts

    def join(self, outputs: list[mx.array], axis: int) -> mx.array:
        """The parts' outputs (in :meth:`split`'s order) back end to end along ``axis``."""
        if self.rows:
            outputs = [mx.swapaxes(outputs[0], 0, axis), *outputs[1:]]
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=axis)


def each_sequence(run: Callable[..., mx.array], cache: Any, *arrays: mx.array, axis: int) -> mx.array:
    """``run(*arrays, cache)``, the part of a layer that reads and updates its cache; over :class:`RaggedRows`,
    once for each part of the step (:meth:`RaggedRows.split` along ``axis``, the sequence axis), the outputs put
    back end to end."""
    if isinstance(cache, RaggedRows):
        return cache.join([run(*part, rows) for rows, part in cache.split(*arrays, axis=axis)], axis=axis)
    return run(*arrays, cache)
