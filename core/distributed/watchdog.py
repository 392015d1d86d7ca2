"""Rank 0's bound on waiting for the other ranks.

MLX's collectives have no timeout. When a rank dies, MLX's ring backend fails the first collective or two
that reach its closed connection, and every later one waits for ever (measured with mlx 0.32.4: the
threads that serve a connection stop at its first errors); one step of a tensor-parallel forward holds
dozens of collectives, so rank 0 would hang. A rank that stops answering (a frozen process, a lost host)
holds rank 0 the same way, connections open. So rank 0 gives the group ``timeout`` seconds per step: a
:class:`Watchdog` counts from the last completed step (or the start of the job) while rank 0 works with
the group, never while it waits for its own reader or for work; past the deadline it calls ``expire``
once, on its own thread (the model fails its jobs and closes the group).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEFAULT_TIMEOUT = 120.0
"""Seconds rank 0 waits for one step of the group (a decode step, a prefill chunk, a logits pass)."""


class Watchdog:
    def __init__(self, timeout: float, expire: Callable[[], None]):
        self.timeout = timeout
        self._expire = expire
        self._since: float | None = None  # None: rank 0 is not waiting for the group
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="mlxchat-distributed-watchdog", daemon=True).start()

    def arm(self) -> None:
        """Rank 0 works with the group from now on (a job starts, or a step completed and the next begins)."""
        self._since = time.monotonic()

    def disarm(self) -> None:
        """Rank 0 waits for nothing from the group (its reader has the last token, or the job ended)."""
        self._since = None

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        # A wait that began before the deadline was armed ends before it: no wake-up is needed at arm().
        while True:
            since = self._since
            left = self.timeout if since is None else since + self.timeout - time.monotonic()
            if since is not None and left <= 0 and self._since == since:  # no step completed meanwhile
                self._expire()
                return
            if self._stopped.wait(left):
                return
