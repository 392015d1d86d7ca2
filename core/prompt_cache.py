"""A model's layer caches together with the tokens they hold: the session's memory between turns.

:meth:`PromptCache.prefill` owns a prompt's way in: it compares the prompt with the cached tokens, cuts the
cache back to the longest common prefix (:meth:`reuse`), runs the rest through the model in chunks, and
takes snapshots at the positions it is given. Layers that cannot be cut back (conv and recurrent states,
sliding windows) return to a position only through a snapshot taken there, and ``reuse`` restores the
latest snapshot at or before the common prefix. The cache never pretends: the prefix it reports is the
prefix it really holds.

Images: an image's placeholder tokens are all the same id, so tokens alone cannot tell two images apart.
``feed`` and ``reuse`` take each image's :data:`ImageKey` (where its placeholders start, how many, and the
digest of its pixels); reuse stops at the first placeholder of the first image that is not the same in
both (see :mod:`mlxchat.multimodal`).
"""

from __future__ import annotations

import collections
import copy
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from . import profiling
from .cache import Arrays, KVCache, LayerCache, cache_arrays, distinct_nbytes
from .errors import ImageError, SavedStateError
from .multimodal import ImageKey, ImageSpan, MultimodalPrompt, chunk_bounds, encode_images

if TYPE_CHECKING:
    from .worker import Cancelled

DEFAULT_MAX_SNAPSHOTS = 12
Follower = Callable[[int, mx.array], list[mx.array]]
"""Reads the target's hidden states during prefill (see :meth:`PromptCache.prefill`)."""


class PrefixSource(Protocol):
    """Where a cache finds prefixes other caches hold (:class:`~mlxchat.prefix_cache.PromptCachePool`)."""

    def seed(self, cache: PromptCache, prompt: Sequence[int] | MultimodalPrompt) -> int: ...

    def longest(self, prompt: Sequence[int] | MultimodalPrompt,
                excluding: PromptCache | None = None) -> tuple[PromptCache | None, int]: ...


class Growth(Protocol):
    """What a cache's owner lets it grow to (a server reserves its requests' cache memory as they decode:
    :mod:`mlxchat.server.admission`). A generation asks before every step that adds tokens; while refused,
    it sits out the worker's steps (:class:`~mlxchat.batching.MemoryWait`)."""

    def allow(self, tokens: int) -> bool:
        """Whether the cache may hold ``tokens`` tokens; asked on the model's worker thread, never blocks."""
        ...

    def wait(self, seconds: float) -> None:
        """Block the worker's thread at most ``seconds`` in a step with nothing else to run, or until memory may
        have been given back or anything else the worker waits for happens (:meth:`~mlxchat.worker.Worker.idle`)."""
        ...


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """Layer caches plus the exact token sequence they have consumed."""

    shares_prefixes = True
    """Whether a :class:`~mlxchat.prefix_cache.PromptCachePool` may copy prefixes into and out of it."""

    def __init__(self, make_layers: Callable[[], list[LayerCache]], max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
                 kv_format: tuple[int, int] | None = None, weights_version: Callable[[], int] | None = None):
        """``kv_format``: ``(bits, group_size)`` when ``make_layers`` quantizes keys and values (what a saved
        cache and a split model's other ranks make theirs with), ``None`` for float. ``weights_version``: the
        model's :attr:`~mlxchat.GenerativeModel.weights_version`; what the cache holds is reused only under the
        weights it was computed with (not after an adapter is loaded, removed or fused)."""
        self._make_layers = make_layers
        self.kv_format = kv_format
        self._weights_version = weights_version
        self._computed_under = weights_version() if weights_version is not None else 0
        self.layers: list[LayerCache] = make_layers()
        self.tokens: list[int] = []
        self.images: list[ImageKey] = []
        """The images among :attr:`tokens`, in order."""
        self.max_snapshots = max_snapshots
        self._snapshots: dict[int, list[Any]] = {}
        self._wanted: set[int] = set()
        self.needs_snapshots = any(not layer.trimmable for layer in self.layers)
        self.prefixes: PrefixSource | None = None
        """The pool this cache shares prefixes through (:class:`~mlxchat.prefix_cache.PromptCachePool`, which
        sets it): a prefill first copies the longest prefix of its prompt any cache there holds, when that is
        more than this one can reuse, and again before its first chunk runs if it waited for other prefills."""
        self.draft: Any = None
        """The speculative drafter's own state over the same conversation (a draft model's prompt cache, an
        MTP head's cache), kept here so that it travels with the session; made and kept in step by
        :mod:`mlxchat.speculative`. Its ``held()`` counts in :attr:`nbytes`."""
        self.growth: Growth | None = None
        """What this cache may grow to, while its owner bounds it (a server's request: :class:`Growth`)."""

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
        self._wanted = set()
        self.draft = None
        self._computed_under = self._weights_version() if self._weights_version is not None else 0

    def reserve(self, tokens: int) -> None:
        """The cache will soon hold ``tokens`` tokens (a prompt and its first step): its layers that grow make
        room for them at their next growth (:meth:`~mlxchat.cache.LayerCache.reserve`)."""
        for layer in self.layers:
            layer.reserve(tokens)

    @property
    def stale(self) -> bool:
        """Whether the model's weights changed since this cache was filled (it then gives no prefix)."""
        return self._weights_version is not None and self._computed_under != self._weights_version()

    def feed(self, tokens: Sequence[int], images: Sequence[ImageKey] = ()) -> None:
        """Record tokens that were just run through the model with these layer caches, and the images whose
        placeholders start among them (snapshotting when that reaches a position :meth:`prefill` was asked
        for, such as the end of the prompt)."""
        self.tokens.extend(int(t) for t in tokens)
        self.images.extend(images)
        if len(self.tokens) in self._wanted:
            self._wanted.discard(len(self.tokens))
            self.snapshot()

    def snapshots_at(self, position: int) -> bool:
        """Whether the prefill under way snapshots at ``position`` (when :meth:`feed` reaches it exactly)."""
        return position in self._wanted

    def snapshot(self) -> None:
        """Snapshot the non-trimmable layers at the current position (free for trim-only models)."""
        position = len(self.tokens)
        if not self.needs_snapshots or position == 0 or position in self._snapshots:
            return
        self._snapshots[position] = [layer.snapshot() for layer in self.layers]
        while len(self._snapshots) > self.max_snapshots:
            # Drop the oldest (lowest) position: rewinds usually go back a turn or two.
            del self._snapshots[min(self._snapshots)]

    def mark(self) -> tuple[int, list[Any] | None]:
        """A point to return to (the current position) that is not kept among the snapshots: a speculative
        round marks where it starts, and :meth:`rewind` comes back here when layers cannot be cut back."""
        return len(self.tokens), [layer.snapshot() for layer in self.layers] if self.needs_snapshots else None

    def rewind(self, position: int, mark: tuple[int, list[Any] | None]) -> int:
        """Cut back to hold the first ``position`` tokens, or where every layer cannot, to ``mark`` (taken
        at or before ``position``); return the position held. The caller feeds the rest again."""
        position = min(position, len(self.tokens))
        if all(layer.can_trim_to(position) for layer in self.layers):
            self._rewind(position, None)
            return position
        at, snapshot = mark
        if at > position or snapshot is None:
            raise ValueError(f"a mark at {at} cannot bring the cache back to {position}")
        self._rewind(at, snapshot)
        return at

    def prefill(self, module: Any, prompt: Sequence[int] | MultimodalPrompt, *,
                snapshot_at: Iterable[int] = (), step: int = 512, cancel: Cancelled | None = None,
                follow: Follower | None = None, ahead: int = 1) -> tuple[int, list[int]]:
        """Make the cache hold ``prompt`` but for its last tokens; return ``(reused, pending)``: how many
        prompt tokens the cache already held, and the tail left for the first decode step (which runs it in
        the same pass over the weights that gives the next token's logits). A set ``cancel`` stops between
        chunks. :meth:`start_prefill` says how the chunks are cut; this runs them all at once.
        """
        plan = self.start_prefill(module, prompt, snapshot_at=snapshot_at, step=step, follow=follow, ahead=ahead)
        while not plan.done and not (cancel is not None and cancel.check()):
            plan.run(plan.next_chunk)
        return plan.reused, plan.pending

    def start_prefill(self, module: Any, prompt: Sequence[int] | MultimodalPrompt, *,
                      snapshot_at: Iterable[int] = (), step: int = 512, follow: Follower | None = None,
                      logits: bool = False, ahead: int = 1) -> Prefill:
        """Cut the cache back to the longest prefix of ``prompt`` it holds and plan the rest as chunks that a
        :class:`Prefill` runs a few at a time (the model's worker runs them between other generations'
        decode steps, a budget of tokens a step).

        The rest is run through ``module`` (a model module; a vision one for images) in chunks of at most
        ``step`` tokens, split at the positions of ``snapshot_at`` it passes, where it takes snapshots; only
        caches that need snapshots get them (each split costs a pass over the weights), and they keep the last
        prompt token for the decode step, so that a regenerate finds a snapshot just before it; a snapshot
        asked for at the prompt's end is taken when the decode step feeds it.

        With ``logits`` the tail the decode step would take (text only, at most ``step`` tokens) is the last
        chunk, run for the next token's logits (:attr:`Prefill.logits`); the cache then holds the whole prompt.

        A prompt with images (a :class:`~mlxchat.multimodal.MultimodalPrompt`) reuses only images held
        identically, runs every image through here (the decode step takes text only), encodes each image
        once, gives each chunk its image inputs, and never splits an image that must stay whole.

        ``follow(start, hidden)``: a drafter that reads the target's last hidden states (an MTP head; the
        module is then a :class:`~mlxchat.layers.CausalLM`) gets every chunk's ``[1, length, hidden]``
        from position ``start`` and returns its own arrays, evaluated with the chunk's.

        The layers make room for the prompt and the ``ahead`` tokens the next step adds at once (:meth:`reserve`),
        rather than growing (each growth a copy) chunk by chunk.
        """
        ids = list(prompt.ids) if isinstance(prompt, MultimodalPrompt) else list(prompt)
        images = prompt.images if isinstance(prompt, MultimodalPrompt) else ()
        keys = [span.key for span in images]
        atomic = [(s.start, s.end) for s in images] if images and module.atomic_images else []
        with profiling.span("cache_reuse"):
            if self.prefixes is not None:
                self.prefixes.seed(self, prompt)
            reused = self.reuse(ids, keys if images else None)
            inside = [s for s, e in atomic if s < reused < e]
            if inside:  # an image attended as a whole is prefilled as a whole
                reused = self.reuse(ids[: inside[0] + 1], keys)
        self.reserve(len(ids) + ahead)  # (after the layers a prefix copy or a reuse may have replaced)
        text_tail = len(ids) - max((s.end for s in images), default=0)
        if text_tail < 1:
            raise ImageError("a prompt must go on after its last image (the next token's logits come from text)")
        keep = min(text_tail, 1 if self.needs_snapshots else min(len(ids) - reused, step))
        self._wanted = {p for p in snapshot_at if reused < p <= len(ids)} if self.needs_snapshots else set()
        features = encode_images(module, [span for span in images if span.end > reused])
        bounds = chunk_bounds(reused, len(ids) - keep, step, self._wanted, atomic)
        if logits:
            bounds.append((len(ids) - keep, len(ids)))
        wanted = sorted(snapshot_at)
        return Prefill(self, module, prompt, reused, bounds, features, follow, logits,
                       lambda: self.start_prefill(module, prompt, snapshot_at=wanted, step=step, follow=follow,
                                                  logits=logits, ahead=ahead))

    def reuse(self, prompt: Sequence[int], images: Sequence[ImageKey] | None = None) -> int:
        """Cut the cache back to the longest reusable prefix of ``prompt`` (:meth:`reusable`); return its length."""
        if self.stale:
            self.clear()
            return 0
        position = self.reusable(prompt, images)
        if all(layer.can_trim_to(position) for layer in self.layers):
            self._rewind(position, None)
        elif position in self._snapshots:
            self._rewind(position, self._snapshots[position])
        else:
            self.clear()
        return position

    def reusable(self, prompt: Sequence[int], images: Sequence[ImageKey] | None = None) -> int:
        """How much of ``prompt`` the cache could return to (it stays as it is): the longest common prefix, or
        where layers cannot be cut back, the latest snapshot at or before it.

        With ``images`` (the prompt's image keys) the prefix also stops at the first placeholder of any
        image, cached or new, that the other side does not hold identically; without them only tokens are
        compared (the caller vouches for the images). At least one prompt token is always left to
        prefill, since the next token's logits come from it. A :attr:`stale` cache gives nothing.
        """
        if self.stale:
            return 0
        limit = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        if images is not None:
            same = set(self.images) & set(images)
            limit = min([limit, *(start for start, _, _ in {*self.images, *images} - same)])
        limit = max(limit, 0)
        if all(layer.can_trim_to(limit) for layer in self.layers):
            return limit
        return max((p for p in self._snapshots if p <= limit), default=0)

    def copy_prefix(self, source: PromptCache, prompt: Sequence[int],
                    images: Sequence[ImageKey] | None = None) -> int:
        """Become a copy of what ``source`` (a cache of the same model) holds of ``prompt``'s longest prefix it
        can return to (:meth:`reusable`; layers that cannot be cut back through its snapshot there); return
        that length. What ``source`` holds stays as it is: a long prefix of its KV layers is read where it lies,
        shared by both (:meth:`~mlxchat.cache.KVCache.copy_from`), its other layers are copied (read from
        ``source``'s state as saving reads it), its snapshots are the same immutable arrays."""
        position = source.reusable(prompt, images)
        trim = all(layer.can_trim_to(position) for layer in source.layers)
        if not position or not (trim or position in source._snapshots):
            return 0
        saved = None if trim else source._snapshots[position]
        self.clear()
        for i, (mine, theirs) in enumerate(zip(self.layers, source.layers, strict=True)):
            if isinstance(mine, KVCache) and mine.can_copy_from(theirs):
                mine.copy_from(theirs, position)  # type: ignore[arg-type]  # a long prefix read where it lies
                continue
            shadow = copy.copy(theirs)
            if saved is not None and saved[i] is not None:
                shadow.restore(saved[i])
            mine.load_state(*shadow.state_dict())
            if mine.offset != position:
                mine.trim_to(position)
        mx.eval(self.arrays())
        self.tokens = source.tokens[:position]
        self.images = [key for key in source.images if key[0] < position]
        self._snapshots = {p: s for p, s in source._snapshots.items() if p <= position}
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

    def held(self) -> list[Any]:
        """Everything the cache keeps alive, as nested lists of arrays: layer states, snapshots, the drafter's."""
        draft = self.draft.held() if self.draft is not None else []
        return [layer.state for layer in self.layers] + list(self._snapshots.values()) + draft

    def state_dict(self) -> tuple[Arrays, dict[str, Any]]:
        """Everything that makes this cache what it is, as named arrays and JSON fields: the tokens and
        images it holds, each layer's state, and each snapshot (saved as the state its layer would hold
        there: a copy of the layer restored to it), so that :meth:`load_state` brings back the same cache."""
        arrays: Arrays = {}
        layers = []
        for i, layer in enumerate(self.layers):
            named, fields = layer.state_dict()
            arrays.update({f"layers.{i}.{name}": a for name, a in named.items()})
            layers.append({"kind": type(layer).__name__, **fields})
        snapshots: dict[str, list[dict[str, Any] | None]] = {}
        for position, saved in sorted(self._snapshots.items()):
            entries: list[dict[str, Any] | None] = []
            for i, (layer, snapshot) in enumerate(zip(self.layers, saved, strict=True)):
                if snapshot is None:
                    entries.append(None)
                    continue
                shadow = copy.copy(layer)
                shadow.restore(snapshot)
                named, fields = shadow.state_dict()
                arrays.update({f"snapshots.{position}.{i}.{name}": a for name, a in named.items()})
                entries.append(fields)
            snapshots[str(position)] = entries
        return arrays, {"tokens": list(self.tokens), "images": [list(key) for key in self.images], "layers": layers,
                        "snapshots": snapshots, "max_snapshots": self.max_snapshots,
                        "kv_format": list(self.kv_format) if self.kv_format else None}

    def load_state(self, arrays: Arrays, fields: dict[str, Any], like: list[Arrays] | None = None) -> None:
        """Become the cache :meth:`state_dict` described (fresh layers of this model take the saved states;
        anything that does not fit them, or the shapes of ``like``: each layer's arrays in this model, is a
        :class:`SavedStateError` and leaves this cache empty). The caller checks the token ids against the
        vocabulary."""
        self.clear()
        try:
            self._load(arrays, fields, like or [{} for _ in self.layers])
        except (SavedStateError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            self.clear()
            if isinstance(exc, SavedStateError):
                raise
            raise SavedStateError(f"the saved prompt cache is malformed ({type(exc).__name__}: {exc})") from None

    def _load(self, arrays: Arrays, fields: dict[str, Any], like: list[Arrays]) -> None:
        tokens, images, layers = fields["tokens"], fields["images"], fields["layers"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise SavedStateError("the saved tokens are not a list of token ids")
        kinds = [type(layer).__name__ for layer in self.layers]
        if [layer.get("kind") for layer in layers] != kinds:
            raise SavedStateError(f"the saved cache's layers ({', '.join(str(x.get('kind')) for x in layers)}) are "
                                  f"not this model's ({', '.join(kinds)})")
        for i, layer in enumerate(self.layers):
            layer.load_state(_under(arrays, f"layers.{i}."), layers[i], like[i])
            if layer.offset != len(tokens):
                raise SavedStateError(f"layer {i} was saved at position {layer.offset}, with {len(tokens)} tokens")
        snapshots: dict[int, list[Any]] = {}
        for key, entries in fields["snapshots"].items():
            position = int(key)
            if not 0 < position <= len(tokens) or len(entries) != len(self.layers):
                raise SavedStateError(f"a snapshot at {key!r} does not fit a cache of {len(tokens)} tokens")
            saved: list[Any] = []
            for i, (layer, entry) in enumerate(zip(self.layers, entries, strict=True)):
                if entry is None:
                    saved.append(None)
                    continue
                shadow = copy.copy(layer)
                shadow.load_state(_under(arrays, f"snapshots.{key}.{i}."), entry, like[i])
                if shadow.offset != position:
                    raise SavedStateError(f"layer {i}'s snapshot at {position} was saved at {shadow.offset}")
                saved.append(shadow.snapshot())
            snapshots[position] = saved
        keys = [(int(start), int(length), str(digest)) for start, length, digest in images]
        if any(not 0 <= start < start + length <= len(tokens) for start, length, _ in keys):
            raise SavedStateError("a saved image lies outside the saved tokens")
        self.tokens, self.images, self._snapshots = list(tokens), keys, snapshots
        self.max_snapshots = max(int(fields["max_snapshots"]), 1)

    @property
    def nbytes(self) -> int:
        """Memory the layer caches, their snapshots and the drafter's state hold (an array shared by several
        counts once; so does a shared prefix other caches read too: :func:`~mlxchat.cache.distinct_nbytes` of
        several caches' :meth:`held` counts it once for all)."""
        return distinct_nbytes(self.held())


class Prefill:
    """A prompt's way into its cache, planned by :meth:`PromptCache.start_prefill`: the chunks left, run a
    few at a time, each evaluated with the cache (so the worker can run other work between them)."""

    def __init__(self, cache: PromptCache, module: Any, prompt: Sequence[int] | MultimodalPrompt, reused: int,
                 bounds: list[tuple[int, int]], features: dict[str, mx.array], follow: Follower | None,
                 logits: bool, again: Callable[[], Prefill]):
        self.cache, self.module, self.prompt, self.reused = cache, module, prompt, reused
        self.chunks = collections.deque(bounds)
        self._features, self._follow, self._wants_logits = features, follow, logits
        self._again: Callable[[], Prefill] | None = again if cache.prefixes is not None else None
        self.logits: mx.array | None = None
        """The next token's logits ``[1, vocab]`` (lazy), once a prefill planned with ``logits`` is done."""

    @property
    def done(self) -> bool:
        return not self.chunks

    @property
    def next_chunk(self) -> int:
        """Tokens in the next chunk (0 when done)."""
        return self.chunks[0][1] - self.chunks[0][0] if self.chunks else 0

    @property
    def left(self) -> int:
        """Prompt tokens still to run."""
        return self.chunks[-1][1] - self.chunks[0][0] if self.chunks else 0

    def starts_like(self, ids: Sequence[int], end: int) -> bool:
        """Whether this prompt starts with another prompt's first ``end`` tokens ``ids``."""
        return len(self.ids) >= end and list(self.ids[:end]) == list(ids[:end])

    @property
    def pending(self) -> list[int]:
        """The prompt's tokens the cache does not hold yet."""
        return list(self.ids[len(self.cache):])

    def run(self, budget: int) -> int:
        """Run the next chunks while they fit in ``budget`` tokens (whole chunks only, so the chunks, and so the
        numbers, are the same however the budget is shared); return the tokens run."""
        self._share(budget)
        ran = 0
        while self.chunks and ran + self.next_chunk <= budget:
            a, b = self.chunks.popleft()
            self._chunk(a, b, final=self._wants_logits and not self.chunks)
            ran += b - a
        return ran

    def take(self, budget: int) -> tuple[int, int]:
        """Take the next whole chunks that fit in ``budget`` and run beside other sequences' tokens (text only,
        no follower: :attr:`mergeable`) as one span ``[a, b)`` of the prompt (empty when none fits), up to where
        the cache snapshots (a hybrid's or a sliding window's state is kept there, when :meth:`took` feeds it):
        the worker's step runs it in its pass (:class:`~mlxchat.cache.RaggedRows`), then :meth:`took` records it."""
        self._share(budget)
        start = end = self.chunks[0][0] if self.chunks else len(self.cache)
        while self.mergeable and end - start + self.next_chunk <= budget and not self.cache.snapshots_at(end):
            end = self.chunks.popleft()[1]
        return start, end

    def took(self, a: int, b: int, logits: mx.array) -> None:
        """Record the span ``[a, b)`` that :meth:`take` gave, run into the cache; ``logits`` (``[1, vocab]``) are
        its last position's, kept when that ends the prompt of a prefill planned with logits."""
        if self.done and self._wants_logits:
            self.logits = logits
        self.cache.feed(self.ids[a:b])

    @property
    def mergeable(self) -> bool:
        """Whether the next chunk can run as part of another pass: text only, and nothing follows its hidden
        states."""
        if not self.chunks or self._follow is not None:
            return False
        a, b = self.chunks[0]
        return not any(s.start < b and s.end > a for s in self._images)

    @property
    def ids(self) -> Sequence[int]:
        """The prompt's token ids."""
        return self.prompt.ids if isinstance(self.prompt, MultimodalPrompt) else self.prompt

    @property
    def _images(self) -> Sequence[ImageSpan]:
        return self.prompt.images if isinstance(self.prompt, MultimodalPrompt) else ()

    def _share(self, budget: int) -> None:
        """Before the first chunk runs (when it fits ``budget``): a cache of the pool may have taken in more of
        the prompt while this one waited (the prefill before it, of the same system prompt): copy that and plan
        again from there."""
        if self._again is None or not self.chunks or self.next_chunk > budget:
            return
        again, self._again = self._again, None
        assert self.cache.prefixes is not None
        _, length = self.cache.prefixes.longest(self.prompt, excluding=self.cache)
        if length > self.reused:
            fresh = again()
            self.reused, self.chunks, self._features = fresh.reused, fresh.chunks, fresh._features

    def _chunk(self, a: int, b: int, final: bool) -> None:
        cache, module, prompt = self.cache, self.module, self.prompt
        ids, images = self.ids, self._images
        reply = profiling.current()
        started = time.perf_counter() if reply else 0.0
        tokens = mx.array(list(ids[a:b]))[None]
        if final:  # the decode step's tail: text only, for the next token's logits (evaluated by the decoder)
            self.logits = last_logits_of(module)(tokens, cache.layers)
        else:
            spans = [s for s in images if s.start < b and s.end > a]
            inputs = module.image_inputs(prompt, a, b, self._features) if spans else {}
            if self._follow is None:
                module(tokens, cache.layers, **inputs)
                mx.eval(cache.arrays())
            else:
                mx.eval(cache.arrays(), self._follow(a, module.model(tokens, cache.layers, **inputs)))
        cache.feed(ids[a:b], images=[s.key for s in images if a <= s.start < b])
        if reply:
            reply.prefill_chunk(a, b, time.perf_counter() - started)


def last_logits_of(module: Any) -> Any:
    """The module's logits at the last position: its own ``last_logits`` when it has one (skipping the
    head's work for the other positions)."""
    return getattr(module, "last_logits", None) or (lambda t, c: module(t, c)[:, -1, :])


def _under(arrays: Arrays, prefix: str) -> Arrays:
    return {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
