"""Per-layer caches. Every kind answers the same three questions, so one session mechanism serves all:

- ``can_trim_to(position)``: can the cache be cut back to hold only the first ``position`` tokens?
- ``snapshot()``: what must be kept to return to the current position later (``None`` when trimming
  suffices)? Snapshots hold references to immutable MLX arrays, so taking one copies nothing.
- ``restore(snapshot)``: go back to a snapshot's position.

Every kind also says what saving it takes (``state_dict``: named arrays and JSON fields) and takes that
back (``load_state``, checking it), so a prompt cache can go to disk and come back exactly
(:mod:`mlxchat.persistence`).

A full-attention KV cache trims to any earlier position. A state that summarises the whole past (a conv
window, a linear-attention matrix) cannot be trimmed and returns to earlier positions only through
snapshots; :class:`mlxchat.prompt_cache.PromptCache` takes those at turn boundaries.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .errors import SavedStateError

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

    def load_state(self, arrays: Arrays, fields: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (read from a file: checked, :class:`SavedStateError`)."""
        self.offset = _count(fields, "offset")


def _count(fields: dict[str, Any], name: str) -> int:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SavedStateError(f"a layer cache's {name} must be a non-negative integer, got {value!r}")
    return value


def _pair(arrays: Arrays, tokens: int | None, owner: str) -> tuple[mx.array | None, mx.array | None]:
    """Saved keys and values: both or neither, ``[batch, heads, tokens, dim]`` of one batch, head count and
    token count (``tokens``, when it is known)."""
    keys, values = arrays.get("keys"), arrays.get("values")
    if keys is None and values is None:
        return None, None
    if keys is None or values is None or keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3] \
            or (tokens is not None and keys.shape[2] != tokens):
        raise SavedStateError(f"{owner}: saved keys and values do not fit each other or the cache's position")
    return keys, values


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


class KVCache(KeysValues):
    """Keys and values of a full-attention layer, ``[batch, kv_heads, tokens, head_dim]``.

    The buffer grows in steps so that decode writes in place instead of concatenating every token.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.shifts: list[tuple[int, int]] = []
        """``(index, shift)`` pairs: from token ``index`` on, a text token's rotary position is its index plus
        ``shift``. Multimodal RoPE (Qwen-VL) continues text after an image at the image's largest position
        + 1, not at the token index; the shift travels with the keys so that decoding, and a cache cut back
        to any position, continue at the right position."""

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

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        held = {} if self.keys is None or self.values is None or not self.offset else {
            "keys": self.keys[..., : self.offset, :], "values": self.values[..., : self.offset, :]}
        return held, {"offset": self.offset, "shifts": [list(s) for s in self.shifts]}

    def load_state(self, arrays: Arrays, fields: dict[str, Any]) -> None:
        offset = _count(fields, "offset")
        shifts = fields.get("shifts")
        if not isinstance(shifts, list) or not all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
                and 0 <= s[0] <= offset for s in shifts):
            raise SavedStateError("a KV cache's shifts must be [index, shift] pairs within its tokens")
        self.keys, self.values = _pair(arrays, offset, "a KV cache")
        if offset and self.keys is None:
            raise SavedStateError("a KV cache that holds tokens was saved without its keys and values")
        self.offset = offset
        self.shifts = [(index, shift) for index, shift in shifts]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this chunk's keys and values; return everything cached so far."""
        start, length = self.offset, keys.shape[2]
        if self.keys is None or self.values is None or start + length > self.keys.shape[2]:
            grow = -(-length // self.step) * self.step
            batch, heads, _, k_dim = keys.shape
            new_keys = mx.zeros((batch, heads, grow, k_dim), keys.dtype)
            new_values = mx.zeros((batch, heads, grow, values.shape[3]), values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_keys, new_values
            else:
                self.keys = mx.concatenate([self.keys[..., :start, :], new_keys], axis=2)
                self.values = mx.concatenate([self.values[..., :start, :], new_values], axis=2)
        self.offset = start + length
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


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

    def load_state(self, arrays: Arrays, fields: dict[str, Any]) -> None:
        if fields.get("size") != len(self.arrays) or set(arrays) - {str(i) for i in range(len(self.arrays))}:
            raise SavedStateError(f"a state cache of {len(self.arrays)} arrays was saved with "
                                  f"{fields.get('size')!r}")
        self.offset = _count(fields, "offset")
        self.arrays = [arrays.get(str(i)) for i in range(len(self.arrays))]


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

    def load_state(self, arrays: Arrays, fields: dict[str, Any]) -> None:
        offset, start = _count(fields, "offset"), _count(fields, "start")
        if fields.get("window") != self.window or not max(0, offset - self.window) <= start <= offset:
            raise SavedStateError(f"a sliding-window cache of {self.window} tokens was saved with window "
                                  f"{fields.get('window')!r}, start {start} and offset {offset}")
        keys, values = _pair(arrays, self.window if offset else None, "a sliding-window cache")
        if offset and keys is None:
            raise SavedStateError("a sliding-window cache that holds tokens was saved without its keys and values")
        self.offset, self.start, self.keys, self.values = offset, start, keys, values


class RowCaches(LayerCache):
    """One layer's caches of several sequences run together, row ``i`` of the batch holding ``caches[i]``
    (batched decoding: each sequence keeps its own cache, with its own length and position).

    A layer reads ``offset``/``position`` as one entry per row. State caches read as their rows stacked and
    are updated row by row, so a layer's own code serves a batch unchanged; keys and values differ in length
    from row to row and are attended row by row (:func:`mlxchat.layers.attend`).
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
