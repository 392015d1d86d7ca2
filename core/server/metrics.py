"""``GET /metrics``: the server's counters in Prometheus' text format (``prometheus-client``).

Every generating request is counted once, when its :class:`~mlxchat.server.lifecycle.Lifecycle` ends: by
endpoint and the status it got, with its prompt, cached and generated tokens, its time to first token and
the gaps between its events (inter-token latency). A request the guard refuses before it reaches a route
(wrong key or host, too many connections, a body too large or not JSON) is counted by status and reason.
Each step of the model's worker is observed: the generations it decoded together (rows of one decode
pass) and the prompt tokens it prefilled. What the server holds is read when scraped: the requests
admitted (running or waiting for the model), the generations running, the bytes their caches hold now and
are reserved (grown as they decode), the generations waiting for memory to grow, the idle caches and their
bytes, the caches spilled to disk, and what the model's steps cost as its worker fitted it
(:mod:`mlxchat.pacing`). Each app has a registry of
its own, so two servers in one process never mix their counts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..batching import DecodeRow, PrefillChunk

# Seconds; a CPU prefill of a long prompt takes minutes, a decode step tens of milliseconds.
FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Metrics:
    """The counters of one server (see the module)."""

    def __init__(self, state: Any):
        """``state``: the :class:`~mlxchat.server.state.ServerState` whose holdings are read when scraped."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("mlxchat_requests", "Generating requests, by endpoint and the status they got",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("mlxchat_prompt_tokens", "Prompt tokens of the requests (cached included)",
                                     ["endpoint"], registry=registry)
        self.cached_tokens = Counter("mlxchat_cached_prompt_tokens", "Prompt tokens served from a cache",
                                     ["endpoint"], registry=registry)
        self.generated_tokens = Counter("mlxchat_generated_tokens", "Tokens generated", ["endpoint"],
                                        registry=registry)
        self.first_token = Histogram("mlxchat_time_to_first_token_seconds",
                                     "From admission to a request's first event", ["endpoint"],
                                     buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self.token_gap = Histogram("mlxchat_inter_token_latency_seconds", "Between the events of a reply",
                                   ["endpoint"], buckets=TOKEN_GAP_BUCKETS, registry=registry)
        self.refused = Counter("mlxchat_refused_requests", "Requests refused before reaching a route, by status "
                               "and reason", ["status", "reason"], registry=registry)
        self.decode_rows = Histogram("mlxchat_decode_step_rows", "Generations decoded together in one step of "
                                     "the model (batched rows)", buckets=ROW_BUCKETS, registry=registry)
        self.prefill_tokens = Histogram("mlxchat_prefill_step_tokens", "Prompt tokens prefilled in one step of "
                                        "the model (see --prefill-step-budget)", buckets=PREFILL_BUCKETS,
                                        registry=registry)
        held: list[tuple[str, str, Any]] = [
            ("mlxchat_queue_depth", "Requests admitted (running or waiting for the model)", lambda: state.queued),
            ("mlxchat_running_generations", "Generations running", lambda: state.running),
            ("mlxchat_waiting_for_memory", "Requests admitted that wait for cache memory (see --max-kv-gb)",
             lambda: state.kv.waiting),
            ("mlxchat_paused_for_memory", "Running generations waiting for cache memory to grow (see --max-kv-gb)",
             lambda: state.kv.paused),
            ("mlxchat_pool_caches", "Idle prompt caches kept in memory", lambda: len(state.pool)),
            ("mlxchat_pool_bytes", "Bytes the idle prompt caches hold", lambda: state.pool.nbytes),
            ("mlxchat_page_cache_bytes", "Bytes the chat page's conversations' caches hold between turns (with the "
             "pool's, under --max-cache-gb)", lambda: state.pool.outside_nbytes),
            ("mlxchat_spilled_caches", "Prompt caches spilled to disk", lambda: state.pool.spilled),
            ("mlxchat_kv_live_bytes", "Bytes the caches of the running generations hold now",
             lambda: state.kv_live),
            ("mlxchat_kv_reserved_bytes", "Cache bytes reserved for the admitted requests, grown as they decode "
             "(see --max-kv-gb)",
             lambda: state.kv_reserved),
            ("mlxchat_kv_limit_bytes", "The limit on the admitted requests' cache bytes", lambda: state.kv_limit),
        ]
        for name, description, read in held:
            Gauge(name, description, registry=registry).set_function(read)
        cost = Gauge("mlxchat_step_cost_seconds", "What the model's steps cost, as the worker fitted it from their "
                     "times (see --max-decode-slowdown; NaN until known or when off): fixed a pass, per query "
                     "token, per key a prompt token attends", ["part"], registry=registry)
        for index, part in enumerate(("fixed", "per_token", "per_prompt_key")):
            cost.labels(part).set_function(functools.partial(_step_cost, state.model, index))

    def count(self, endpoint: str, status: int, turn: Any) -> None:
        """Count one request that has ended (``turn``: its :class:`~mlxchat.server.turns.Turn`, if any)."""
        self.requests.labels(endpoint, str(status)).inc()
        if turn is None:
            return
        if turn.reports:
            self.prompt_tokens.labels(endpoint).inc(turn.reports[0].prompt_tokens)
            self.cached_tokens.labels(endpoint).inc(turn.reports[0].cached_prompt_tokens)
            self.generated_tokens.labels(endpoint).inc(sum(r.generated_tokens for r in turn.reports))
        if turn.first_token_seconds is not None:
            self.first_token.labels(endpoint).observe(turn.first_token_seconds)
        gaps = self.token_gap.labels(endpoint)
        for gap in turn.token_gaps:
            gaps.observe(gap)

    def watch_step(self, items: list[Any]) -> None:
        """Observe one step of the model's worker (a :attr:`~mlxchat.worker.Worker.step_watchers` entry)."""
        rows = sum(isinstance(item, DecodeRow) for item in items)
        if rows:
            self.decode_rows.observe(rows)
        prefilled = sum(item.ran for item in items if isinstance(item, PrefillChunk))
        if prefilled:
            self.prefill_tokens.observe(prefilled)

    def page(self) -> tuple[bytes, str]:
        """The text a scraper reads, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _step_cost(model: Any, part: int) -> float:
    pace = getattr(model, "step_pace", None)
    known = pace.known if pace is not None else None
    return known[part] if known is not None else math.nan
