"""Speculative decoding: a cheap drafter proposes ``k`` tokens, the target checks them all in one forward,
and the longest prefix it agrees with is kept together with one token of its own.

A round, given the committed tokens ``S`` (the target's cache holds all of them but the last few)::

    drafts, q = drafter.propose(S, k)                 # k draft tokens and the distributions they came from
    logits = target(S[held:] + drafts)                # one pass over the weights for k + 1 positions
    j, y = accept(logits, drafts, q)                  # j drafts kept, y drawn by the target
    S += drafts[:j] + [y]

``accept`` is exact: greedy keeps a draft while it is the target's argmax; sampling keeps draft ``d`` with
probability ``min(1, p(d) / q(d))`` and on the first rejection draws from ``max(0, p - q)`` normalised
(Leviathan et al., 2023), so every token has the target's sampling distribution (temperature, top-k/p,
min-p, penalties and biases applied position by position). The whole round is one lazy graph, evaluated
once.

Rolling back: the target fed ``k`` drafts and keeps ``j``. A KV cache is cut back (trimmed). A state that
cannot be cut back (DeltaNet, conv, a sliding window past its slack) returns to the mark taken where the
round started (:meth:`~mlxchat.prompt_cache.PromptCache.mark`), and the kept tokens are fed again in front
of the next round's drafts: the replay shares that round's pass over the weights.

Drafters: :class:`ModelDrafter`, a smaller model of the same vocabulary with its own prompt cache, and
:class:`MtpDrafter`, a multi-token-prediction head that reads the target's hidden states (Qwen3.5). Each
keeps its state in the target's :attr:`PromptCache.draft <mlxchat.prompt_cache.PromptCache.draft>`, so a
session's drafter reuses its prefix across turns as the target does.

Batching (one forward over several sequences) would wrap :func:`speculative_tokens`' three calls: drafts
of every row proposed together, one verify forward over ``[rows, k + 1]``, and acceptance row by row; the
caches already roll back per sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from . import profiling
from .batching import last_logits_of
from .prompt_cache import Follower, PromptCache, common_prefix_length
from .sampling import LogitsAdjuster, RandomKeys, make_filter


class Acceptance:
    """Draws draft tokens and decides which the target keeps, for one sampling setting."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 seed: int | None = None):
        self.greedy = temperature <= 0
        self.filter = None if self.greedy else make_filter(temperature, top_p, top_k, min_p)
        self.keys = RandomKeys(seed)

    def draft(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """A draft token ``[1]`` from logits ``[1, vocab]``, and (sampling) the distribution it came from."""
        if self.filter is None:
            return mx.argmax(logits, axis=-1), None
        filtered = self.filter(logits)
        return mx.random.categorical(filtered, key=self.keys.next()), mx.softmax(filtered, axis=-1)

    def verify(self, logits: mx.array, drafts: mx.array, q: mx.array | None) -> tuple[mx.array, mx.array]:
        """``(kept, token)``: how many of the ``k`` drafts the target keeps and the token it adds, from its
        logits ``[k + 1, vocab]`` after the token before the drafts and after each draft."""
        count = drafts.shape[0]
        if self.filter is None:
            choice = mx.argmax(logits, axis=-1)
            kept = mx.cumprod(choice[:count] == drafts).sum() if count else mx.array(0)
            return kept, choice[kept]
        assert q is not None or count == 0
        p = mx.softmax(self.filter(logits), axis=-1)
        if count == 0:
            return mx.array(0), mx.random.categorical(mx.log(p), key=self.keys.next())
        assert q is not None
        p_draft = mx.take_along_axis(p[:count], drafts[:, None], axis=-1)[:, 0]
        q_draft = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
        keep = mx.random.uniform(shape=(count,), key=self.keys.next()) * q_draft < p_draft
        kept = mx.cumprod(keep).sum()
        # Row i < k: the residual max(0, p - q) a rejection at i draws from; row k: p after the last draft.
        rows = mx.concatenate([mx.maximum(p[:count] - q, 0.0), p[count:]], axis=0)
        drawn = mx.random.categorical(mx.log(rows), key=self.keys.next())
        return kept, drawn[kept]


@dataclass
class Verified:
    """A decided round: the drafts (host ids), how many the target kept, the position of the first token
    the verify pass fed and, when the drafter reads them, the target's hidden states of what it fed."""

    drafts: list[int]
    kept: int
    start: int
    hidden: mx.array | None = None


class Drafter(Protocol):
    """Proposes tokens after a conversation; its state lives in the target cache's ``draft`` slot."""

    reads_hidden: bool
    """Whether it needs the target's hidden states (verify passes then return them)."""

    def begin(self, cache: PromptCache, ids: Sequence[int]) -> Follower | None:
        """A generation from ``ids`` starts: keep what still holds; what reads the prefill's hidden states."""
        ...

    def propose(self, cache: PromptCache, sequence: Sequence[int], count: int,
                acceptance: Acceptance) -> tuple[mx.array, mx.array | None]:
        """``count`` draft tokens after ``sequence`` (lazy ``[count]``) and, when sampling, their
        distributions ``[count, vocab]``."""
        ...

    def commit(self, cache: PromptCache, sequence: Sequence[int], verified: Verified) -> None:
        """The round is decided: ``sequence`` now ends with the kept drafts and the target's token."""
        ...

    def fresh_state(self) -> tuple[list[Any], Callable[[int], Any]]:
        """The layer caches of the state it keeps beside a conversation, fresh, and what runs ``n`` tokens
        through them (what a server's memory-aware admission measures a token of that state with)."""
        ...


def target_pass(module: Any, tokens: mx.array, layers: list[Any], count: int,
                hidden: bool) -> tuple[mx.array | None, mx.array]:
    """The target over ``tokens [1, L]``: its last hidden states (when asked, from a
    :class:`~mlxchat.layers.CausalLM`) and the logits ``[count, vocab]`` of the last ``count`` positions, the
    output projection run for those rows only."""
    if hidden or hasattr(module, "project"):
        states = module.model(tokens, layers)
        return (states if hidden else None), module.project(states[:, -count:])[0]
    return None, module(tokens, layers)[0, -count:]


def speculative_tokens(
    module: Any,
    cache: PromptCache,
    pending: Sequence[int],
    drafter: Drafter,
    acceptance: Acceptance,
    draft_tokens: int,
    max_tokens: int,
    *,
    adjust: LogitsAdjuster,
    stats: Any,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` tokens, several per pass of the target (``stats`` as in
    :func:`~mlxchat.generation.decode_tokens`, plus ``drafted`` and ``accepted``).

    The first token comes from the target alone (it is the time to first token); drafting starts after
    it. However the consumer stops, the target's cache ends holding what plain decoding leaves: the prompt
    and every token yielded (the last one only if it was not the ``max_tokens``-th).
    """
    prompt_length = len(cache) + len(pending)
    sequence = list(cache.tokens) + list(pending)
    reply = profiling.current()
    clock = time.perf_counter if reply else _no_clock
    yielded = 0
    mark = cache.mark()
    try:
        while yielded < max_tokens:
            count = 0 if yielded == 0 else min(draft_tokens, max_tokens - yielded - 1)
            began = clock()
            if count:
                drafts, q = drafter.propose(cache, sequence, count, acceptance)
                if reply:
                    mx.eval(drafts)
            else:
                drafts, q = mx.array([], dtype=mx.uint32), None
            drafted = clock()
            mark, start = cache.mark(), len(cache)
            fed = mx.concatenate([mx.array(sequence[start:], dtype=mx.uint32), drafts.astype(mx.uint32)])
            hidden, logits = target_pass(module, fed[None], cache.layers, count + 1, drafter.reads_hidden)
            built = clock()
            if reply:
                mx.eval(logits, hidden if hidden is not None else [])
            evaluated = clock()
            kept, token = acceptance.verify(_adjusted(adjust, logits, drafts), drafts, q)
            mx.eval(kept, token, drafts)
            chosen: list[int] = drafts.tolist()  # type: ignore[assignment]  # a 1-D id array
            j, y = int(kept.item()), int(token.item())  # type: ignore[arg-type]
            cache.feed(sequence[start:] + chosen)
            new = [*chosen[:j], y]
            sequence += new
            adjust.record(mx.array(new))
            cache.rewind(len(sequence) - 1, mark)
            stats.drafted, stats.accepted = stats.drafted + count, stats.accepted + j
            drafter.commit(cache, sequence, Verified(chosen, j, start, hidden))
            if reply:
                reply.step(len(new), len(fed) if yielded == 0 else 0, draft=drafted - began, build=built - drafted,
                           eval=evaluated - built, sample=clock() - evaluated)
            for value in new:
                now = time.perf_counter()
                if stats.first_token_at is None:
                    stats.first_token_at = now
                yielded += 1
                stats.last_token_at, stats.tokens = now, yielded
                yield value
    except GeneratorExit:  # the consumer stopped (a stop token or string, a cancel)
        _settle(module, cache, sequence, prompt_length + min(yielded, max_tokens - 1), mark)
        raise
    _settle(module, cache, sequence, prompt_length + max_tokens - 1, mark)


def _no_clock() -> float:
    return 0.0


def _adjusted(adjust: LogitsAdjuster, logits: mx.array, drafts: mx.array) -> mx.array:
    """The target's logits with penalties and biases applied as plain decoding would: row ``i`` counts the
    drafts before it as generated."""
    if not adjust.active:
        return logits
    saved, rows = adjust.state, []
    for i in range(logits.shape[0]):
        rows.append(adjust(logits[i : i + 1]))
        if i < drafts.shape[0]:
            adjust.record(drafts[i : i + 1])
    adjust.state = saved
    return mx.concatenate(rows, axis=0)


def _settle(module: Any, cache: PromptCache, sequence: list[int], wanted: int,
            mark: tuple[int, list[Any] | None]) -> None:
    """Leave the target's cache holding ``sequence[:wanted]``, feeding what a rewind to ``mark`` dropped."""
    held = cache.rewind(min(wanted, len(cache)), mark)
    if held < wanted:
        module(mx.array(sequence[held:wanted])[None], cache.layers)
        mx.eval(cache.arrays())
        cache.feed(sequence[held:wanted])


# -- drafters --------------------------------------------------------------------------------------------


class _DraftState:
    """A draft model's prompt cache in the target's, tagged with the module it belongs to."""

    def __init__(self, owner: Any):
        self.owner = owner
        self.cache = PromptCache(owner.make_cache)
        self.synced = False
        """Whether the cache's tokens are a prefix of the generation's sequence (checked once per generation)."""
        self.mark: tuple[int, list[Any] | None] = (0, None)
        self.fed: list[int] = []
        """The committed tokens the last proposal fed before its drafts."""

    def held(self) -> list[Any]:
        return self.cache.held()


class ModelDrafter:
    """A smaller model of the same vocabulary drafts by decoding on its own cache (greedy, or sampling with
    the request's settings; penalties are left to the target)."""

    reads_hidden = False

    def __init__(self, module: Any, vocab_size: int, draft_vocab_size: int, prefill_step: int = 512):
        self.module = module
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.prefill_step = prefill_step
        self._last_logits = last_logits_of(module)

    def _state(self, cache: PromptCache) -> _DraftState:
        if not isinstance(cache.draft, _DraftState) or cache.draft.owner is not self.module:
            cache.draft = _DraftState(self.module)
        state: _DraftState = cache.draft
        return state

    def begin(self, cache: PromptCache, ids: Sequence[int]) -> Follower | None:
        self._state(cache).synced = False
        return None

    def propose(self, cache: PromptCache, sequence: Sequence[int], count: int,
                acceptance: Acceptance) -> tuple[mx.array, mx.array | None]:
        state = self._state(cache)
        draft = state.cache
        if not state.synced:  # reuse what the draft holds of this conversation, prefill the rest
            draft.prefill(self.module, self._readable(sequence), step=self.prefill_step)
            state.synced = True
        state.mark, state.fed = draft.mark(), self._readable(sequence[len(draft):])
        tokens = mx.array(state.fed)[None]
        drafts, qs = [], []
        for _ in range(count):
            token, q = acceptance.draft(self._fit(self._last_logits(tokens, draft.layers)))
            drafts.append(token)
            qs += [q] if q is not None else []
            tokens = token[None]
        return mx.concatenate(drafts), mx.concatenate(qs) if qs else None

    def _readable(self, ids: Sequence[int]) -> list[int]:
        """Ids the draft's embedding holds: one beyond it (the target's embedding may be larger than the
        shared tokenizer; a prompt of raw ids can use those rows) is read as id 0, which costs acceptance
        only."""
        limit = self.draft_vocab_size
        return [t if t < limit else 0 for t in ids]

    def _fit(self, logits: mx.array) -> mx.array:
        """Draft logits over the target's vocabulary (either may pad its embedding to another size)."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            return mx.pad(logits, [(0, 0), (0, self.vocab_size - width)], constant_values=-mx.inf)
        return logits

    def fresh_state(self) -> tuple[list[Any], Callable[[int], Any]]:
        layers = self.module.make_cache()
        return layers, lambda n: self.module(mx.zeros((1, n), mx.int32), layers)

    def commit(self, cache: PromptCache, sequence: Sequence[int], verified: Verified) -> None:
        """The draft fed its pending tokens and every draft but the last: keep what the target kept."""
        if not verified.drafts:
            return
        state = self._state(cache)
        state.cache.feed(state.fed + verified.drafts[:-1])
        state.cache.rewind(state.mark[0] + len(state.fed) + min(verified.kept, len(verified.drafts) - 1),
                           state.mark)


class MtpCache:
    """An MTP head's state in the target's cache: its layer caches (row ``i`` pairs the target's hidden state
    at position ``i`` with the token at ``i + 1``), target states queued for the next rows, and the tokens
    both were made from."""

    def __init__(self, layers: list[Any]):
        self.layers = layers
        self.queued: list[mx.array] = []
        """Target states ``[1, L, H]`` of the positions after the rows, in order."""
        self.tokens: list[int] = []

    def held(self) -> list[Any]:
        return [layer.state for layer in self.layers] + self.queued

    @property
    def rows(self) -> int:
        return int(self.layers[0].offset)

    @property
    def covered(self) -> int:
        """Positions whose rows are run or queued."""
        return self.rows + sum(h.shape[1] for h in self.queued)

    def cut(self, positions: int) -> None:
        """Keep rows and queued states of the first ``positions`` positions only."""
        for layer in self.layers:
            layer.trim_to(min(positions, layer.offset))
        kept, room = [], positions - self.rows
        for hidden in self.queued:
            if room > 0:
                kept.append(hidden[:, :room])
            room -= hidden.shape[1]
        self.queued = kept

    def queue(self, start: int, hidden: mx.array, width: int) -> None:
        """Queue the states of positions ``start ..`` beyond those covered (zeros for any gap before)."""
        covered = self.covered
        if covered < start:
            self.queued.append(mx.zeros((1, start - covered, width), hidden.dtype))
        elif covered > start:
            hidden = hidden[:, covered - start :]
        if hidden.shape[1]:
            self.queued.append(hidden)


class MtpDrafter:
    """A multi-token-prediction head drafts from the target's last hidden state and the token that follows
    it, then from its own output (the module's ``mtp_step``, e.g. Qwen3.5's ``mtp.*``).

    Its rows must cover the conversation for its attention to see it: the prefill hands it the target's
    hidden states chunk by chunk, every verify pass those of the tokens it kept, and rows built from tokens
    the conversation no longer has are cut. A position whose target state is gone (a conversation the
    target prefilled before the head was first used) gets a zero state: that costs acceptance only.
    """

    reads_hidden = True

    def __init__(self, module: Any):
        self.module = module
        self.width = module.config.hidden_size

    def _state(self, cache: PromptCache) -> MtpCache:
        if not isinstance(cache.draft, MtpCache):
            cache.draft = MtpCache(self.module.make_mtp_cache())
        state: MtpCache = cache.draft
        return state

    def begin(self, cache: PromptCache, ids: Sequence[int]) -> Follower | None:
        state = self._state(cache)
        # Row i depends on the tokens up to i + 1: keep the rows of positions before the common prefix's end.
        state.cut(max(common_prefix_length(state.tokens, ids) - 1, 0))
        state.tokens = list(ids)

        def follow(start: int, hidden: mx.array) -> list[mx.array]:
            state.queue(start, hidden, self.width)
            self._run(state)
            return [a for layer in state.layers for a in layer.state if a is not None]

        return follow

    def fresh_state(self) -> tuple[list[Any], Callable[[int], Any]]:
        layers = self.module.make_mtp_cache()

        def run(n: int) -> mx.array:  # the target's own states of n tokens, in the dtype it computes in
            tokens = mx.zeros((1, n), mx.int32)
            out: mx.array = self.module.mtp_step(self.module.model(tokens, self.module.make_cache()), tokens, layers)
            return out

        return layers, run

    def _run(self, state: MtpCache) -> mx.array | None:
        """Run the queued rows (their next tokens are in ``state.tokens``); the head's output ``[1, L, H]``."""
        if not state.queued:
            return None
        hidden = mx.concatenate(state.queued, axis=1) if len(state.queued) > 1 else state.queued[0]
        first = state.rows
        tokens = mx.array(state.tokens[first + 1 : first + 1 + hidden.shape[1]])[None]
        state.queued = []
        out: mx.array = self.module.mtp_step(hidden, tokens, state.layers)
        return out

    def propose(self, cache: PromptCache, sequence: Sequence[int], count: int,
                acceptance: Acceptance) -> tuple[mx.array, mx.array | None]:
        state = self._state(cache)
        out = self._run(state)
        assert out is not None and state.rows == len(sequence) - 1, "the MTP head is out of step"
        drafts, qs = [], []
        for i in range(count):
            token, q = acceptance.draft(self.module.project(out[:, -1, :]))
            drafts.append(token)
            qs += [q] if q is not None else []
            if i < count - 1:
                out = self.module.mtp_step(out[:, -1:], token[None], state.layers)
        return mx.concatenate(drafts), mx.concatenate(qs) if qs else None

    def commit(self, cache: PromptCache, sequence: Sequence[int], verified: Verified) -> None:
        """Drop the rows of the drafts; queue the target's states of the kept tokens."""
        state = self._state(cache)
        if len(verified.drafts) > 1:
            state.cut(state.rows - len(verified.drafts) + 1)
        state.tokens = list(sequence)
        assert verified.hidden is not None
        # Rows wait for the token after them: the last kept position's row runs in the next proposal.
        upto = len(sequence) - 1 - verified.start
        state.queue(verified.start, verified.hidden[:, :upto], self.width)
