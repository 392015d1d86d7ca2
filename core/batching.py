"""Decoding several sequences together: one forward pass over all of them a step, so that the weights are
read once for every sequence (decode is bound by reading them), while each sequence keeps its own cache,
length, position, sampler and penalties.

A generation decodes through :func:`decode_steps`, which yields its :class:`DecodeRow` before each step;
the model's worker gathers the rows of every generation waiting at that moment and runs them in one pass
(:meth:`DecodeRow.run_together`; see :mod:`mlxchat.worker`), so sequences join and leave between steps
(continuous batching). A row alone runs exactly the single-sequence step. The products of several rows
are summed in another order than one row's, so a batched row's logits are within about 1e-5 (float32) of
its own; :func:`mlxchat.testing.batched_decoding_problems` checks every architecture for equal greedy
tokens.

A prompt goes in through the same steps (chunked prefill, as in vLLM and Sarathi-Serve): a generation
yields a :class:`PrefillChunk` while its prompt is going in, and each step runs, beside the decode rows, at
most the model's ``prefill_step_budget`` prompt tokens of the waiting prompts (fewest left first), and no
more than keep the step within the model's ``max_decode_slowdown`` of the rows' own
(:mod:`mlxchat.pacing`). So a step costs the running streams one decode token plus a bounded chunk,
however long the prompt that arrives. On
a model whose layers take :class:`~mlxchat.cache.RaggedRows` (``runs_ragged``), the step is one forward pass:
the decode rows' tokens and the prompt chunks lie end to end, each attending over its own cache, so the
weights are read once a step however many sequences it carries (:meth:`StepItem.run_together`); on the
others each prompt's chunks are a pass of their own after the decode rows' pass. A generation whose cache
may not grow yet (a server's memory admission) sits the steps out (:class:`MemoryWait`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .architecture import ModelModule
from .cache import RaggedRows, RowCaches
from .constraints import fill_masks
from .pacing import Load
from .prompt_cache import Growth, Prefill, PromptCache, last_logits_of
from .worker import Gathered, Together

if TYPE_CHECKING:
    from .constraints import RowMatcher
    from .pacing import StepPace
    from .sampling import LogitsAdjuster, Sampler
    from .worker import Cancelled

DEFAULT_PREFILL_STEP_BUDGET = 512
"""Prompt tokens a worker step prefills at most by default: the default prefill chunk
(``GenerationConfig.prefill_step``, and mlx-lm's ``prefill_step_size``), so a prompt that arrives alone goes
in exactly as one prefill would (same chunks, same speed), and a step with streams running costs them at
most one such chunk (vLLM's and Sarathi-Serve's chunked prefill pick budgets of this order on GPUs); the
model's pace (:mod:`mlxchat.pacing`) takes fewer where one chunk would slow the streams more than its
``max_decode_slowdown``.
Measured on a 2-core CPU (``benchmarks.serve``, Qwen3-0.6B shapes, 8 chat clients and one sending 4k-token
documents): 64 cut the chats' inter-token p50 during a document from 3.1 s to 0.85 s, but each small chunk
costs a pass over the weights, so throughput fell from 8.0 to 6.4 tok/s and a new chat's first token came
after 35 s instead of 2.5 s (p50): 512 stays the default."""

MEMORY_WAIT = 0.05
"""Seconds a worker step in which every generation waits for memory sleeps at most (a release wakes it)."""

IDLE_PROMPTS = 4
"""Waiting prompts of which a step with nothing decoding takes what each would alone (its ``idle`` budget: all in
one pass, at most this many default prefill steps in all unless one prompt's own is larger): prompts that arrive
together start decoding together, rather than the first decoding while the others are paced in beside it
(:data:`~mlxchat.worker.GATHER_QUIET`)."""
SHARED_WAIT = 64
"""Tokens of its prompt another prompt must be computing for a prompt to wait for it and copy them (fewer
cost about what a step's wait would)."""


def batched_last_logits(module: ModelModule, tokens: Sequence[int] | mx.array,
                        caches: Sequence[PromptCache]) -> mx.array:
    """Logits ``[B, vocab]`` of one decode step of ``B`` sequences at once: row ``i`` feeds ``tokens[i]`` through
    ``caches[i]`` (each with its own length and position). The weights are read once for all rows; the
    attention and recurrent state of each row stay its own (:class:`~mlxchat.cache.RowCaches`)."""
    layers = [RowCaches([cache.layers[i] for cache in caches]) for i in range(len(caches[0].layers))]
    column = tokens[:, None] if isinstance(tokens, mx.array) else mx.array(list(tokens))[:, None]
    return last_logits_of(module)(column, layers)


def ragged_last_logits(module: ModelModule, tokens: Sequence[mx.array], caches: Sequence[PromptCache],
                       rows: int = 0) -> mx.array:
    """Logits ``[B, vocab]`` of the last position of each of ``B`` sequences run in one pass: ``tokens[i]``
    (one decode token, or a prompt chunk) through ``caches[i]``, laid end to end, the first ``rows`` decoding
    (:class:`~mlxchat.cache.RaggedRows`; the module ``runs_ragged``)."""
    lengths = [int(t.size) for t in tokens]
    layers = [RaggedRows([cache.layers[i] for cache in caches], lengths, rows) for i in range(len(caches[0].layers))]
    return module.last_logits(mx.concatenate(list(tokens))[None], layers)  # type: ignore[attr-defined]


class DecodeStats:
    """Timings of one generation, filled in while it runs (its report is made from them)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.cached = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0


def masked(logits: mx.array, constraint: RowMatcher | None) -> mx.array:
    """``logits`` with the tokens a row's constraint rules out for its next token at ``-inf``: its mask,
    unpacked by numpy from llguidance's words, applied by one ``where`` (llguidance's own MLX helper applies
    the packed words in a Metal kernel, which runs on Apple GPUs only)."""
    mask = constraint.mask() if constraint is not None else None
    return logits if mask is None else mx.where(mx.array(mask), logits, -mx.inf)


class StepItem(Together):
    """What a generation waits on in its model's worker step: a :class:`DecodeRow` or a :class:`PrefillChunk`.
    All that wait at a step run in it together."""

    @classmethod
    def kind(cls) -> type[Together]:
        return StepItem

    @classmethod
    def run_together(cls, items: list[Any]) -> None:
        """One step: every decode row, and at most the budget of prompt tokens of the waiting prefills (see
        :class:`PrefillChunk`). On a module that ``runs_ragged`` the step is one pass, the prompt spans
        beside the decode rows (a failing pass fails every generation in it); otherwise the rows' pass runs
        first and each prefill's chunks are passes of their own."""
        rows = [item for item in items if isinstance(item, DecodeRow)]
        prompts = [item for item in items if isinstance(item, PrefillChunk)]
        if not rows and not prompts:  # every generation of the step waits for memory
            items[0].growth.wait(MEMORY_WAIT)
            return
        module = rows[0].module if rows else prompts[0].prefill.module
        if not getattr(module, "runs_ragged", False):
            if rows:
                _failing(rows, DecodeRow.run_together, rows)
            PrefillChunk.run_budget(prompts, merge=False, rows=rows)
            return
        spans = PrefillChunk.run_budget(prompts, merge=True, rows=rows)
        if rows or spans:
            _failing([*rows, *(span.item for span in spans)], DecodeRow.run_pass, rows, spans)


def _load(rows: Sequence[DecodeRow], spans: Sequence[PromptSpan]) -> Load:
    """What a pass computes (:class:`~mlxchat.pacing.Load`): each prompt token attends over the ones before it."""
    return Load(len(rows) + sum(span.end - span.start for span in spans),
                sum((span.end - span.start) * (2 * span.start + span.end - span.start + 1) // 2 for span in spans))


def _alone(row: DecodeRow, run: Any, *args: Any) -> Any:
    """``run(*args)`` for one row of a step (its constraint's work): a failure is that row's alone (raised where
    its generation waits; the step goes on for the others), and gives ``None``."""
    if row.error is not None:
        return None
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - raised where its generation waits (Together.check)
        row.error = exc
        return None


def _failing(items: list[Any], run: Any, *args: Any) -> None:
    """``run(*args)``; its failure is each of ``items``', raised where its generation waits."""
    try:
        run(*args)
    except Exception as exc:  # noqa: BLE001 - each generation raises it where it waited (Together.check)
        for item in items:
            item.error = exc


class DecodeRow(StepItem):
    """One sequence between decode steps: its cache, how it picks tokens, its constraint (a
    :class:`~mlxchat.constraints.RowMatcher`, or ``None``), and its last token (``current``, not yet read)
    whose forward pass the next step runs."""

    def __init__(self, module: ModelModule, cache: PromptCache, sampler: Sampler, adjust: LogitsAdjuster | None,
                 constraint: RowMatcher | None = None, pace: StepPace | None = None):
        self.module, self.cache, self.sampler, self.adjust = module, cache, sampler, adjust
        self.constraint, self.pace = constraint, pace
        self.current = mx.array([0])
        self.value = 0

    def pick(self, logits: mx.array) -> mx.array:
        """The next token of this row (lazy) from its logits ``[1, vocab]`` (a constrained row's constraint
        must have seen every earlier token)."""
        if self.adjust is not None and self.adjust.active:
            logits = self.adjust(logits)
        token = self.sampler(masked(logits, self.constraint))
        if self.adjust is not None:
            self.adjust.record(token)
        return token

    @classmethod
    def run_together(cls, rows: list[Any]) -> None:
        """One step of these rows alone: the forward pass of each row's ``current`` token (one row: exactly
        the single-sequence step), then :meth:`advance`."""
        module, started = rows[0].module, time.perf_counter()
        if len(rows) == 1:
            logits = last_logits_of(module)(rows[0].current[None], rows[0].cache.layers)
        else:
            tokens = mx.concatenate([row.current for row in rows])
            logits = batched_last_logits(module, tokens, [row.cache for row in rows])
        cls.advance(rows, logits, _load(rows, []), started)

    @classmethod
    def run_pass(cls, rows: list[Any], spans: list[PromptSpan]) -> None:
        """One forward pass of the rows' ``current`` tokens and the prompt ``spans`` laid end to end
        (:class:`~mlxchat.cache.RaggedRows`), then :meth:`advance` for the rows and each span recorded in
        its prefill (:meth:`~mlxchat.prompt_cache.Prefill.took`)."""
        if not spans:
            cls.run_together(rows)
            return
        module, started = rows[0].module if rows else spans[0].item.prefill.module, time.perf_counter()
        logits = ragged_last_logits(module, [row.current for row in rows] + [mx.array(span.tokens) for span in spans],
                                    [row.cache for row in rows] + [span.item.prefill.cache for span in spans],
                                    rows=len(rows))
        filled = [array for span in spans for array in span.item.prefill.cache.arrays()]
        load = _load(rows, spans)
        if rows:
            cls.advance(rows, logits[: len(rows)], load, started, filled)
        else:
            pace = spans[0].item.pace
            if pace is not None:
                pace.queued(load, started, ())
            mx.eval(filled)  # a pass of prompt chunks alone: waited for, as a prefill chunk is
            if pace is not None:
                pace.done(None)
        for j, span in enumerate(spans, start=len(rows)):
            span.item.prefill.took(span.start, span.end, logits[j : j + 1])
            span.item.ran = span.end - span.start

    @staticmethod
    def advance(rows: list[Any], logits: mx.array, load: Load, started: float, also: Sequence[mx.array] = ()) -> None:
        """The rows' next tokens picked from their ``logits [rows, vocab]`` and evaluated asynchronously
        (with ``also``), then each row's ``current`` read into ``value`` and recorded in its cache (its
        forward pass is queued already, so the device never waits on Python). The rows' pace hears of the
        step (what it computes, ``load``, and when its building began, ``started``) when it is queued, and
        that the step before is done once ``current`` is read (:class:`~mlxchat.pacing.StepPace`). A
        constrained row reads
        ``current`` first, while the forward runs, so that its matcher takes it and gives the next mask
        (several rows' masks computed at once: :func:`~mlxchat.constraints.fill_masks`)."""
        constrained = [row for row in rows if row.constraint is not None]
        if constrained:
            mx.async_eval(logits)  # the forward runs while the masks are computed
            for row in constrained:
                row.value = int(row.current.item())  # type: ignore[arg-type]  # a token id array holds ints
                _alone(row, row.constraint.advance, row.value)
            fill_masks([row.constraint for row in constrained if row.error is None])
        picked = [_alone(row, row.pick, logits[i : i + 1]) for i, row in enumerate(rows)]
        following = [row.current if token is None else token for row, token in zip(rows, picked, strict=True)]
        mx.async_eval(following, *also)
        pace = next((row.pace for row in rows if row.pace is not None), None)
        if pace is not None:
            pace.queued(load, started, rows)
        for row in rows:
            if row.constraint is None:
                row.value = int(row.current.item())  # type: ignore[arg-type]  # a token id array holds ints
        if pace is not None:
            pace.done(rows)
        for row, token in zip(rows, following, strict=True):
            row.cache.feed([row.value])
            row.current = token


def decode_steps(module: ModelModule, cache: PromptCache, pending: Sequence[int], sampler: Sampler,
                 max_tokens: int, *, adjust: LogitsAdjuster | None = None, stats: DecodeStats | None = None,
                 logits: mx.array | None = None, constraint: RowMatcher | None = None,
                 pace: StepPace | None = None) -> Iterator[int | DecodeRow]:
    """Up to ``max_tokens`` sampled ids, each announced by this sequence's :class:`DecodeRow` (the worker
    runs the step, alone or with others' rows, before resuming). The first token comes from ``logits`` (the
    last prefill chunk's, :class:`PrefillChunk`), or else from a first step that runs ``pending`` (the
    prompt's tail :meth:`PromptCache.prefill` left) alone; it is the first token ``constraint`` masks. Its
    steps' times go to ``pace``.

    Every step is queued before the token of the step before it is read (the device never waits on Python),
    except the first token: MLX's CPU stream takes a queued graph only as the work before it drains, so
    queuing the second step first held the first token back until that step was nearly done (a whole step
    more before the first token: 40 ms of a 130 ms first token after a 20-token prompt on Qwen3-0.6B)."""
    stats = stats or DecodeStats()
    if not pending and logits is None:
        raise ValueError("decoding needs at least one prompt token to start from")
    row = DecodeRow(module, cache, sampler, adjust, constraint, pace)
    if logits is None:
        logits = last_logits_of(module)(mx.array(list(pending))[None], cache.layers)
        cache.feed(pending)
    row.current = row.pick(logits)
    mx.async_eval(row.current)
    for n in range(1, max_tokens + 1):
        if 1 < n < max_tokens:
            yield row  # the step that feeds token n runs now; ``value`` is token n
            row.check()
            value = row.value
        else:  # the last token needs no step; the first is read before the next step is queued (see above)
            value = int(row.current.item())  # type: ignore[arg-type]  # a token id array holds ints
        now = time.perf_counter()
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.last_token_at, stats.tokens = now, n
        yield value
        if n == 1 < max_tokens:
            yield row  # the step that feeds the first token; ``current`` is the second
            row.check()


class PrefillChunk(StepItem):
    """A generation whose prompt is still going into its cache (:class:`~mlxchat.prompt_cache.Prefill`),
    waiting for the step to run some of its chunks.

    A worker step runs, beside the decode rows (:class:`DecodeRow`), at most ``budget`` prompt tokens of the
    waiting prefills; with a ``pace`` (:class:`~mlxchat.pacing.StepPace`, on a model whose steps are one
    pass) and rows decoding, at most what keeps the step within the pace's slowdown of the rows' own step.
    The prompts with the fewest tokens left go first (a short chat turn is not queued behind a long
    document), but each step a prompt waits without running anything counts as ``budget`` tokens fewer
    (so a long one is never passed over for ever); on a tie, the oldest job first; and prompts sharing a
    prefix (a system prompt) compute it once: one waits right behind another that computes its next chunk
    (:meth:`in_turn`), and skips a step in which another computes :data:`SHARED_WAIT` tokens or more it
    shares, to copy them from the pool in the next (:mod:`mlxchat.prefix_cache`). A prefill runs its next
    whole chunks while they fit what the ones before it left; the first always runs at least one, so a chunk
    larger than the budget, a whole image, still goes. A later prompt takes only what an earlier one leaves
    of the budget (when it stops where its cache snapshots, or before an image chunk). A chunk that runs in a
    pass of its own fails its own generation only.
    """

    def __init__(self, prefill: Prefill, budget: int, idle: int, pace: StepPace | None = None, waited: int = 0):
        self.prefill, self.budget, self.idle, self.pace, self.waited = prefill, budget, idle, pace, waited
        self.ran = 0
        """Prompt tokens the last step ran for this generation."""

    @classmethod
    def run_budget(cls, items: list[Any], merge: bool, rows: Sequence[DecodeRow]) -> list[PromptSpan]:
        """Share the budget among ``items`` (above): with ``merge``, the text chunks that fit are taken as spans
        for the step's one pass (returned), and a step with no ``rows`` decoding takes of each of
        :data:`IDLE_PROMPTS` prompts at most what it would take alone (its ``idle`` budget, or ``budget`` where that
        is larger: a prompt alone goes in as fast as one prefill, and so do several together); the others run
        here, each in passes of its own."""
        spans: list[PromptSpan] = []
        if not items:
            return spans
        items = cls.in_turn(items)
        budget = items[0].budget
        idle = not rows and merge
        left = max(budget, items[0].idle, min(items[0].idle * min(len(items), IDLE_PROMPTS),
                                              IDLE_PROMPTS * DEFAULT_PREFILL_STEP_BUDGET)) if idle else budget
        pace = items[0].pace
        if rows and merge and pace is not None:
            left = pace.allowance(len(rows), len(items[0].prefill.cache), left)
        computing: list[tuple[Prefill, int]] = []  # the prefills this step runs, from which position
        for position, item in enumerate(items):
            prefill = item.prefill
            if any(other.starts_like(prefill.ids, max(start, len(prefill.cache)) + SHARED_WAIT)
                   for other, start in computing):
                continue  # another computes its next tokens in this step: it copies them in the next one
            computing.append((prefill, len(prefill.cache)))
            allowance = left if position else max(left, item.prefill.next_chunk)
            if idle:  # each prompt at most what it would take alone
                allowance = min(allowance, max(item.budget, item.idle, item.prefill.next_chunk))
            try:
                if merge and item.prefill.mergeable:
                    span = PromptSpan(item, *item.prefill.take(allowance))
                    item.ran = span.end - span.start
                    if item.ran:
                        spans.append(span)
                else:
                    item.ran = item.prefill.run(allowance)
            except Exception as exc:  # noqa: BLE001 - this generation's failure, raised where it waits
                item.error = exc
                continue
            left -= item.ran
            if not item.prefill.done and item.prefill.next_chunk > left:
                break  # the next prefills wait for this one (FIFO), unless it stopped short of the budget (where
                # its cache snapshots, or before an image chunk, which runs first in the next step)
        return spans

    @staticmethod
    def in_turn(items: list[Any]) -> list[Any]:
        """``items`` (the jobs' order) in the order they take the step's budget: fewest tokens left first, each
        step waited counting as ``budget`` tokens fewer; a prompt whose next :data:`SHARED_WAIT` tokens or more
        an earlier one computes too (the same tokens at the same positions: a shared system prompt) goes right
        behind that one, to copy them from the pool instead (:meth:`~mlxchat.prompt_cache.Prefill.take`)."""
        ahead: dict[int, tuple[float, int]] = {}
        for index, item in enumerate(items):
            prefill = item.prefill
            end = len(prefill.cache) + SHARED_WAIT
            leader = next((j for j in range(index) if not items[j].prefill.done
                           and items[j].prefill.starts_like(prefill.ids, end)), None)
            ahead[index] = ahead[leader] if leader is not None else \
                (prefill.left - item.waited * item.budget, index)
        return [items[i] for i in sorted(ahead, key=lambda i: (*ahead[i], i))]


class MemoryWait(StepItem):
    """A generation whose cache may not grow yet (:class:`~mlxchat.prompt_cache.Growth` refused it: the memory
    it would take is held by others) sits out a step; a step with nothing else to run waits up to
    :data:`MEMORY_WAIT` seconds for memory to be given back instead of spinning."""

    def __init__(self, growth: Growth):
        self.growth = growth


def room(cache: PromptCache, tokens: int, cancel: Cancelled | None = None) -> Generator[MemoryWait, None, bool]:
    """Sit out the worker's steps until ``cache``'s owner lets it hold ``tokens`` tokens (at once when it sets
    no bound); False when ``cancel`` was set meanwhile."""
    growth = cache.growth
    while growth is not None and not growth.allow(tokens):
        if cancel is not None and cancel.check():
            return False
        yield MemoryWait(growth)
    return True


class PromptSpan:
    """Prompt tokens ``[start, end)`` of a waiting prefill that a step's one pass runs beside the decode rows
    (:meth:`~mlxchat.prompt_cache.Prefill.take`)."""

    def __init__(self, item: PrefillChunk, start: int, end: int):
        self.item, self.start, self.end = item, start, end
        self.tokens = list(item.prefill.ids[start:end])


def prefill_steps(prefill: Prefill, budget: int, idle: int, cancel: Cancelled | None = None,
                  pace: StepPace | None = None) -> Iterator[PrefillChunk]:
    """Run ``prefill`` through the worker's steps, a budget of tokens at a time (``idle`` in a step that
    decodes nothing; fewer as ``pace`` says; see :class:`PrefillChunk`); stops early when ``cancel`` is set."""
    waited = 0
    while not prefill.done and not (cancel is not None and cancel.check()):
        chunk = PrefillChunk(prefill, budget, idle, pace, waited)
        yield chunk
        chunk.check()
        waited = 0 if chunk.ran else waited + 1


def lockstep(generations: Sequence[Iterator[Any]]) -> Generator[Gathered, None, list[list[Any]]]:
    """Run several generations as one job, as offline batch work: every prompt is prefilled first, then they
    all decode together, one step for every row (deterministically: no reader's pace decides which rows
    share a step). Yields the steps; returns what each generation produced besides them."""
    outputs: list[list[Any]] = [[] for _ in generations]
    waiting: dict[int, Together] = {}
    live = set(range(len(generations)))
    try:
        while live:
            for index in sorted(live - waiting.keys()):
                for item in generations[index]:
                    if isinstance(item, Together):
                        waiting[index] = item
                        break
                    outputs[index].append(item)
                else:
                    live.discard(index)
            prefilling = [i for i in sorted(waiting) if not isinstance(waiting[i], DecodeRow)]
            ready = prefilling or sorted(waiting)
            if ready:
                yield Gathered([waiting.pop(i) for i in ready])
    finally:
        for generation in generations:
            close = getattr(generation, "close", None)
            if close is not None:
                close()
    return outputs
