"""Shared prefixes: the prompt caches of a model's conversations, found by the longest prompt prefix they
hold, so that a conversation starting like another (the same system prompt and tools, the same long
instructions) copies that prefix instead of prefilling it again (as mlx-lm's LRU prompt cache and SGLang's
radix cache do).

The pool holds no cache of its own: it knows the caches of the sessions that share it (weakly: a cache goes
when its owner drops it) and, when a cache is about to prefill, copies into it the longest prefix any of
them holds, when that is more than the cache can reuse itself; a prefill that waited for others' (the
worker feeds a prompt whose next chunk an earlier one computes right behind that one,
:meth:`~mlxchat.batching.PrefillChunk.in_turn`) looks again before its first chunk, so conversations that
arrive together with the same long prefix prefill it once. A copy never changes what the cache it reads
holds (:meth:`~mlxchat.prompt_cache.PromptCache.copy_prefix`): another live conversation keeps its cache
whole, and a long prefix of their KV layers is held once, read by both where it lies
(:meth:`~mlxchat.cache.KVCache.copy_from`). Layers that cannot be cut back are copied through the snapshot
their cache took at or before the shared prefix (a session snapshots after its system prompt).

Every lookup and copy runs on the model's worker, between steps, where the caches are consistent.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from .multimodal import ImageKey, MultimodalPrompt
from .prompt_cache import PromptCache


class PromptCachePool:
    """The prompt caches of one model that share their prefixes (see the module docstring); give it to the
    sessions over the model (``ChatSession(..., prefix_cache=pool)``, or ``model.prefix_cache = pool`` for
    every session :meth:`~mlxchat.GenerativeModel.chat_session` makes)."""

    def __init__(self) -> None:
        self._caches: weakref.WeakSet[PromptCache] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.copied_tokens = 0
        """Prompt tokens copied from other caches so far (not prefilled again)."""

    def __len__(self) -> int:
        return len(self._caches)

    def add(self, cache: PromptCache) -> None:
        """Share ``cache``'s prefixes with the others (its owner keeps it); its prefills look here first
        (:attr:`~mlxchat.prompt_cache.PromptCache.prefixes`). A cache that shares none (a split model's, whose
        ranks keep their copies in step) stays out."""
        if not cache.shares_prefixes:
            return
        with self._lock:
            self._caches.add(cache)
        cache.prefixes = self

    def discard(self, cache: PromptCache) -> None:
        with self._lock:
            self._caches.discard(cache)
        if cache.prefixes is self:
            cache.prefixes = None

    def longest(self, prompt: Sequence[int] | MultimodalPrompt,
                excluding: PromptCache | None = None) -> tuple[PromptCache | None, int]:
        """The cache that can give the most of ``prompt`` (and how much), ``excluding`` one (the asker's: only
        caches of its KV format count, float or quantized alike)."""
        ids, keys = _parts(prompt)
        with self._lock:
            caches = [cache for cache in self._caches if cache is not excluding
                      and (excluding is None or cache.kv_format == excluding.kv_format)]
        best, length = None, 0
        for cache in caches:
            reach = cache.reusable(ids, keys)
            if reach > length:
                best, length = cache, reach
        return best, length

    def seed(self, cache: PromptCache, prompt: Sequence[int] | MultimodalPrompt) -> int:
        """Before ``cache`` prefills ``prompt``: when another cache in the pool holds more of it than ``cache``
        can reuse itself, make ``cache`` a copy of that prefix; return the prefix it can then reuse."""
        ids, keys = _parts(prompt)
        own = cache.reusable(ids, keys)
        best, length = self.longest(prompt, excluding=cache)
        if best is None or length <= own:
            return own
        copied = cache.copy_prefix(best, ids, keys)
        self.copied_tokens += copied
        return copied


def _parts(prompt: Sequence[int] | MultimodalPrompt) -> tuple[list[int], list[ImageKey] | None]:
    if isinstance(prompt, MultimodalPrompt):
        return list(prompt.ids), [span.key for span in prompt.images]
    return list(prompt), None
