"""Rank 0's word to the other ranks: small messages carried by ``all_sum`` (the others add zeros) on the model's
worker thread, in program order with the forward passes, so a message and the collectives around it are
always met in the same order on every rank.

A message is a header ``[kind, bytes]`` and, for a job, its JSON. Rank 0 never waits for its own messages;
the others wait for each one. The kinds: a job (generate, logits, a cache call, close); at every cancel
check of a generation, whether to go on or stop; and the end of a generation rank 0 left early (its reader
stopped), which the others meet at their next check.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DistributedError
from ..worker import Cancelled

CONTINUE, CANCEL, END, JOB = 1, 2, 3, 4


class LeaderEnded(BaseException):  # noqa: N818 - not an error: unwinds a follower's generation past its handlers
    """Rank 0's generation ended before this rank's copy of it reached its end."""


class Channel:
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.leads = group.rank() == 0
        self._recent: deque[mx.array] = deque(maxlen=16)  # posted messages, alive until sent

    def post(self, kind: int, payload: dict[str, Any] | None = None, *, wait: bool = False) -> None:
        """Rank 0: send a message to every other rank."""
        data = json.dumps(payload).encode() if payload is not None else b""
        header = mx.distributed.all_sum(mx.array([kind, len(data)], mx.int32), group=self.group)
        # One evaluation per collective: MLX may order independent collectives of one evaluation either way.
        self._run(header, wait)
        if data:
            self._run(mx.distributed.all_sum(mx.array(np.frombuffer(data, np.uint8)), group=self.group), wait)

    def _run(self, message: mx.array, wait: bool) -> None:
        if wait:
            mx.eval(message)
        else:
            mx.async_eval(message)
            self._recent.append(message)

    def take(self) -> tuple[int, Any]:
        """Another rank: the next message from rank 0 (waits for it)."""
        header: list[int] = mx.distributed.all_sum(mx.zeros((2,), mx.int32), group=self.group).tolist()  # type: ignore[assignment]
        kind, size = header
        if not size:
            return kind, None
        data = mx.distributed.all_sum(mx.zeros((int(size),), mx.uint8), group=self.group)
        return int(kind), json.loads(np.array(data).tobytes())


class LeaderCancel(Cancelled):
    """Rank 0's cancel flag: each :meth:`check` also tells the other ranks whether the generation goes on;
    ``bool()`` is what the last check told them (no message: reading it again keeps the ranks in step)."""

    def __init__(self, cancel: Cancelled, channel: Channel):
        super().__init__()
        self._cancel, self._channel = cancel, channel
        self._said = False

    def set(self) -> None:
        self._cancel.set()

    def check(self) -> bool:
        self._said = bool(self._cancel)
        self._channel.post(CANCEL if self._said else CONTINUE)
        return self._said

    def __bool__(self) -> bool:
        return self._said


class FollowerCancel(Cancelled):
    """Another rank's cancel flag: each :meth:`check` is rank 0's answer at the same check; ``bool()`` is
    the last answer."""

    def __init__(self, channel: Channel):
        super().__init__()
        self._channel = channel
        self._said = False

    def check(self) -> bool:
        kind, _ = self._channel.take()
        if kind == END:
            raise LeaderEnded
        if kind not in (CONTINUE, CANCEL):
            raise DistributedError(f"rank {self._channel.group.rank()} lost step with rank 0 (message {kind} "
                                   "during a generation)")
        self._said = kind == CANCEL
        return self._said

    def __bool__(self) -> bool:
        return self._said
