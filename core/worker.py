"""The model's single worker thread: all MLX work of one model runs there, one job at a time, in FIFO order.

Blocking callers wait on a future; streaming callers read a queue the job fills; asyncio callers await
without blocking the event loop. A stream's consumer that stops reading sets the job's cancel flag; the
job (which checks it between items) winds up at its next item. A consumer that neither reads nor stops
(a half-read stream left open) holds the worker only until another job is waiting and
:attr:`Worker.reader_timeout` has passed; then its stream ends with :class:`ReaderStalledError`.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import MlxchatError

T = TypeVar("T")

END = object()
"""The last item a :class:`StreamJob` hands over."""
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


class ReaderStalledError(MlxchatError):
    """A stream's reader stopped taking items while other work waited for the model's worker."""


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Worker:
    """One daemon thread that runs jobs in submission order.

    MLX keeps per-thread stream state that must be released on the thread itself before the interpreter
    shuts down (``mx.clear_streams``), so the worker does that when it stops, and an exit hook stops
    every live worker and then clears the main thread's streams.
    """

    reader_timeout = 30.0
    """Seconds a stream's job waits for its reader to take an item while other jobs wait behind it."""

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

        from .kernels import flush_denormals

        # MLX streams belong to threads: the worker gets its own default stream, whose CPU thread flushes
        # denormal floats to zero (they cost ~100x on x86; see mlxchat.kernels.flush_denormals).
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        flush_denormals()
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

    def start(self, produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled,
              put: Callable[[Any], Any]) -> StreamJob:
        """Run the generator ``produce(cancel)`` on the worker, handing its items to ``put`` one at a time
        (see :class:`StreamJob`); for readers that need the job itself (to stop it from a finalizer)."""
        return StreamJob(self, produce, cancel, put)

    def stream(self, produce: Callable[[Cancelled], Iterator[T]],
               cancel: Cancelled | None = None) -> Generator[T, None, None]:
        """Run the generator ``produce(cancel)`` on the worker; yield its items here as they come.

        The job runs at most one item ahead of the reader, so what the reader has seen is what was
        produced, give or take one. Stopping early (``break``, ``close()``) sets ``cancel``, which
        ``produce`` must check between items, and waits for the job to wind up, so whatever it commits on
        its way out is in place on return.
        """
        cancel = Cancelled() if cancel is None else cancel
        if self.on_worker:
            yield from produce(cancel)
            return
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        job = self.start(produce, cancel, items.put)
        try:
            while (item := job.received(items.get())) is not END:
                yield item
        finally:
            job.stop()

    async def astream(
        self, produce: Callable[[Cancelled], Iterator[T]], cancel: Cancelled | None = None
    ) -> AsyncGenerator[T, None]:
        """:meth:`stream` for asyncio: items arrive through the event loop, which never blocks."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        job = self.start(produce, Cancelled() if cancel is None else cancel,
                         lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while (item := job.received(await items.get())) is not END:
                yield item
        finally:
            await job.astop()

    def _stalled(self, waited: float) -> bool:
        """Whether a job whose reader has taken nothing for ``waited`` seconds should give up the worker."""
        return waited > self.reader_timeout and not self._jobs.empty()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            if not self.on_worker:
                self._thread.join()


class StreamJob:
    """A generator job on the worker whose items go to one reader, at most one item ahead of it.

    The reader passes every item it takes through :meth:`received` (which re-raises the job's failure) until
    it gets :data:`END`; a reader that stops early calls :meth:`stop` (blocking, for finalizers and sync
    code) or :meth:`astop`, which cancels the job and waits for it to wind up, or drops it if it has not
    started."""

    def __init__(self, worker: Worker, produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled,
                 put: Callable[[Any], Any]):
        self.cancel = cancel
        self._handoff = _Handoff(put, worker._stalled)
        self._future = worker.submit(_pump, produce, cancel, self._handoff)

    def received(self, item: Any) -> Any:
        self._handoff.taken()
        if isinstance(item, _Failure):
            raise item.error
        return item

    def _abandon(self) -> bool:
        """Tell the job its reader has gone; True when it never started (nothing to wait for)."""
        self._handoff.abandon()
        self.cancel.set()
        return self._future.cancel()

    def stop(self) -> None:
        if not self._abandon():
            self._future.result()

    async def astop(self) -> None:
        if not self._abandon():
            await asyncio.wrap_future(self._future)


class _Handoff:
    """Passes items from the job to the reader, one at a time; drops them once the reader has gone, and
    gives up (raising :class:`ReaderStalledError` in the job) when ``stalled`` says the wait is too long."""

    def __init__(self, put: Callable[[Any], Any], stalled: Callable[[float], bool]):
        self._put = put
        self._stalled = stalled
        self._slot = threading.Semaphore(1)
        self._abandoned = threading.Event()
        self._gave_up = False

    def put(self, item: Any) -> None:
        started = time.monotonic()
        while not self._gave_up and not self._slot.acquire(timeout=0.05):
            if self._abandoned.is_set():
                return
            if self._stalled(time.monotonic() - started):
                self._gave_up = True
                raise ReaderStalledError(
                    "the stream's reader took nothing for a while and other work was waiting for the model, so "
                    "the stream was ended; read streams to the end, or break out of them (or close them)"
                )
        self._put(item)

    def taken(self) -> None:
        self._slot.release()

    def abandon(self) -> None:
        self._abandoned.set()


def _pump(produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled, handoff: _Handoff) -> None:
    try:
        iterator = produce(cancel)
        try:
            for item in iterator:
                handoff.put(item)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
    except BaseException as exc:  # delivered to the consumer, never lost on the worker
        handoff.put(_Failure(exc))
    finally:
        handoff.put(END)
