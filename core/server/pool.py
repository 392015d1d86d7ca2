"""The prompt caches a server keeps between requests: warm sessions, found again by their conversation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import distinct_nbytes
from ..model import GenerativeModel
from ..persistence import load_prompt_cache, save_prompt_cache
from ..prefix_cache import PromptCachePool
from ..prompt_cache import PromptCache

log = logging.getLogger("mlxchat.server")
Messages = list[dict[str, Any]]
Conversation = tuple[bytes, ...]
"""A conversation as the pool remembers it: a digest of each message (not the messages, whose images as
``data:`` URLs would stay in memory for as long as their spilled caches stay on disk)."""


def _conversation(messages: Messages) -> Conversation:
    return tuple(hashlib.blake2b(json.dumps(m, sort_keys=True, default=str).encode(), digest_size=16).digest()
                 for m in messages)


@dataclass(frozen=True)
class IdleCache:
    """An idle prompt cache kept outside the pool under the same byte bound (a chat page conversation's between
    its turns)."""

    used: float
    """When it was last used (``time.monotonic()``)."""
    cache: PromptCache
    release: Callable[[], object]
    """Frees it (it is prefilled again when next used); does nothing when it is in use again by then."""


@dataclass
class _Spilled:
    """An evicted cache on disk: the conversation it holds, its file, and the write (a job on the worker)."""

    messages: Conversation
    path: Path
    written: Future[None]
    nbytes: int


class CachePool:
    """Idle prompt caches, each remembering the conversation it last served, bounded by count and bytes.

    A request takes the cache whose conversation its own continues (or a fresh one), so concurrent requests
    never share a cache; it gives the cache back when done, and the least recently used idle caches are
    evicted while the pool holds more than ``size`` caches or the idle caches hold more than ``max_bytes`` (these
    and the ones ``outside`` gives, least recently used first among both). A request that only branches off
    an idle conversation (the same system prompt, an edited turn) takes that conversation's cache only when
    the pool is full; otherwise it starts fresh and the longest prefix any cache holds, busy or idle, is
    copied into it (:attr:`prefixes`, a :class:`~mlxchat.prefix_cache.PromptCachePool` the server's
    sessions share), so every conversation keeps its own.

    With a ``spill_dir``, an evicted cache is saved there (:mod:`mlxchat.persistence`; the write is a job on
    the model's worker, so the event loop never waits for it) and restored when a request continues its
    conversation; the oldest files go while they hold more than ``max_spill_bytes``.
    """

    def __init__(self, model: GenerativeModel, size: int = 4, max_bytes: int | None = None,
                 spill_dir: Path | None = None, max_spill_bytes: int = 0):
        self.model = model
        self.size = size
        self.max_bytes = max_bytes
        self.spill_dir = spill_dir if max_spill_bytes > 0 else None
        self.max_spill_bytes = max_spill_bytes
        self.prefixes = PromptCachePool()
        """The index of every cache the server's sessions hold, by prompt prefix (give it to each session)."""
        self.outside: Callable[[], list[IdleCache]] = list
        """The other idle caches ``max_bytes`` bounds (the chat page's conversations)."""
        self._entries: list[tuple[Conversation, PromptCache, float]] = []  # least recently used first, with
        # when each was given back
        self._spilled: list[_Spilled] = []  # oldest first
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._remove_files()  # an earlier run's: their conversations are not known here

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def caches(self) -> list[PromptCache]:
        """The idle caches in memory, least recently used first."""
        return [cache for _, cache, _ in self._entries]

    @property
    def nbytes(self) -> int:
        """Bytes the idle caches hold (a prefix they share counted once)."""
        return distinct_nbytes(cache.held() for cache in self.caches)

    @property
    def outside_nbytes(self) -> int:
        """Bytes the idle caches of :attr:`outside` hold."""
        return distinct_nbytes(idle.cache.held() for idle in self.outside())

    @property
    def spilled(self) -> int:
        """Caches on disk."""
        return len(self._spilled)

    async def take(self, messages: Messages) -> PromptCache:
        """The idle cache (in memory or spilled) whose conversation shares the most with ``messages``; a fresh
        one instead of an idle conversation that ``messages`` only branches off while the pool has room."""
        candidates = [seen for seen, _, _ in self._entries] + [s.messages for s in self._spilled]
        asked = _conversation(messages)
        best, best_shared = None, 0
        for index, seen in enumerate(candidates):
            shared = _shared(seen, asked)
            if shared > best_shared:
                best, best_shared = index, shared
        if best is None:
            return self.model.make_prompt_cache()
        if best < len(self._entries):
            if best_shared < len(candidates[best]) and len(self._entries) < self.size:
                return self.model.make_prompt_cache()  # its prefix is copied (prefixes); the other keeps its cache
            return self._entries.pop(best)[1]
        spilled = self._spilled.pop(best - len(self._entries))
        try:
            await asyncio.wrap_future(spilled.written)
            cache, _ = await self.model.worker.arun(load_prompt_cache, self.model, spilled.path)
            return cache
        except Exception as exc:  # noqa: BLE001 - a spill that failed or a file damaged since: start cold
            log.warning("could not restore a spilled cache (%s); starting cold", exc)
            return self.model.make_prompt_cache()
        finally:
            spilled.path.unlink(missing_ok=True)

    def give_back(self, messages: Messages, cache: PromptCache) -> None:
        self._entries.append((_conversation(messages), cache, time.monotonic()))
        self.trim()

    def trim(self) -> None:
        """Evict the least recently used idle caches while the pool holds more than ``size`` or the idle caches
        (the pool's and :attr:`outside`'s) more than ``max_bytes``."""
        while len(self._entries) > self.size:
            self._evict(*self._entries.pop(0)[:2])
        if self.max_bytes is None:
            return
        outside = sorted(self.outside(), key=lambda idle: idle.used)
        while distinct_nbytes([c.held() for c in self.caches] + [i.cache.held() for i in outside]) > self.max_bytes:
            if outside and (not self._entries or outside[0].used < self._entries[0][2]):
                outside.pop(0).release()
            else:
                self._evict(*self._entries.pop(0)[:2])

    def _evict(self, messages: Conversation, cache: PromptCache) -> None:
        self.prefixes.discard(cache)
        if self.spill_dir is None or not len(cache):
            return
        path = self.spill_dir / f"{uuid.uuid4().hex}.cache"
        written = self.model.worker.submit(save_prompt_cache, self.model, cache, path)
        self._spilled.append(_Spilled(messages, path, written, cache.nbytes))
        while self._spilled and sum(s.nbytes for s in self._spilled) > self.max_spill_bytes:
            dropped = self._spilled.pop(0)
            dropped.written.add_done_callback(_remover(dropped.path))

    def close(self) -> None:
        """Wait for the spills in flight and remove the spill files."""
        for spilled in self._spilled:
            spilled.written.exception()
        self._spilled = []
        if self.spill_dir is not None:
            self._remove_files()
            if not any(self.spill_dir.iterdir()):
                self.spill_dir.rmdir()

    def _remove_files(self) -> None:
        """Remove the spill files (only those: the folder may hold what is not ours)."""
        assert self.spill_dir is not None
        for path in self.spill_dir.glob("*.cache"):
            path.unlink(missing_ok=True)


def _remover(path: Path) -> Callable[[Future[None]], None]:
    """Removes ``path`` once its write is done (a callback on the write's future)."""
    return lambda _: path.unlink(missing_ok=True)


def _shared(seen: Conversation, messages: Conversation) -> int:
    """How many leading messages two conversations share."""
    return next((i for i, (a, b) in enumerate(zip(seen, messages, strict=False)) if a != b),
                min(len(seen), len(messages)))
