"""The model's single worker thread: all MLX work of one model runs there, one job at a time, in FIFO order.

Blocking callers wait on a future; streaming callers read a queue the job fills; asyncio callers await
without blocking the event loop. A stream's consumer that stops reading sets the job's cancel flag; the
job (which checks it between items) winds up at its next item.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()
_live: weakref.WeakSet[Worker] = weakref.WeakSet()


@atexit.register
def _shutdown() -> None:
    import mlx.core as mx

    for worker in list(_live):
        worker.close()
    mx.clear_streams()


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
    """One daemon thread that runs jobs in submission order.

    MLX keeps per-thread stream state that must be released on the thread itself before the interpreter
    shuts down (``mx.clear_streams``), so the worker does that when it stops, and an exit hook stops
    every live worker and then clears the main thread's streams.
    """

    def __init__(self, name: str = "mlxchat-worker"):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._thread.start()
        _live.add(self)

    def _loop(self) -> None:
        import mlx.core as mx

        # MLX streams belong to threads: the worker gets its own default stream.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            while (job := self._jobs.get()) is not None:
                future, fn, args = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
        finally:
            mx.clear_streams()

    @property
    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("the model's worker is closed")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

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
        """Finish the queued jobs, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            if not self.on_worker:
                self._thread.join()


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
