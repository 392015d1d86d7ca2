"""What a server's routes share: the model, the settings, the cache pool, the response store and the queue."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..cache import distinct_nbytes
from ..model import GenerativeModel
from ..prompt_cache import PromptCache
from .admission import KvBudget, default_limit
from .errors import ApiError, RefusalLog
from .guard import ServerSettings
from .metrics import Metrics
from .pool import CachePool
from .store import ResponseStore


class Running(Protocol):
    """What the state reads of a running :class:`~mlxchat.server.turns.Turn` (which imports this module) or
    chat page turn (:class:`~mlxchat.server.admission.ThreadHold`)."""

    cache: PromptCache | None


def served_name(model: GenerativeModel) -> str:
    """The model id a server answers to by default: the Hub repo id of a downloaded checkpoint, else its
    folder's name (``mlxchat-demo`` for the demo model)."""
    from ..demo import MODEL_DIR

    path = model.path
    if path is None:
        return model.architecture.name
    if path.resolve() == MODEL_DIR.resolve():
        return "mlxchat-demo"
    cached = path.parent.parent.name  # <cache>/models--owner--name/snapshots/<revision>
    if path.parent.name == "snapshots" and cached.startswith("models--") and "--" in cached[8:]:
        return "/".join(cached[8:].split("--", 1))
    return path.name


class ServerState:
    """What the routes share: the model, its settings, the cache pool, the response store, the length of
    the generation queue, the cache memory admitted requests hold, and the metrics."""

    def __init__(self, model: GenerativeModel, settings: ServerSettings):
        self.model = model
        self.settings = settings
        self.name = settings.model_name or served_name(model)
        self.longest_token = model.tokenizer.longest_token()
        """Characters one token covers at most."""
        store = settings.store if settings.store == ":memory:" else Path(settings.store).expanduser()
        self.store = ResponseStore(store, max_age=settings.store_max_age_days * 86400 or None,
                                   max_rows=settings.store_max_rows or None)
        self.pool = CachePool(model, settings.caches, settings.max_cache_bytes, settings.spill_dir,
                              int(settings.max_spill_gb * 1e9))
        self.kv = KvBudget(model, int(settings.max_kv_gb * 1e9) if settings.max_kv_gb else default_limit(),
                           self.pool.prefixes)
        self.refusals = RefusalLog()
        self.queued = 0
        self.turns: set[Running] = set()
        """Turns started and not finished (the API's, and the chat page's while they run)."""
        self.metrics = Metrics(self)
        model.worker.step_watchers.append(self.metrics.watch_step)

    @property
    def running(self) -> int:
        return len(self.turns)

    @property
    def kv_live(self) -> int:
        """Bytes the caches of the running turns hold now (a prefix they share counted once)."""
        return distinct_nbytes(turn.cache.held() for turn in list(self.turns) if turn.cache is not None)

    @property
    def kv_reserved(self) -> int:
        return self.kv.reserved

    @property
    def kv_limit(self) -> int:
        return self.kv.limit

    def held(self) -> dict[str, int]:
        """What the server holds now (``GET /health`` shows it)."""
        return {"queued": self.queued, "running": self.running, "waiting_for_memory": self.kv.waiting,
                "paused_for_memory": self.kv.paused, "kv_live_bytes": self.kv_live,
                "kv_reserved_bytes": self.kv.reserved, "kv_limit_bytes": self.kv.limit, "pool_caches": len(self.pool),
                "pool_bytes": self.pool.nbytes, "page_cache_bytes": self.pool.outside_nbytes,
                "spilled_caches": self.pool.spilled}

    def admit(self) -> None:
        """Count a generation request in, or refuse it (429) when the queue is full."""
        if self.queued >= self.settings.max_queue:
            raise ApiError(429, f"{self.queued} requests are already running or waiting for the model (the limit); "
                                "retry later", "rate_limit_error", code="queue_full")
        self.queued += 1

    def release(self) -> None:
        """Count a generation request out (its :class:`~mlxchat.server.turns.Turn` has finished)."""
        self.queued -= 1

    def close(self) -> None:
        if self.metrics.watch_step in self.model.worker.step_watchers:
            self.model.worker.step_watchers.remove(self.metrics.watch_step)
        self.pool.close()
        self.store.close()
