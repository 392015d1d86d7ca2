"""A model's layer caches together with the tokens they hold: the session's memory between turns.

Before each turn :meth:`PromptCache.reuse` compares the new prompt with the cached tokens, cuts the cache
back to the longest common prefix and returns how many tokens need no prefill. Layers that cannot be cut
back (conv and recurrent states, sliding windows) return to a position only through a snapshot taken
there, so the generation loop calls :meth:`checkpoint` at turn boundaries and ``reuse`` restores the
latest snapshot at or before the common prefix. The cache never pretends: the prefix it reports is the
prefix it really holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .cache import LayerCache, cache_arrays

DEFAULT_MAX_SNAPSHOTS = 12


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """Layer caches plus the exact token sequence they have consumed."""

    def __init__(self, make_layers: Callable[[], list[LayerCache]], max_snapshots: int = DEFAULT_MAX_SNAPSHOTS):
        self._make_layers = make_layers
        self.layers: list[LayerCache] = make_layers()
        self.tokens: list[int] = []
        self.max_snapshots = max_snapshots
        self._snapshots: dict[int, list[Any]] = {}
        self.needs_snapshots = any(not layer.trimmable for layer in self.layers)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def snapshot_positions(self) -> list[int]:
        return sorted(self._snapshots)

    def clear(self) -> None:
        """Forget everything (fresh layer caches)."""
        self.layers = self._make_layers()
        self.tokens = []
        self._snapshots = {}

    def feed(self, tokens: Sequence[int]) -> None:
        """Record tokens that were just run through the model with these layer caches."""
        self.tokens.extend(int(t) for t in tokens)

    def checkpoint(self) -> None:
        """Snapshot the non-trimmable layers at the current position (free for trim-only models)."""
        position = len(self.tokens)
        if not self.needs_snapshots or position == 0 or position in self._snapshots:
            return
        self._snapshots[position] = [layer.snapshot() for layer in self.layers]
        while len(self._snapshots) > self.max_snapshots:
            # Drop the oldest (lowest) position: rewinds usually go back a turn or two.
            del self._snapshots[min(self._snapshots)]

    def reuse(self, prompt: Sequence[int]) -> int:
        """Cut the cache back to the longest reusable prefix of ``prompt``; return its length.

        At least one prompt token is always left to prefill, since the next token's logits come from it.
        """
        limit = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        limit = max(limit, 0)
        if all(layer.can_trim_to(limit) for layer in self.layers):
            self._rewind(limit, None)
            return limit
        candidates = [p for p in self._snapshots if p <= limit]
        if not candidates:
            self.clear()
            return 0
        position = max(candidates)
        self._rewind(position, self._snapshots[position])
        return position

    def _rewind(self, position: int, snapshot: list[Any] | None) -> None:
        for i, layer in enumerate(self.layers):
            saved = snapshot[i] if snapshot is not None else None
            if saved is None:
                layer.trim_to(position)
            else:
                layer.restore(saved)
        del self.tokens[position:]
        self._snapshots = {p: s for p, s in self._snapshots.items() if p <= position}

    def arrays(self) -> list[Any]:
        return cache_arrays(self.layers)

    @property
    def nbytes(self) -> int:
        """Memory the layer caches and their snapshots hold (an array shared by several counts once)."""
        seen: dict[int, int] = {}
        stack: list[Any] = [layer.state for layer in self.layers] + list(self._snapshots.values())
        while stack:
            item = stack.pop()
            if isinstance(item, mx.array):
                seen[id(item)] = item.nbytes
            elif isinstance(item, list | tuple):
                stack.extend(item)
        return sum(seen.values())
