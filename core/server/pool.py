"""The prompt caches a server keeps between requests that each carry a whole conversation."""

from __future__ import annotations

from typing import Any

from ..model import GenerativeModel
from ..prompt_cache import PromptCache


class CachePool:
    """Idle prompt caches, each remembering the conversation it last served, bounded by count and bytes.

    A request takes the cache whose conversation shares the most leading messages with its own (or a fresh
    one), so concurrent requests never share a cache; it gives the cache back when done, and the least
    recently used idle caches are dropped while the pool holds more than ``size`` caches or ``max_bytes``.
    """

    def __init__(self, model: GenerativeModel, size: int = 4, max_bytes: int | None = None):
        self.model = model
        self.size = size
        self.max_bytes = max_bytes
        self._entries: list[tuple[list[dict[str, Any]], PromptCache]] = []  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for _, cache in self._entries)

    def take(self, messages: list[dict[str, Any]]) -> PromptCache:
        best, best_shared = None, 0
        for index, (seen, _) in enumerate(self._entries):
            shared = next((i for i, (a, b) in enumerate(zip(seen, messages, strict=False)) if a != b),
                          min(len(seen), len(messages)))
            if shared > best_shared:
                best, best_shared = index, shared
        if best is None:
            return self.model.make_prompt_cache()
        return self._entries.pop(best)[1]

    def give_back(self, messages: list[dict[str, Any]], cache: PromptCache) -> None:
        self._entries.append((messages, cache))
        while self._entries and (len(self._entries) > self.size
                                 or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            del self._entries[0]
