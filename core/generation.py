"""Generation: prefill what the cache does not hold, then decode one token at a time.

Prefill belongs to the :class:`~mlxchat.prompt_cache.PromptCache` (reuse, chunks whose logits are never
materialised, snapshots). The hot path is :func:`decode_tokens`, which only decodes: it builds step ``n+1``
before it reads token ``n`` and evaluates asynchronously, so the device never waits on Python; the sampler
is its argument. Every token that enters the model is recorded in the prompt cache, so the cache always
knows exactly what it holds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import profiling
from .architecture import ModelModule
from .batching import (
    DecodeRow,
    DecodeStats,
    MemoryWait,
    PrefillChunk,
    decode_steps,
    last_logits_of,
    masked,
    prefill_steps,
    room,
)
from .constraints import DEFAULT_REASONING_BUDGET, RowMatcher, check_response_format
from .detokenizer import StreamingDetokenizer
from .errors import InvalidInputError
from .layers.parallel import from_rank_zero
from .limits import check_depth, check_strings, check_text
from .multimodal import MultimodalPrompt
from .pacing import PACE_QUANTUM, StepPace
from .prompt_cache import PromptCache
from .sampling import LogitsAdjuster, Sampler, make_sampler
from .speculative import Acceptance, Drafter, speculative_tokens
from .tokenizer import Tokenizer
from .worker import Cancelled

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
# Names a chat template is called with by the chat itself.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class GenerationConfig(BaseModel):
    """How to generate. Fields left unset fall back to the model's defaults (its generation_config.json).

    Every number must be finite; ``seed`` -1 means "no seed" (as in vLLM). Token ids in ``logit_bias`` are
    checked against the model's vocabulary when the generation starts.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    max_tokens: int = Field(512, ge=1)
    """Most tokens to generate; lowered to what the model's context leaves after the prompt."""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """0 (or below 1e-6, which float32 logits cannot divide by): greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: list[str] = Field(default_factory=list)
    enable_thinking: bool | None = None
    """Passed to the chat template when set (chat only)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments for the chat template (chat only)."""
    prefill_step: int = Field(512, ge=1, le=16384)
    """Prompt tokens per prefill chunk."""
    draft_tokens: int = Field(0, ge=0, le=16)
    """Speculative decoding: tokens the model's draft proposes per pass of the model (0: off). Needs a draft
    (``load_model(..., draft=...)``) or a checkpoint with a multi-token-prediction head."""
    reply_prefix: str = ""
    """Text the reply is made to start with (a tool-call opener, say): its tokens count as the reply's first,
    streamed, parsed and returned like generated ones, and the model writes on from there. Control-token
    text in it becomes the control token, as in the model's own output."""
    reply_prefix_after: tuple[str, str] | None = None
    """``(opener, closer)`` of what a model may write before :attr:`reply_prefix` (its reasoning): when the
    reply's first token opens ``opener`` (an empty opener: the prompt already opened it), the prefix follows
    the model's ``closer``; otherwise it comes at once."""
    response_format: dict[str, Any] | None = None
    """What the reply must be (constrained decoding, :mod:`mlxchat.constraints`): ``{"type": "text"}`` (or
    unset: free), ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}``, ``{"type": "regex", "pattern": ...}`` (Rust regex syntax) or
    ``{"type": "grammar", "grammar": ...}`` (llguidance's Lark). A schema that cannot be compiled is an
    :class:`~mlxchat.errors.InvalidInputError` before any work."""
    reasoning_budget: int | None = Field(None, ge=0)
    """Most reasoning tokens a constrained reply (a response format, a required or strict tool call) writes
    before its reasoning is closed and the constraint starts; unset: 1024
    (``mlxchat.constraints.DEFAULT_REASONING_BUDGET``) or half of ``max_tokens``, whichever is less, so that
    the constrained part has room."""

    @field_validator("seed", mode="before")
    @classmethod
    def _no_seed(cls, value: Any) -> Any:
        return None if value == -1 and not isinstance(value, bool) else value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        check_depth(value, what="response_format")
        return check_response_format(value) and value

    @property
    def budget(self) -> int:
        """The reasoning budget of a constrained reply (see :attr:`reasoning_budget`)."""
        if self.reasoning_budget is None:
            return min(DEFAULT_REASONING_BUDGET, self.max_tokens // 2)
        return self.reasoning_budget

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: list[str]) -> list[str]:
        return [check_text(s, "a stop string") for s in value]

    @field_validator("reply_prefix")
    @classmethod
    def _prefix_text(cls, value: str) -> str:
        return check_text(value, "reply_prefix")

    @field_validator("temperature")
    @classmethod
    def _greedy_below(cls, value: float) -> float:
        return 0.0 if value < 1e-6 else value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set through chat_template_kwargs (the chat "
                             "itself sets them)")
        check_depth(value, what="chat_template_kwargs")
        check_strings(value, "chat_template_kwargs")
        return value

    def merged(self, override: GenerationConfig | dict[str, Any] | None) -> GenerationConfig:
        """This config with the fields ``override`` sets explicitly replaced."""
        override = GenerationConfig.coerce(override)
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))

    @classmethod
    def coerce(cls, value: GenerationConfig | dict[str, Any] | None) -> GenerationConfig | None:
        """Settings as a caller gives them (a config, a dict of its fields, or none), checked: anything else, or a
        field out of range, is an :class:`~mlxchat.errors.InvalidInputError` naming each field."""
        if value is None or isinstance(value, GenerationConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidInputError(f"generation settings are a GenerationConfig or a dict, got {type(value).__name__}")
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            problems = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()]
            raise InvalidInputError("generation settings: " + "; ".join(problems)) from None


class GenerationReport(BaseModel):
    """What one generation cost."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the cache (not prefilled)."""
    generated_tokens: int = 0
    ttft_s: float = 0.0
    """Seconds from the start of the request to the first generated token."""
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    draft_tokens: int = 0
    """Tokens the draft proposed (speculative decoding)."""
    accepted_draft_tokens: int = 0
    """Of those, the tokens the model kept."""
    peak_memory_gb: float = 0.0
    finish_reason: FinishReason = "stop"

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens


class GenerationChunk(BaseModel):
    """One streamed piece: the text a token completed (possibly empty), and on the last chunk the report."""

    text: str = ""
    token: int | None = None
    finish_reason: FinishReason | None = None
    report: GenerationReport | None = None


class GenerationResult(BaseModel):
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    report: GenerationReport


def decode_tokens(
    module: ModelModule,
    cache: PromptCache,
    pending: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    *,
    adjust: LogitsAdjuster | None = None,
    stats: DecodeStats | None = None,
    constraint: RowMatcher | None = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` sampled ids (the caller stops earlier on EOS, a stop string or a cancel),
    each step run right here: :func:`~mlxchat.batching.decode_steps` for a sequence of its own.

    The first step runs ``pending`` (the prompt's tail that :meth:`PromptCache.prefill` left); every step
    builds the next one before it reads its own token, so the device never waits on Python. ``adjust``
    applies penalties and biases to the logits before ``sampler`` picks a token.
    """
    reply = profiling.current()
    if reply is not None:
        yield from _profiled_decode(last_logits_of(module), cache, pending, sampler, max_tokens, adjust,
                                    stats or DecodeStats(), reply, constraint)
        return
    for item in decode_steps(module, cache, pending, sampler, max_tokens, adjust=adjust, stats=stats,
                             constraint=constraint):
        if isinstance(item, DecodeRow):
            DecodeRow.run_together([item])
        else:
            yield item


def _profiled_decode(last_logits: Any, cache: PromptCache, pending: Sequence[int], sampler: Sampler, max_tokens: int,
                     adjust: LogitsAdjuster | None, stats: DecodeStats,
                     reply: profiling.ReplyProfile, constraint: RowMatcher | None = None) -> Iterator[int]:
    """:func:`decode_tokens` one step at a time, each timed in parts: the graph built, evaluated, sampled."""
    tokens = list(pending)
    for n in range(1, max_tokens + 1):
        if constraint is not None and n > 1:
            constraint.advance(tokens[0])
        started = time.perf_counter()
        logits = last_logits(mx.array(tokens)[None], cache.layers)
        built = time.perf_counter()
        mx.eval(logits)
        evaluated = time.perf_counter()
        if adjust is not None and adjust.active:
            logits = adjust(logits)
        token = sampler(masked(logits, constraint))
        if adjust is not None:
            adjust.record(token)
        value = int(token.item())  # type: ignore[arg-type]  # a token id array holds ints
        now = time.perf_counter()
        reply.step(1, len(tokens) if n == 1 else 0, build=built - started, eval=evaluated - built,
                   sample=now - evaluated)
        cache.feed(tokens)
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.last_token_at, stats.tokens = now, n
        yield value
        tokens = [value]


def make_report(prompt_len: int, stats: DecodeStats, finish_reason: FinishReason) -> GenerationReport:
    first = stats.first_token_at or time.perf_counter()
    ttft = first - stats.start
    decode_time = (stats.last_token_at or first) - first
    return GenerationReport(
        prompt_tokens=prompt_len,
        cached_prompt_tokens=stats.cached,
        generated_tokens=stats.tokens,
        ttft_s=ttft,
        prefill_tps=(prompt_len - stats.cached) / ttft if ttft > 0 else 0.0,
        decode_tps=(stats.tokens - 1) / decode_time if decode_time > 0 else 0.0,
        draft_tokens=stats.drafted,
        accepted_draft_tokens=stats.accepted,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        finish_reason=finish_reason,
    )


class StopStrings:
    """Finds stop strings in streamed text; holds back a tail that might be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        hits = [(self.held.find(s), s) for s in self.stops if s in self.held]
        if hits:
            index, _ = min(hits)
            out, self.held = self.held[:index], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.held)), 0, -1):
                if self.held.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def stream_generation(
    module: ModelModule,
    tokenizer: Tokenizer,
    prompt: Sequence[int] | MultimodalPrompt,
    cache: PromptCache,
    config: GenerationConfig,
    eos_ids: set[int],
    vocab_size: int,
    *,
    snapshot_at: Sequence[int] = (),
    cancel: Cancelled | None = None,
    drafter: Drafter | None = None,
    prefill_budget: int | None = None,
    pace: StepPace | None = None,
    constraint: RowMatcher | None = None,
) -> Iterator[GenerationChunk | DecodeRow | PrefillChunk | MemoryWait]:
    """Text chunks of one generation, one per token (its text may be empty while a character or a possible
    stop string is incomplete); the last chunk carries ``finish_reason`` and the report. Its
    :class:`~mlxchat.batching.DecodeRow` and :class:`~mlxchat.batching.PrefillChunk` items are decode steps
    and prefill chunks for whoever runs it to run (the worker runs them with other generations').

    ``prefill_budget``: the prompt goes in through the worker's steps, at most this many tokens a step
    that also decodes (``config.prefill_step`` in one that does not; see
    :class:`~mlxchat.batching.PrefillChunk`), in chunks of at most the smaller of the two; ``None``
    prefills it here at once. With a ``pace`` (:mod:`mlxchat.pacing`) a text prompt is planned in
    chunks of :data:`~mlxchat.pacing.PACE_QUANTUM` tokens, as many going in a step as the pace allows. A
    generation that decodes alone (below) always prefills at once.

    With a ``drafter`` and ``config.draft_tokens`` set, tokens are decoded speculatively
    (:mod:`mlxchat.speculative`). A set ``cancel`` (checked between prefill chunks and after every token)
    ends it with ``finish_reason="cancelled"``. The cache stays consistent however it ends.

    A cache whose owner bounds its growth (``cache.growth``, a server's memory admission) is asked before the
    prompt and before every step that adds tokens; while refused, the generation yields
    :class:`~mlxchat.batching.MemoryWait` items (it sits out the worker's steps, its cache kept).

    A ``constraint`` masks every token (:mod:`mlxchat.constraints`); a constrained reply is never decoded
    speculatively (a draft would have to be checked against the mask token by token, which costs what it
    saves) and takes no ``reply_prefix`` (its grammar forces what it must start with).
    """
    reply = profiling.begin()
    try:
        if constraint is not None:
            drafter, config = None, config.model_copy(update={"reply_prefix": "", "reply_prefix_after": None})
        yield from _generation(module, tokenizer, prompt, cache, config, eos_ids, vocab_size, snapshot_at, cancel,
                               drafter if config.draft_tokens else None, reply, prefill_budget, pace, constraint)
    finally:
        profiling.end(reply, None)


def _generation(module: ModelModule, tokenizer: Tokenizer, prompt: Sequence[int] | MultimodalPrompt,
                cache: PromptCache, config: GenerationConfig, eos_ids: set[int], vocab_size: int,
                snapshot_at: Sequence[int], cancel: Cancelled | None, drafter: Drafter | None,
                reply: profiling.ReplyProfile | None,
                prefill_budget: int | None, pace: StepPace | None,
                constraint: RowMatcher | None) -> Iterator[GenerationChunk | DecodeRow | PrefillChunk | MemoryWait]:
    mx.reset_peak_memory()
    stats = DecodeStats()
    detok = StreamingDetokenizer(tokenizer)
    detokenize = profiling.timed("detokenize", detok.add)
    stops = StopStrings(config.stop)
    finish: FinishReason = "length"
    hit = False
    if not prompt:
        raise ValueError("cannot generate from an empty prompt")
    forced = tokenizer.encode(config.reply_prefix)[: config.max_tokens] if config.reply_prefix else []
    after = config.reply_prefix_after
    at_once = forced if after is None else []
    ids = [*(prompt.ids if isinstance(prompt, MultimodalPrompt) else prompt), *at_once]
    full = MultimodalPrompt(tuple(ids), prompt.images) if isinstance(prompt, MultimodalPrompt) else ids
    group = getattr(module, "group", None)
    # Alone: a split model (each step is a collective of every rank), a profiled reply (each step timed),
    # speculative decoding (several tokens a pass) and a prefix after the reasoning (decoded in parts).
    alone = group is not None or reply is not None or drafter is not None or bool(forced and after is not None)
    first: mx.array | None = None
    # Tokens a step adds at most: its token, a draft's, a prefix fed after the reasoning in one step.
    ahead = 1 + (config.draft_tokens if drafter is not None else 0) + (len(forced) if after is not None else 0)
    yield from room(cache, len(ids) + ahead, cancel)  # the prompt's memory (a server reserved it before)
    if alone or prefill_budget is None:
        follow = drafter.begin(cache, ids) if drafter is not None else None
        reused, pending = cache.prefill(module, full, snapshot_at=snapshot_at, step=config.prefill_step,
                                        cancel=cancel, follow=follow, ahead=ahead)
    else:
        step = min(config.prefill_step, prefill_budget)
        if pace is not None and not isinstance(full, MultimodalPrompt):
            step = min(step, PACE_QUANTUM)
        plan = cache.start_prefill(module, full, snapshot_at=snapshot_at, step=step, logits=True, ahead=ahead)
        yield from prefill_steps(plan, prefill_budget, config.prefill_step, cancel, pace)
        reused, pending, first = plan.reused, [], plan.logits
    stats.cached = min(reused, len(prompt))
    adjust = LogitsAdjuster(vocab_size, config.repetition_penalty, config.presence_penalty,
                            config.frequency_penalty, config.logit_bias)
    adjust.start(ids)
    sampler = make_sampler(config.temperature, config.top_p, config.top_k, config.min_p, config.seed)
    if group is not None:  # a model split over processes: every rank takes rank 0's token
        sampler = from_rank_zero(sampler, group)

    def decode(start: Sequence[int], budget: int) -> Iterator[int | DecodeRow]:
        """Decoding whose steps the worker may run with other generations' (``DecodeRow`` items), its first
        token from the prefill's logits when it gave them."""
        if alone:
            return decode_alone(start, budget)
        return decode_steps(module, cache, start, sampler, budget, adjust=adjust, stats=stats, logits=first,
                            constraint=constraint, pace=pace) if budget > 0 else iter(())

    def decode_alone(start: Sequence[int], budget: int) -> Iterator[int]:
        if budget <= 0:
            return iter(())
        if drafter is not None:
            acceptance = Acceptance(config.temperature, config.top_p, config.top_k, config.min_p, config.seed)
            return speculative_tokens(module, cache, start, drafter, acceptance, config.draft_tokens, budget,
                                      adjust=adjust, stats=stats)
        return decode_tokens(module, cache, start, sampler, budget, adjust=adjust, stats=stats,
                             constraint=constraint)

    tokens: Iterator[int | DecodeRow]
    if cancel is not None and cancel.check():
        tokens = iter(())
    elif not forced:
        tokens = decode(pending, config.max_tokens)
    elif after is None:
        tokens = itertools.chain(forced, decode(pending, config.max_tokens - len(forced)))
    else:
        tokens = _prefixed_after(decode_alone, tokenizer, lambda: len(cache), pending, forced, after, config.max_tokens)
    produced = 0
    try:
        while (yield from room(cache, len(cache) + ahead, cancel)) and (token := next(tokens, None)) is not None:
            if isinstance(token, DecodeRow):  # a step the worker runs, with other generations' when it can
                yield token
                continue
            if token in eos_ids:
                finish = "stop"
                break
            produced += 1
            text, hit = stops.feed(detokenize(token))
            yield GenerationChunk(text=text, token=token)
            if hit:
                finish = "stop"
                break
            if cancel is not None and cancel.check():
                break
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()  # the decoder leaves the cache as it should be before the report is made
    if cancel and not hit and finish == "length":
        finish = "cancelled"
    if not hit:
        text, hit = stops.feed(detok.flush())
        tail = text if hit else text + stops.flush()
        if tail:
            yield GenerationChunk(text=tail)
    if forced:  # decoding ran in parts: count the reply as a whole
        stats.tokens = produced + (finish == "stop" and not hit)
    report = make_report(len(prompt), stats, finish)
    profiling.end(reply, report)
    yield GenerationChunk(finish_reason=finish, report=report)


def _prefixed_after(decode: Callable[[Sequence[int], int], Iterator[int]], tokenizer: Tokenizer,
                    held: Callable[[], int], pending: Sequence[int], prefix: list[int], after: tuple[str, str],
                    budget: int) -> Iterator[int]:
    """Reply tokens with ``prefix`` after the model's reasoning (see ``GenerationConfig.reply_prefix_after``).

    A decode stopped after the closer leaves the cache (``held`` tokens long) holding what was read, but for
    the last tokens where they reached the reader before their forward pass was queued (a decoder's first);
    those are fed with the prefix, and the next token, already sampled, is dropped. The first token is sampled
    alone (not fed) to see whether it opens the reasoning."""
    def prefixed(budget: int, unfed: Sequence[int] = ()) -> Iterator[int]:
        forced = prefix[:budget]
        yield from forced
        yield from decode([*unfed, *forced], budget - len(forced))

    opener, closer = after
    seen = ""
    if opener:
        first = next(decode(pending, 1), None)
        seen = tokenizer.decode([first]).lstrip() if first is not None else ""
        if first is None or not seen or not (opener.startswith(seen) or seen.startswith(opener)):
            yield from prefixed(budget)
            return
        yield first
        pending, budget = [first], budget - 1
    start, read = held(), list(pending)
    model = decode(pending, budget)
    for token in model:
        yield token
        read.append(token)
        budget -= 1
        seen = (seen + tokenizer.decode([token]))[-4 * len(closer):]
        if closer in seen:
            model.close()  # type: ignore[attr-defined]  # a generator
            yield from prefixed(budget, read[held() - start:])
            return

