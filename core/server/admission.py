"""Memory-aware admission: before a request's turn takes a cache, what that cache may grow to (its prompt
and ``max_tokens`` of reply, per layer kind, at the dtype the model computes in) is reserved against
``--max-kv-gb``. A request that fits waits until the requests before it have given enough back, in
arrival order (a small request never overtakes a large one that came first, so none waits for ever); one
that could never fit is refused with a 503 that says so, instead of the process being killed for memory.

A conversation that starts with a long prefix a cache of the pool already holds (the same system prompt and
tools) will read that prefix's keys and values where they lie (:meth:`~mlxchat.cache.KVCache.copy_from`):
its reservation is what it adds past the prefix, and the prefix is reserved once among the running requests
that read it (:class:`Reservation`), so agents sharing a long prompt are admitted as memory allows. The
prefix is found before the turn runs, outside the model's worker (an estimate: a cache that changes while it
is read counts as sharing nothing). Where the first of them holds it in its own reservation, the prefix is
counted twice, never less than once.

Idle prompt caches kept between requests are not counted here: they have their own bound
(``--max-cache-gb``, :class:`~mlxchat.server.pool.CachePool`), so the caches in memory hold at most the
two bounds together. (A cache a request takes from the pool is then counted by that request's reservation.)

The bytes per token are measured, not derived from a config: one token, then one allocation step of
tokens, run through a fresh cache at start, and each layer's arrays say what a token costs there (full
attention: every token, in the cache's allocation steps; sliding window: up to its window, kept again by
each snapshot; a recurrent or conv state: a fixed size, kept again by each snapshot a hybrid takes).
"""

from __future__ import annotations

import array
import asyncio
import collections
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..cache import KeysValues, KVCache, SlidingWindowCache
from ..generation import GenerationConfig
from ..messages import ChatMessage
from ..model import GenerativeModel
from ..multimodal import carries_image
from ..prefix_cache import PromptCachePool
from ..prompt_cache import DEFAULT_MAX_SNAPSHOTS
from .errors import ApiError

DEFAULT_SHARE = 0.5
"""Of the machine's memory, what the caches of running requests may hold by default."""


@dataclass(frozen=True)
class LayerCost:
    per_token: float
    window: int | None  # tokens kept at most (sliding window)
    step: int  # the allocation granularity in tokens
    fixed: int  # a state that does not grow
    copies: int = 1  # the layer's tokens kept again by snapshots (a sliding window)
    shares: bool = False  # reads a long prompt prefix another cache holds where it lies (a KV layer)


class Footprint:
    """What a prompt cache of one model holds for a number of tokens (measured once, see the module)."""

    def __init__(self, model: GenerativeModel):
        def measure() -> list[LayerCost]:
            layers = model.module.make_cache()
            mx.eval(model.module(mx.array([[0]]), layers))
            before = [layer.nbytes for layer in layers]
            mx.eval(model.module(mx.zeros((1, KVCache.step), mx.int32), layers))  # one allocation step more
            costs = []
            for layer, held in zip(layers, before, strict=True):
                window = layer.window if isinstance(layer, SlidingWindowCache) else None
                plain = type(layer) in (KVCache, SlidingWindowCache)
                if plain and isinstance(layer, KeysValues) and layer.keys is not None and layer.values is not None:
                    per_token = (layer.keys.nbytes + layer.values.nbytes) / layer.keys.shape[2]
                    costs.append(LayerCost(per_token, window, KVCache.step if window is None else 1, 0,
                                           1 if window is None else 1 + DEFAULT_MAX_SNAPSHOTS,
                                           shares=type(layer) is KVCache))
                elif isinstance(layer, KeysValues):  # another format (quantized): what a step of tokens added
                    costs.append(LayerCost((layer.nbytes - held) / KVCache.step, window, 1, held,
                                           1 if window is None else 1 + DEFAULT_MAX_SNAPSHOTS,
                                           shares=isinstance(layer, KVCache)))
                else:  # a state of fixed size, kept again by each snapshot
                    costs.append(LayerCost(0.0, None, 1, layer.nbytes * (1 + DEFAULT_MAX_SNAPSHOTS)))
            return costs

        self.layers = model.worker.run(measure)

    def nbytes(self, tokens: int, shared: int = 0) -> int:
        """What a cache of ``tokens`` holds of its own when its first ``shared`` tokens are a prefix another
        cache holds (read where it lies where it is long enough to be shared: :meth:`prefix_nbytes`)."""
        shared = self.shareable(shared)
        total = 0.0
        for cost in self.layers:
            held = tokens if cost.window is None else min(tokens, cost.window)
            if cost.shares:
                held -= shared
            total += cost.per_token * (-(-held // cost.step) * cost.step) * cost.copies + cost.fixed
        return int(total)

    def prefix_nbytes(self, shared: int) -> int:
        """What a shared prefix of ``shared`` tokens holds (its layers' keys and values, stored once)."""
        return int(sum(cost.per_token for cost in self.layers if cost.shares) * self.shareable(shared))

    @staticmethod
    def shareable(shared: int) -> int:
        """The part of a prefix another cache holds that a copy reads where it lies (a short one is copied)."""
        return shared if shared >= KVCache.share_from else 0


def machine_memory() -> int:
    """Physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_limit() -> int:
    return int(machine_memory() * DEFAULT_SHARE) or 8 * 10**9


@dataclass(frozen=True)
class Reservation:
    """What a turn's cache may grow to (``tokens`` in all): ``own`` bytes for it alone, and the bytes of a
    shared ``prefix`` (a digest of its tokens), reserved once among the running turns that read it."""

    tokens: int
    own: int
    prefix: bytes | None = None
    prefix_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.own + self.prefix_bytes


class KvBudget:
    """The cache bytes the admitted requests may grow to, against a limit (see the module)."""

    def __init__(self, model: GenerativeModel, limit: int, prefixes: PromptCachePool | None = None):
        self.model, self.limit, self.prefixes = model, limit, prefixes
        self.footprint = Footprint(model)
        self.reserved = 0
        self._queue: collections.deque[tuple[Reservation, asyncio.Future[None]]] = collections.deque()
        """The reservations waiting for memory, in arrival order."""
        self._readers: dict[bytes, int] = {}
        """The shared prefixes reserved, with how many running turns read each."""

    @property
    def waiting(self) -> int:
        """Requests admitted to the queue that wait for memory."""
        return len(self._queue)

    async def estimate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       config: GenerationConfig) -> Reservation:
        """What a turn over ``messages`` may hold: its prompt (rendered and tokenized off the event loop;
        images count as their placeholder text) and the reply's ``max_tokens``, less a long prefix of it a
        cache of the pool holds (text-only prompts: token ids alone do not say which image a cache saw)."""
        model = self.model

        def prompt_tokens() -> tuple[list[int], int]:
            """The prompt's ids, and the longest prefix of them a cache of the pool holds."""
            kwargs = dict(config.chat_template_kwargs)
            if config.enable_thinking is not None:
                kwargs["enable_thinking"] = config.enable_thinking
            coerced = [ChatMessage.coerce(m) for m in messages]
            ids = model.render_prompt([m.template_dict() for m in coerced], tools=tools, **kwargs)[1]
            return ids, 0 if any(carries_image(m.content) for m in coerced) else self._held_prefix(ids)

        try:
            ids, held = await asyncio.to_thread(prompt_tokens)
        except Exception:  # noqa: BLE001 - the session refuses this prompt itself, with its own message
            return Reservation(0, 0)
        reply = config.max_tokens if config.max_tokens is not None else model.context_length
        tokens = min(len(ids) + reply, model.context_length)
        shared = self.footprint.shareable(held // KVCache.step * KVCache.step)  # one key for prompts that go
        # on alike a few tokens more or less past a system prompt (the tokens cut off count as their own)
        if not shared:
            return Reservation(tokens, self.footprint.nbytes(tokens))
        digest = hashlib.blake2b(array.array("q", ids[:shared]).tobytes(), digest_size=16).digest()
        return Reservation(tokens, self.footprint.nbytes(tokens, shared), digest, self.footprint.prefix_nbytes(shared))

    def _held_prefix(self, ids: list[int]) -> int:
        """The longest prefix of ``ids`` a cache of the pool holds, read while the worker may be changing them
        (a cache changed in the middle of being read counts as holding nothing)."""
        if self.prefixes is None:
            return 0
        try:
            return self.prefixes.longest(ids)[1]
        except (IndexError, RuntimeError):  # a list shortened, a dict resized, while they were read
            return 0

    async def reserve(self, reservation: Reservation) -> None:
        """Hold a turn's reservation, waiting behind those that came before it until the memory is there;
        503 when it could never fit."""
        nbytes, tokens = reservation.nbytes, reservation.tokens
        if nbytes > self.limit:
            raise ApiError(503, f"this request's cache could grow to {nbytes / 1e9:.2f} GB ({tokens} tokens of "
                                f"prompt and reply), more than the server's limit of {self.limit / 1e9:.2f} GB "
                                "(--max-kv-gb); send a shorter conversation or a lower max_tokens",
                           "server_busy", code="kv_memory_exceeded")
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((reservation, ticket))
        self._grant()
        try:
            await ticket
        except BaseException:  # the request went while it waited (or just as its turn came)
            if ticket.done() and not ticket.cancelled():
                self._give_back(reservation)
            else:
                self._queue.remove((reservation, ticket))
            self._grant()
            raise

    async def release(self, reservation: Reservation) -> None:
        """Give back what a turn held; the reservations waiting are granted in order while they fit."""
        self._give_back(reservation)
        self._grant()

    def _cost(self, reservation: Reservation) -> int:
        """What granting ``reservation`` adds (its prefix only when no running turn reads it yet)."""
        new_prefix = reservation.prefix is not None and reservation.prefix not in self._readers
        return reservation.own + (reservation.prefix_bytes if new_prefix else 0)

    def _take(self, reservation: Reservation) -> None:
        self.reserved += self._cost(reservation)
        if reservation.prefix is not None:
            self._readers[reservation.prefix] = self._readers.get(reservation.prefix, 0) + 1

    def _give_back(self, reservation: Reservation) -> None:
        self.reserved -= reservation.own
        if reservation.prefix is not None:
            self._readers[reservation.prefix] -= 1
            if not self._readers[reservation.prefix]:
                del self._readers[reservation.prefix]
                self.reserved -= reservation.prefix_bytes

    def _grant(self) -> None:
        while self._queue and self.reserved + self._cost(self._queue[0][0]) <= self.limit:
            reservation, ticket = self._queue.popleft()
            self._take(reservation)
            ticket.set_result(None)
