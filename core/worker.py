"""The model's single worker thread: all MLX work of one model runs there, one job at a time, in FIFO order.

Blocking callers wait on a future; streaming callers read a queue the job fills; asyncio callers await
without blocking the event loop. A stream's consumer that stops reading sets the job's cancel flag; the
job (which checks it between items) winds up at its next item.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


class Cancelled:
    """A cancel flag shared by a job and whoever may stop it."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Worker:
    """One thread that runs jobs in submission order."""

    def __init__(self, name: str = "mlxchat-worker"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread_ident: int | None = None
        self._executor.submit(self._remember_thread).result()

    def _remember_thread(self) -> None:
        import mlx.core as mx

        self._thread_ident = threading.get_ident()
        # MLX streams belong to threads: the worker gets its own default stream.
        mx.set_default_stream(mx.new_stream(mx.default_device()))

    @property
    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread_ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._executor.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the worker and wait for its result (inline when already on the worker)."""
        if self.on_worker:
            return fn(*args)
        return self.submit(fn, *args).result()

    async def arun(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def stream(self, produce: Callable[[Cancelled], Iterator[T]]) -> Iterator[T]:
        """Run the generator ``produce(cancel)`` on the worker; yield its items here as they come.

        Stopping early (``break``, ``close()``) sets ``cancel``, which ``produce`` must check between items,
        and waits for the job to wind up, so whatever it commits on its way out is in place on return.
        """
        if self.on_worker:
            yield from produce(Cancelled())
            return
        items: queue.Queue[Any] = queue.Queue()
        cancel = Cancelled()
        job = self.submit(_pump, produce, cancel, items.put)
        try:
            while True:
                item = items.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            cancel.set()
            job.result()

    async def astream(self, produce: Callable[[Cancelled], Iterator[T]]) -> AsyncIterator[T]:
        """:meth:`stream` for asyncio: items arrive through the event loop, which never blocks."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        cancel = Cancelled()
        job = self.submit(_pump, produce, cancel, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while True:
                item = await items.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            cancel.set()
            await asyncio.wrap_future(job)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _pump(produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled, put: Callable[[Any], Any]) -> None:
    try:
        iterator = produce(cancel)
        try:
            for item in iterator:
                put(item)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
    except BaseException as exc:  # delivered to the consumer, never lost on the worker
        put(_Failure(exc))
    finally:
        put(_DONE)
