"""Memory-aware admission: what a request's cache may grow to (its prompt and ``max_tokens`` of reply, per
layer kind, at the dtype the model computes in) is held against ``--max-kv-gb`` as it grows. A request is
admitted holding its prompt and the first ``growth_step`` (512) tokens of reply, and its generation asks for
more as it decodes (:class:`Hold`, the cache's :class:`~mlxchat.prompt_cache.Growth`); while the memory is
not there it sits out the worker's steps, its cache kept, and goes on once others give memory back. So a
client asking for ``max_tokens`` of 32k holds what its reply has reached, not its whole context, and requests
with large limits but short replies run side by side. Every grant, an admission or a growth, keeps the state
*safe* (the banker's algorithm, :meth:`KvBudget.safe`): the running requests can all still reach their
``max_tokens``, one after another as those before them finish, so the paused ones never wait for ever.

A request that fits waits until the requests before it have given enough back, in arrival order (a small
request never overtakes a large one that came first, so none waits for ever); one that could never fit is
refused with a 503 that says so, instead of the process being killed for memory. Where generations cannot
wait for each other (a worker that runs one at a time: a split model, profiling), a request holds its whole
reservation from the start.

A conversation that starts with a long prefix a cache of the pool already holds (the same system prompt and
tools) will read that prefix's keys and values where they lie (:meth:`~mlxchat.cache.KVCache.copy_from`):
its reservation is what it adds past the prefix, and the prefix is reserved once among the running requests
that read it (:class:`Reservation`), so agents sharing a long prompt are admitted as memory allows. The
prefix is found before the turn runs, outside the model's worker (an estimate: a cache that changes while it
is read counts as sharing nothing). Where the first of them holds it in its own reservation, the prefix is
counted twice, never less than once.

The chat page's turns wait in the same queue (:class:`ThreadHold`, taken from their controllers' thread).

Idle prompt caches kept between requests (and the chat page's conversations' between their turns) are not
counted here: they have their own bound (``--max-cache-gb``, :class:`~mlxchat.server.pool.CachePool`), so the
caches in memory hold at most the two bounds together. (A cache a request takes from the pool is then counted by
that request's reservation.)

The bytes per token are measured, not derived from a config: one token, then one allocation step of
tokens, run through a fresh cache (in the KV format the model's caches are made in: ``--kv-bits``) at start,
and each layer's arrays say what a token costs there (full attention: every token, in the cache's allocation
steps, :meth:`~mlxchat.cache.KVCache.capacity`; sliding window: up to its window, kept again by each snapshot;
a recurrent or conv state: a fixed size, kept again by each snapshot a hybrid takes). A request that decodes
speculatively also reserves its drafter's state (a draft model's cache, an MTP head's), measured the same way.
"""

from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import hashlib
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx

from ..cache import KeysValues, KVCache, QuantizedKVCache, SlidingWindowCache
from ..errors import GenerationError
from ..generation import GenerationConfig
from ..messages import ChatMessage
from ..model import GenerativeModel
from ..multimodal import carries_image
from ..prefix_cache import PromptCachePool
from ..prompt_cache import DEFAULT_MAX_SNAPSHOTS, PromptCache
from ..session import ChatSession
from .errors import ApiError

DEFAULT_SHARE = 0.5
"""Of the machine's memory, what the caches of running requests may hold by default."""


@dataclass(frozen=True)
class LayerCost:
    per_token: float
    window: int | None  # tokens kept at most (sliding window)
    grows: bool  # allocated in KVCache.capacity's steps (else token by token)
    fixed: int  # a state that does not grow
    copies: int = 1  # the layer's tokens kept again by snapshots (a sliding window)
    shares: bool = False  # reads a long prompt prefix another cache holds where it lies (a KV layer)


def _layer_costs(layers: list[Any], run: Callable[[int], Any], shares: bool = True) -> list[LayerCost]:
    """What each of ``layers`` holds per token, measured: one token run through them, then one allocation
    step more (``shares``: whether its KV layers can read a long prefix another cache holds)."""
    mx.eval(run(1))
    before = [layer.nbytes for layer in layers]
    mx.eval(run(KVCache.step))
    costs = []
    for layer, held in zip(layers, before, strict=True):
        window = layer.window if isinstance(layer, SlidingWindowCache) else None
        copies = 1 if window is None else 1 + DEFAULT_MAX_SNAPSHOTS
        plain = type(layer) in (KVCache, SlidingWindowCache)
        if plain and isinstance(layer, KeysValues) and layer.keys is not None and layer.values is not None:
            per_token = (layer.keys.nbytes + layer.values.nbytes) / layer.keys.shape[2]
            costs.append(LayerCost(per_token, window, window is None, 0, copies,
                                   shares=shares and type(layer) is KVCache))
        elif isinstance(layer, QuantizedKVCache) and layer.quantized is not None:  # packed tokens, allocated in
            # steps, and a float tail of less than a group (one token of it held after the first run)
            packed = [a for part in layer.quantized for a in part]
            costs.append(LayerCost(sum(a.nbytes for a in packed) / packed[0].shape[2], None, True,
                                   held * layer.group_size, shares=shares))
        else:  # a state of fixed size, kept again by each snapshot
            costs.append(LayerCost(0.0, None, False, layer.nbytes * (1 + DEFAULT_MAX_SNAPSHOTS)))
    return costs


class Footprint:
    """What a prompt cache of one model holds for a number of tokens (measured once, see the module): its
    layers, in the KV format the model's caches are made in, and a drafter's state where one drafts."""

    def __init__(self, model: GenerativeModel):
        make_layers, drafter = model.layer_caches()[0], model.drafter

        def measure() -> tuple[list[LayerCost], list[LayerCost]]:
            layers = make_layers()
            costs = _layer_costs(layers, lambda n: model.module(mx.zeros((1, n), mx.int32), layers))
            return costs, _layer_costs(*drafter.fresh_state(), shares=False) if drafter is not None else []

        self.layers, self.draft_layers = model.worker.run(measure)
        """Per layer of the model's caches, and of its drafter's state (none without a drafter)."""

    def nbytes(self, tokens: int, shared: int = 0, drafted: bool = False) -> int:
        """What a cache of ``tokens`` holds of its own when its first ``shared`` tokens are a prefix another
        cache holds (read where it lies where it is long enough to be shared: :meth:`prefix_nbytes`), with the
        drafter's state over them when ``drafted``."""
        shared = self.shareable(shared)
        total = 0.0
        for cost in self.layers + (self.draft_layers if drafted else []):
            held = tokens if cost.window is None else min(tokens, cost.window)
            if cost.shares:
                held -= shared
            total += cost.per_token * (KVCache.capacity(held) if cost.grows else held) * cost.copies + cost.fixed
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


GROWTH_STEP = 512
"""Tokens of reply a running request's reservation grows by at a time (its prompt and the first of these are
reserved when it is admitted)."""


@dataclass(frozen=True)
class Reservation:
    """What a turn's cache may grow to: ``tokens`` in all (its prompt and ``max_tokens`` of reply), the first
    ``prompt`` of them its prompt, of which the first ``shared`` are a prefix another cache holds, read where
    it lies (``prefix``: a digest of its tokens; its bytes reserved once among the running turns that read it);
    ``drafted``: a drafter's state grows beside it (the turn decodes speculatively)."""

    tokens: int
    prompt: int = 0
    shared: int = 0
    prefix: bytes | None = None
    drafted: bool = False


class Hold:
    """A running turn's part of the budget: the tokens its cache may hold now (:attr:`tokens`), grown
    the budget's ``growth_step`` at a time as it decodes (:meth:`allow`: it is the cache's
    :class:`~mlxchat.prompt_cache.Growth`) towards what its reservation may need."""

    def __init__(self, budget: KvBudget, reservation: Reservation, tokens: int):
        self.budget, self.reservation = budget, reservation
        self.paused = False
        """Whether its last request to grow was refused (its generation waits for memory)."""
        self.tokens = self.own = self.need = 0
        self.resize(tokens)

    def resize(self, tokens: int) -> None:
        """Hold ``tokens``: ``own`` bytes now, ``need`` bytes more at most (the prefix apart)."""
        footprint, shared, drafted = self.budget.footprint, self.reservation.shared, self.reservation.drafted
        self.tokens, self.own = tokens, footprint.nbytes(tokens, shared, drafted)
        self.need = footprint.nbytes(max(tokens, self.reservation.tokens), shared, drafted) - self.own

    def allow(self, tokens: int) -> bool:
        return tokens <= self.tokens or self.budget.grow(self, tokens)

    def wait(self, seconds: float) -> None:
        self.budget.wait(seconds)


class KvBudget:
    """The cache bytes the admitted requests hold and may grow to, against a limit (see the module).

    Admission (on the event loop) and growth (asked by the generations on the model's worker thread) change it
    under one lock. Each grant keeps the state *safe* (:meth:`safe`): the holds can all still reach what they may
    need, one after another as those before them finish, so at least one running request can always grow and the
    ones paused for memory never wait for ever."""

    def __init__(self, model: GenerativeModel, limit: int, prefixes: PromptCachePool | None = None):
        self.model, self.limit, self.prefixes = model, limit, prefixes
        self.footprint = Footprint(model)
        self.reserved = 0
        """Bytes held by the running requests (a shared prefix once)."""
        self.growth_step = GROWTH_STEP
        """Tokens of reply a running request's reservation grows by at a time."""
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Reservation, asyncio.Future[Hold]]] = collections.deque()
        """The reservations waiting for memory, in arrival order."""
        self._holds: set[Hold] = set()
        self._readers: dict[bytes, int] = {}
        """The shared prefixes reserved, with how many running turns read each."""

    @property
    def waiting(self) -> int:
        """Requests admitted to the queue that wait for memory."""
        return len(self._queue)

    @property
    def paused(self) -> int:
        """Running requests whose generation waits for memory to grow."""
        return sum(hold.paused for hold in list(self._holds))

    async def estimate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       config: GenerationConfig, fits: bool = False) -> Reservation:
        """What a turn over ``messages`` may hold (:meth:`reservation`, off the event loop)."""
        return await asyncio.to_thread(self.reservation, messages, tools, config, fits=fits)

    def reservation(self, messages: Sequence[dict[str, Any] | ChatMessage], tools: Sequence[Any] | None,
                    config: GenerationConfig, shares: bool = True, fits: bool = False) -> Reservation:
        """What a turn over ``messages`` may hold: its prompt (images count as their placeholder text) and the
        reply's ``max_tokens``, less a long prefix of it a cache of the pool holds where the turn's cache
        ``shares`` (text-only prompts: token ids alone do not say which image a cache saw). With ``fits``, a
        prompt the context cannot hold is a :class:`~mlxchat.errors.ContextLengthError` (a 400, not a wait for
        memory that would never do)."""
        model = self.model
        kwargs = dict(config.chat_template_kwargs)
        if config.enable_thinking is not None:
            kwargs["enable_thinking"] = config.enable_thinking
        try:
            coerced = [ChatMessage.coerce(m) for m in messages]
            ids = model.render_prompt([m.template_dict() for m in coerced], tools=tools, **kwargs)[1]
        except Exception:  # noqa: BLE001 - the session refuses this prompt itself, with its own message
            return Reservation(0)
        if fits:
            model.fit(len(ids), config)
        held = self._held_prefix(ids) if shares and not any(carries_image(m.content) for m in coerced) else 0
        prompt = min(len(ids), model.context_length)
        tokens = min(len(ids) + config.max_tokens + config.draft_tokens, model.context_length)  # (drafts are
        # checked past the reply's last token)
        shared = self.footprint.shareable(held // KVCache.step * KVCache.step)  # one key for prompts that go
        # on alike a few tokens more or less past a system prompt (the tokens cut off count as their own)
        drafted = bool(config.draft_tokens) and model.drafter is not None
        if not shared:
            return Reservation(tokens, prompt, drafted=drafted)
        digest = hashlib.blake2b(array.array("q", ids[:shared]).tobytes(), digest_size=16).digest()
        return Reservation(tokens, prompt, shared, digest, drafted)

    def _held_prefix(self, ids: list[int]) -> int:
        """The longest prefix of ``ids`` a cache of the pool holds, read while the worker may be changing them
        (a cache changed in the middle of being read counts as holding nothing)."""
        if self.prefixes is None:
            return 0
        try:
            return self.prefixes.longest(ids)[1]
        except (IndexError, RuntimeError):  # a list shortened, a dict resized, while they were read
            return 0

    def nbytes(self, reservation: Reservation) -> int:
        """What a turn's cache may grow to in all, its prefix included."""
        return self.footprint.nbytes(reservation.tokens, reservation.shared, reservation.drafted) + \
            self.footprint.prefix_nbytes(reservation.shared)

    async def reserve(self, reservation: Reservation) -> Hold:
        """Hold a turn's memory (its prompt and the first ``growth_step`` tokens of reply where its
        generations may wait for more, else the whole), waiting behind those that came before it until it is
        there; 503 when it could never fit."""
        nbytes, tokens = self.nbytes(reservation), reservation.tokens
        if nbytes > self.limit:
            raise ApiError(503, f"this request's cache could grow to {nbytes / 1e9:.2f} GB ({tokens} tokens of "
                                f"prompt and reply), more than the server's limit of {self.limit / 1e9:.2f} GB "
                                "(--max-kv-gb); send a shorter conversation or a lower max_tokens",
                           "server_busy", code="kv_memory_exceeded")
        ticket: asyncio.Future[Hold] = asyncio.get_running_loop().create_future()
        self._queue.append((reservation, ticket))
        self._grant()
        try:
            return await ticket
        except BaseException:  # the request went while it waited (or just as its turn came)
            if ticket.done() and not ticket.cancelled():
                self._give_back(ticket.result())
            else:
                self._queue.remove((reservation, ticket))
            self._grant()
            raise

    async def release(self, hold: Hold | None) -> None:
        """Give back what a turn held; the reservations waiting are granted in order while they fit, and the
        generations waiting to grow are woken."""
        if hold is not None:
            self._give_back(hold)
        self._grant()

    def grow(self, hold: Hold, tokens: int) -> bool:
        """Let ``hold`` hold ``tokens`` (and up to ``growth_step`` more, within what it may need) when that
        fits and keeps the state safe; whether it does. Called on the model's worker thread."""
        with self._lock:
            if tokens <= hold.tokens or hold not in self._holds:  # (a hold given back bounds nothing)
                return True
            previous, own = hold.tokens, hold.own
            hold.resize(max(tokens, min(hold.tokens + self.growth_step, hold.reservation.tokens)))
            reserved = self.reserved + hold.own - own
            # Past its reservation (an estimate too low: image tokens, a forced reply prefix) a hold is let grow
            # whatever the limit: its need was counted as nothing, so making it wait would break the safety that
            # lets the others reach their end. Nor does one wait while the worker runs one job at a time (a hold
            # granted then holds its whole reservation, so it only ever asks past it).
            waits = tokens <= hold.reservation.tokens and self.model.worker.runs_side_by_side
            hold.paused = waits and not (reserved <= self.limit and self.safe(reserved, self._holds))
            if hold.paused:
                hold.resize(previous)
                return False
            self.reserved = reserved
            return True

    def wait(self, seconds: float) -> None:
        """Block the worker's thread at most ``seconds``, or until a turn gives memory back or anything else the
        worker waits for happens (a reader taking an item: a stream ahead of its reader must go on)."""
        self.model.worker.idle(seconds)

    def safe(self, reserved: int, holds: Iterable[Hold]) -> bool:
        """Whether, with ``reserved`` bytes held, ``holds`` can all still grow to what they may need, one after
        another as those before them finish and give back what they hold: the banker's algorithm for one
        resource, the smallest need first (a shared prefix counts as held to the end)."""
        free = self.limit - reserved
        for need, own in sorted((hold.need, hold.own) for hold in holds):
            if need > free:
                return False
            free += own
        return True

    def _cost(self, hold: Hold) -> int:
        """What granting ``hold`` adds (its prefix only when no running turn reads it yet)."""
        reservation = hold.reservation
        new_prefix = reservation.prefix is not None and reservation.prefix not in self._readers
        return hold.own + (self.footprint.prefix_nbytes(reservation.shared) if new_prefix else 0)

    def _give_back(self, hold: Hold) -> None:
        with self._lock:
            if hold not in self._holds:
                return
            self._holds.discard(hold)
            self.reserved -= hold.own
            prefix = hold.reservation.prefix
            if prefix is not None:
                self._readers[prefix] -= 1
                if not self._readers[prefix]:
                    del self._readers[prefix]
                    self.reserved -= self.footprint.prefix_nbytes(hold.reservation.shared)
        self.model.worker.wake()  # a generation waiting to grow asks again

    def _grant(self) -> None:
        """Admit the reservations waiting, in order, while each fits and keeps the state safe (on the loop)."""
        grows = self.model.worker.runs_side_by_side  # a generation may wait for memory only beside others
        with self._lock:
            while self._queue:
                reservation, ticket = self._queue[0]
                if ticket.cancelled():  # its request has gone: it takes itself out of the queue (reserve)
                    return
                whole = reservation.tokens
                hold = Hold(self, reservation, min(reservation.prompt + self.growth_step, whole) if grows else whole)
                reserved = self.reserved + self._cost(hold)
                if reserved > self.limit or not self.safe(reserved, [*self._holds, hold]):
                    return
                self._queue.popleft()
                self.reserved = reserved
                self._holds.add(hold)
                if reservation.prefix is not None:
                    self._readers[reservation.prefix] = self._readers.get(reservation.prefix, 0) + 1
                ticket.set_result(hold)


class ThreadHold:
    """A chat page turn's part of the budget (the :class:`~mlxchat.controller.TurnGate` of its controller):
    reserved from the controller's thread through the event loop before the turn runs, in the same queue as the
    API's requests, and held by the conversation's cache as its growth while the turn runs. Its estimate is the
    conversation with the prompt and one reply (a reply after tools' results, automatic on the page, grows past
    it, as any estimate too low does). A turn waiting for the user's answer to a tool keeps its hold (its cache
    holds that memory meanwhile), for ``--input-timeout`` at most."""

    SHOW_WAIT = 0.1
    """Seconds granting may take before the turn shows as waiting."""

    def __init__(self, budget: KvBudget, loop: asyncio.AbstractEventLoop, config: GenerationConfig,
                 running: set[Any] | None = None):
        """``running``: where the turn counts itself while it runs (the server's running turns: metrics)."""
        self.budget, self.loop, self.config, self.running = budget, loop, config, running
        self._lock = threading.Lock()
        self._cancelled = False
        self._ticket: concurrent.futures.Future[Hold | None] | None = None
        self._granted: Hold | None = None
        """The hold once the budget granted it, set on the loop (cancelling the ticket can drop its result); a
        grant that finds the turn stopped is given back there."""
        self.cache: PromptCache | None = None
        """The conversation's cache while the turn runs."""

    def enter(self, session: ChatSession, prompt: Sequence[ChatMessage], waiting: Callable[[], None]) -> bool:
        reservation = self.budget.reservation([*session.messages, *prompt], session.tools, self.config, shares=False)
        with self._lock:
            if self._cancelled:
                return False
            ticket = self._ticket = on_loop(self.loop, self._reserve(reservation))
        if ticket is None:
            raise GenerationError("the server has stopped")
        try:
            try:
                ticket.result(self.SHOW_WAIT)
            except TimeoutError:
                waiting()
                ticket.result()
        except concurrent.futures.CancelledError:
            pass
        except ApiError as exc:  # it could never fit
            raise GenerationError(exc.message) from None
        except BaseException:
            self.cancel()
            self._give_back()
            raise
        with self._lock:
            cancelled, hold = self._cancelled, self._granted
        if cancelled or hold is None:  # stopped before its memory came, or as it came
            self._give_back()
            return False
        self.cache = session.cache
        self.cache.growth = hold
        if self.running is not None:
            self.running.add(self)
        return True

    async def _reserve(self, reservation: Reservation) -> Hold | None:
        """The budget's grant, kept here unless the turn was stopped meanwhile (then given back at once)."""
        hold = await self.budget.reserve(reservation)
        with self._lock:
            if not self._cancelled:
                self._granted = hold
                return hold
        await self.budget.release(hold)
        return None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._ticket is not None:
                self._ticket.cancel()

    def exit(self) -> None:
        assert self.cache is not None
        if self.running is not None:
            self.running.discard(self)
        self.cache.growth = None
        self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            hold, self._granted = self._granted, None
        if hold is not None:
            on_loop(self.loop, self.budget.release(hold))


T = TypeVar("T")


def on_loop(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T] | None:
    """Run ``work`` on the server's loop from any thread; None (``work`` closed) once the server has stopped."""
    try:
        return asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:  # the loop is closed
        work.close()
        return None

