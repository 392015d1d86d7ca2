"""Memory-aware admission: before a request's turn takes a cache, what that cache may grow to (its prompt
and ``max_tokens`` of reply, per layer kind, at the dtype the model computes in) is reserved against
``--max-kv-gb``. A request that fits waits until the requests before it have given enough back, in
arrival order (a small request never overtakes a large one that came first, so none waits for ever); one
that could never fit is refused with a 503 that says so, instead of the process being killed for memory.

Idle prompt caches kept between requests are not counted here: they have their own bound
(``--max-cache-gb``, :class:`~mlxchat.server.pool.CachePool`), so the caches in memory hold at most the
two bounds together. (A cache a request takes from the pool is then counted by that request's reservation.)

The bytes per token are measured, not derived from a config: one token, then one allocation step of
tokens, run through a fresh cache at start, and each layer's arrays say what a token costs there (full
attention: every token, in the cache's allocation steps; sliding window: up to its window, kept again by
each snapshot; a recurrent or conv state: a fixed size, kept again by each snapshot a hybrid takes).
"""

from __future__ import annotations

import asyncio
import collections
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..cache import KeysValues, KVCache, SlidingWindowCache
from ..generation import GenerationConfig
from ..messages import ChatMessage
from ..model import GenerativeModel
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
                                           1 if window is None else 1 + DEFAULT_MAX_SNAPSHOTS))
                elif isinstance(layer, KeysValues):  # another format (quantized): what a step of tokens added
                    costs.append(LayerCost((layer.nbytes - held) / KVCache.step, window, 1, held,
                                           1 if window is None else 1 + DEFAULT_MAX_SNAPSHOTS))
                else:  # a state of fixed size, kept again by each snapshot
                    costs.append(LayerCost(0.0, None, 1, layer.nbytes * (1 + DEFAULT_MAX_SNAPSHOTS)))
            return costs

        self.layers = model.worker.run(measure)

    def nbytes(self, tokens: int) -> int:
        total = 0.0
        for cost in self.layers:
            held = tokens if cost.window is None else min(tokens, cost.window)
            total += cost.per_token * (-(-held // cost.step) * cost.step) * cost.copies + cost.fixed
        return int(total)


def machine_memory() -> int:
    """Physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_limit() -> int:
    return int(machine_memory() * DEFAULT_SHARE) or 8 * 10**9


class KvBudget:
    """The cache bytes the admitted requests may grow to, against a limit (see the module)."""

    def __init__(self, model: GenerativeModel, limit: int):
        self.model, self.limit = model, limit
        self.footprint = Footprint(model)
        self.reserved = 0
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        """The reservations waiting for memory, in arrival order."""

    @property
    def waiting(self) -> int:
        """Requests admitted to the queue that wait for memory."""
        return len(self._queue)

    async def estimate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       config: GenerationConfig) -> tuple[int, int]:
        """(tokens, bytes) a turn over ``messages`` may hold: its prompt (rendered and tokenized off the
        event loop; images count as their placeholder text) and the reply's ``max_tokens``."""
        model = self.model

        def prompt_tokens() -> int:
            kwargs = dict(config.chat_template_kwargs)
            if config.enable_thinking is not None:
                kwargs["enable_thinking"] = config.enable_thinking
            rendered = model.generation_prompt([ChatMessage.coerce(m).template_dict() for m in messages],
                                               tools=tools, **kwargs)
            return len(model.tokenizer.encode(rendered))

        try:
            prompt = await asyncio.to_thread(prompt_tokens)
        except Exception:  # noqa: BLE001 - the session refuses this prompt itself, with its own message
            return 0, 0
        reply = config.max_tokens if config.max_tokens is not None else model.context_length
        tokens = min(prompt + reply, model.context_length)
        return tokens, self.footprint.nbytes(tokens)

    async def reserve(self, tokens: int, nbytes: int) -> None:
        """Hold ``nbytes`` for a turn, waiting behind the reservations that came before it until the memory
        is there; 503 when it could never fit."""
        if nbytes > self.limit:
            raise ApiError(503, f"this request's cache could grow to {nbytes / 1e9:.2f} GB ({tokens} tokens of "
                                f"prompt and reply), more than the server's limit of {self.limit / 1e9:.2f} GB "
                                "(--max-kv-gb); send a shorter conversation or a lower max_tokens",
                           "server_busy", code="kv_memory_exceeded")
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((nbytes, ticket))
        self._grant()
        try:
            await ticket
        except BaseException:  # the request went while it waited (or just as its turn came)
            if ticket.done() and not ticket.cancelled():
                self.reserved -= nbytes
            else:
                self._queue.remove((nbytes, ticket))
            self._grant()
            raise

    async def release(self, nbytes: int) -> None:
        """Give back what a turn held; the reservations waiting are granted in order while they fit."""
        if nbytes:
            self.reserved -= nbytes
            self._grant()

    def _grant(self) -> None:
        while self._queue and self.reserved + self._queue[0][0] <= self.limit:
            nbytes, ticket = self._queue.popleft()
            self.reserved += nbytes
            ticket.set_result(None)
