"""A model's layer caches together with the tokens they hold: the session's memory between turns.

Before each turn :meth:`PromptCache.reuse` compares the new prompt with the cached tokens, cuts the cache
back to the longest common prefix and returns how many tokens need no prefill. Layers that cannot be cut
back (conv and recurrent states, sliding windows) return to a position only through a snapshot taken
there, so the generation loop calls :meth:`checkpoint` at turn boundaries and ``reuse`` restores the
latest snapshot at or before the common prefix. The cache never pretends: the prefix it reports is the
prefix it really holds.

Images: an image's placeholder tokens are all the same id, so tokens alone cannot tell two images apart.
``feed`` and ``reuse`` take each image's :data:`ImageKey` (where its placeholders start, how many, and the
digest of its pixels); reuse stops at the first placeholder of the first image that is not the same in
both (see :mod:`mlxchat.multimodal`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .cache import LayerCache, cache_arrays

DEFAULT_MAX_SNAPSHOTS = 12

ImageKey = tuple[int, int, str]
"""An image in a prompt: ``(start, length, digest)`` of its placeholder tokens and pixels."""


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
        self.images: list[ImageKey] = []
        """The images among :attr:`tokens`, in order."""
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
        self.images = []
        self._snapshots = {}

    def feed(self, tokens: Sequence[int], images: Sequence[ImageKey] = ()) -> None:
        """Record tokens that were just run through the model with these layer caches, and the images whose
        placeholders start among them."""
        self.tokens.extend(int(t) for t in tokens)
        self.images.extend(images)

    def checkpoint(self) -> None:
        """Snapshot the non-trimmable layers at the current position (free for trim-only models)."""
        position = len(self.tokens)
        if not self.needs_snapshots or position == 0 or position in self._snapshots:
            return
        self._snapshots[position] = [layer.snapshot() for layer in self.layers]
        while len(self._snapshots) > self.max_snapshots:
            # Drop the oldest (lowest) position: rewinds usually go back a turn or two.
            del self._snapshots[min(self._snapshots)]

    def reuse(self, prompt: Sequence[int], images: Sequence[ImageKey] | None = None) -> int:
        """Cut the cache back to the longest reusable prefix of ``prompt``; return its length.

        With ``images`` (the prompt's image keys) the prefix also stops at the first placeholder of any
        image, cached or new, that the other side does not hold identically; without them only tokens are
        compared (the caller vouches for the images). At least one prompt token is always left to
        prefill, since the next token's logits come from it.
        """
        limit = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        if images is not None:
            same = set(self.images) & set(images)
            limit = min([limit, *(start for start, _, _ in {*self.images, *images} - same)])
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
        self.images = [key for key in self.images if key[0] < position]
        self._snapshots = {p: s for p, s in self._snapshots.items() if p <= position}

    def arrays(self) -> list[Any]:
        return cache_arrays(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
