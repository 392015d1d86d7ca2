"""What a server's routes share: the model, the settings, the cache pool, the response store and the queue."""

from __future__ import annotations

from pathlib import Path

from ..model import GenerativeModel
from .errors import ApiError, RefusalLog
from .guard import ServerSettings
from .pool import CachePool
from .store import ResponseStore


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
    """What the routes share: the model, its settings, the cache pool, the response store and the length of
    the generation queue."""

    def __init__(self, model: GenerativeModel, settings: ServerSettings):
        self.model = model
        self.settings = settings
        self.name = settings.model_name or served_name(model)
        store = settings.store if settings.store == ":memory:" else Path(settings.store).expanduser()
        self.store = ResponseStore(store)
        self.pool = CachePool(model, settings.caches, settings.max_cache_bytes, settings.spill_dir,
                              int(settings.max_spill_gb * 1e9))
        self.refusals = RefusalLog()
        self.queued = 0

    def admit(self) -> None:
        """Count a generation request in, or refuse it (429) when the queue is full."""
        if self.queued >= self.settings.max_queue:
            raise ApiError(429, f"{self.queued} requests are already running or waiting for the model (the limit); "
                                "retry later", "rate_limit_error", code="queue_full")
        self.queued += 1

    def close(self) -> None:
        self.pool.close()
        self.store.close()
