"""Per-layer caches. Every kind answers the same three questions, so one session mechanism serves all:

- ``can_trim_to(position)``: can the cache be cut back to hold only the first ``position`` tokens?
- ``snapshot()``: what must be kept to return to the current position later (``None`` when trimming
  suffices)? Snapshots hold references to immutable MLX arrays, so taking one copies nothing.
- ``restore(snapshot)``: go back to a snapshot's position.

A full-attention KV cache trims to any earlier position. A state that summarises the whole past (a conv
window, a linear-attention matrix) cannot be trimmed and returns to earlier positions only through
snapshots; :class:`mlxchat.prompt_cache.PromptCache` takes those at turn boundaries.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class LayerCache:
    """Base of the layer caches: ``offset`` is the number of tokens the layer has seen."""

    trimmable = True
    offset = 0

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
    def nbytes(self) -> int:
        return 0


class KVCache(LayerCache):
    """Keys and values of a full-attention layer, ``[batch, kv_heads, tokens, head_dim]``.

    The buffer grows in steps so that decode writes in place instead of concatenating every token.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

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

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class StateCache(LayerCache):
    """Fixed-size recurrent state of a layer (conv window, linear-attention matrix, ...).

    ``state`` is a list of arrays the layer reads and replaces through :meth:`update`. It only moves
    forward: returning to an earlier position needs a snapshot.
    """

    trimmable = False

    def __init__(self, size: int) -> None:
        self.state: list[mx.array | None] = [None] * size
        self.offset = 0

    def __getitem__(self, index: int) -> mx.array | None:
        return self.state[index]

    def update(self, *arrays: mx.array, tokens: int) -> None:
        """Replace the state after the layer consumed ``tokens`` more tokens."""
        self.state = list(arrays)
        self.offset += tokens

    def snapshot(self) -> Any:
        return (self.offset, tuple(self.state))

    def restore(self, snapshot: Any) -> None:
        self.offset, state = snapshot
        self.state = list(state)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state if a is not None)


def cache_arrays(layers: list[LayerCache]) -> list[mx.array]:
    """Every array the layer caches hold, to evaluate after a prefill chunk."""
    arrays: list[mx.array] = []
    for layer in layers:
        state = getattr(layer, "state", [])
        arrays.extend(a for a in state if isinstance(a, mx.array))
    return arrays
