"""The model's single worker thread: all MLX work of one model runs there.

Plain jobs (:meth:`Worker.run`, :meth:`Worker.submit`) run one at a time in submission order. Stream jobs
(generators, :meth:`Worker.start`) run side by side: the worker advances each in turn, handing every item
to the job's reader at most :data:`LEAD` items ahead of it, so a slow reader holds up only its own job. A job may
yield a :class:`Together` item instead (a decode step, a prefill chunk), or a :class:`Gathered` group of
them (a job running several generations): the worker waits until every runnable job has done so or cannot
go on, then runs one *step*: the waiting items of each kind together (a model's decode rows and prompt
chunks: one forward pass over the sequences of several jobs), and resumes their jobs. A worker made with
``side_by_side=False`` (a model split over processes, whose every step is a collective) and any worker while
:mod:`mlxchat.profiling` is on run one job at a time instead. Blocking callers wait on a future; streaming
readers read a queue the job fills; asyncio readers await without blocking the event loop. A reader that stops
reading sets the job's cancel flag; the job (which checks it between items) winds up at its next item.
A worker whose thread can never move again (a collective waiting for a process that is gone) is given up
from another thread (:meth:`Worker.fail`): its jobs end with the error instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import copy
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from . import profiling
from .errors import ModelClosedError

T = TypeVar("T")
log = logging.getLogger("mlxchat")

END = object()
"""The last item a :class:`StreamJob` hands over."""
LEAD = 2
"""Items a paced job may run ahead of its reader: one the reader takes while the step making the next one
runs. With one, a reader whose thread had not yet taken its item (the worker holds the GIL between steps)
kept its job out of the next step, so generations read from several threads seldom shared a step."""
_FAILED_JOIN = 10.0
"""Seconds :meth:`Worker.close` waits for the thread of a failed worker (:meth:`Worker.fail`), whose call into a
lost group returns once the group's connections are shut: a thread that used MLX and ends while the interpreter
shuts down aborts the process (MLX releases its per-thread state at thread exit, which needs the GIL)."""
_live: weakref.WeakSet[Worker] = weakref.WeakSet()
_IDLE_WAIT = 0.05
"""Seconds the worker sleeps at most when every job waits for its reader (a reader taking an item, a new
job or an abandoned stream wakes it at once)."""
GATHER_QUIET = 0.002
"""A worker with nothing to do that receives a stream job (a generation) waits for more jobs while they keep coming
at most this far apart (and :data:`GATHER_AT_MOST` seconds in all), so a burst (sessions sending from their threads
at once, an agent's parallel requests: all queued within a few milliseconds) starts in one step rather than the
first alone, the others then paced in beside it for seconds. A generation that comes alone starts this much later;
plain jobs, and workers that run one job at a time, do not wait."""
GATHER_AT_MOST = 0.02


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

    def check(self) -> bool:
        """Whether to stop, asked at a generation's check points (between prefill chunks, after each token).
        In a process group this is a collective every rank makes at the same points, while ``bool()`` only
        reads (see :mod:`mlxchat.distributed.channel`)."""
        return bool(self)


class Together:
    """What a stream job yields to wait for work the worker runs for several jobs at once (a decode step
    of their sequences): :meth:`run_together` gets every item of a kind waiting at that moment. When it
    fails, each item's ``error`` holds the failure and the job, resumed, raises it where it waited
    (:meth:`check`), so that the job's own error handling applies."""

    error: BaseException | None = None

    @classmethod
    def kind(cls) -> type[Together]:
        """The class whose :meth:`run_together` runs this item with the others of its kind: its own, unless
        it shares a step with other classes (a model's decode rows and prompt chunks)."""
        return cls

    @classmethod
    def run_together(cls, items: list[Any]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise the failure of the work this item waited for, if any."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class Gathered:
    """What a job yields to wait for several :class:`Together` items in one step (the generations of a batch
    job); each item joins the others of its kind."""

    def __init__(self, items: list[Together]):
        if not items:
            raise ValueError("a gathered step needs at least one item")
        self.items = items


def run_step(items: list[Together]) -> None:
    """Run one step: the items of each kind together (:meth:`Together.kind`), in the order the kinds first
    wait. A kind that fails hands its failure to each of its items (:meth:`Together.check`); the other
    kinds still run."""
    kinds: dict[type[Together], list[Together]] = {}
    for item in items:
        kinds.setdefault(item.kind(), []).append(item)
    for kind in kinds:
        try:
            kind.run_together(kinds[kind])
        except Exception as exc:  # each job raises it where it waited (Together.check)
            for item in kinds[kind]:
                item.error = exc


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Worker:
    """One daemon thread that runs a model's jobs (see the module docstring).

    MLX keeps per-thread stream state that must be released on the thread itself before the interpreter
    shuts down (``mx.clear_streams``), so the worker does that when it stops, and an exit hook stops
    every live worker and then clears the main thread's streams.
    """

    def __init__(self, name: str = "mlxchat-worker", side_by_side: bool = True):
        self.side_by_side = side_by_side
        """Whether stream jobs advance side by side (a split model's ranks take rank 0's jobs one at a time)."""
        self._later: collections.deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._tasks: list[_Task] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self.step_watchers: list[Callable[[list[Together]], None]] = []
        """Called on the worker's thread after each step with the items it ran (a server's metrics count
        the rows of its decode steps); a watcher must be quick (one that raises is logged and skipped)."""
        self._failure: BaseException | None = None
        self._settling = threading.Lock()  # jobs end once: on the thread, or all at once by fail()
        self._running: Future[Any] | None = None
        self._thread.start()
        _live.add(self)

    def _loop(self) -> None:
        import mlx.core as mx

        from .kernels import flush_denormals

        # MLX streams belong to threads: the worker gets its own default stream, whose CPU thread flushes
        # denormal floats to zero (they cost ~100x on x86; see mlxchat.kernels.flush_denormals).
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        flush_denormals()
        closing = False
        try:
            while (not closing or self._tasks or self._later) and self._failure is None:
                gather_until = None
                while not closing:
                    try:
                        if not self._tasks and not self._later:  # idle: a job, then those that follow it closely
                            job = self._jobs.get()
                            if job is not None and job[1] is _StreamTask and self.runs_side_by_side:
                                gather_until = time.perf_counter() + GATHER_AT_MOST
                        elif gather_until is not None and (left := gather_until - time.perf_counter()) > 0:
                            job = self._jobs.get(timeout=min(GATHER_QUIET, left))
                        else:
                            job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        closing = True
                        for task in self._tasks:
                            _closed_under(task.cancel, task.handoff)
                    else:
                        self._later.append(job)
                # A profiled reply is timed on this thread as a whole: replies then run one at a time.
                while self._later and (self.runs_side_by_side or not self._tasks):
                    self._start_job(*self._later.popleft())
                if not self._advance() and self._tasks:
                    self._wake.wait(_IDLE_WAIT)
                    self._wake.clear()
        finally:
            mx.clear_streams()

    def _start_job(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self._settling:
            if future.done() or not future.set_running_or_notify_cancel():  # cancelled, or ended by fail()
                return
            if self._failure is not None:
                _give_up(future, args[2] if fn is _StreamTask else None, self._failure)
                return
            if fn is _StreamTask:
                task = _Task(future, args[2], args[1])
                self._tasks.append(task)
            else:
                self._running = future
        if fn is _StreamTask:
            produce, cancel, handoff = args
            if self._closed:
                _closed_under(cancel, handoff)
            try:
                task.iterator = produce(cancel)
            except BaseException as exc:  # delivered to the reader, never lost on the worker
                self._end(task, exc)
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to whoever waits on the future
            with self._settling:
                if not future.done():
                    future.set_exception(exc)
        else:
            with self._settling:
                if not future.done():
                    future.set_result(result)
        self._running = None

    def _advance(self) -> bool:
        """Advance every stream job as far as its reader allows, then run what waits together; whether
        anything moved."""
        moved = False
        for task in list(self._tasks):
            while task.waiting is None and task.handoff.ready() and task in self._tasks:
                self._resume(task)
                moved = True
        waiting = [task for task in self._tasks if task.waiting is not None]
        items = [item for task in waiting for item in task.waiting or ()]  # in the jobs' order: FIFO
        for task in waiting:
            task.waiting = None
        if items:
            run_step(items)
            for watch in tuple(self.step_watchers):
                try:
                    watch(items)
                except Exception:  # noqa: BLE001 - an observer never stops the model's work
                    log.exception("a step watcher failed")
        return moved or bool(waiting)

    def _resume(self, task: _Task) -> None:
        """Run a job to its next item: hand it to the reader, or keep the job waiting for a step."""
        try:
            item = next(task.iterator)
        except StopIteration:
            self._end(task, None)
            return
        except BaseException as exc:  # delivered to the reader, never lost on the worker
            self._end(task, exc)
            return
        if isinstance(item, Together):
            task.waiting = [item]
        elif isinstance(item, Gathered):
            task.waiting = item.items
        else:
            task.handoff.put(item)

    def _end(self, task: _Task, error: BaseException | None) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        close = getattr(task.iterator, "close", None)
        if close is not None and error is not None:
            try:
                close()
            except BaseException:  # noqa: BLE001 - the first failure is the one to report
                pass
        with self._settling:
            if task.future.done():  # ended by fail()
                return
            if error is not None:
                task.handoff.put_last(_Failure(error))
            task.handoff.put_last(END)
            task.future.set_result(None)

    def wake(self) -> None:
        """Wake the worker's thread from an idle wait (what a waiting job waits for may have changed: memory
        given back)."""
        self._wake.set()

    def idle(self, seconds: float) -> None:
        """On the worker's thread, in a step with nothing to run: wait at most ``seconds`` for something to
        change (a reader taking an item, a new job, :meth:`wake`)."""
        self._wake.wait(seconds)
        self._wake.clear()

    @property
    def runs_side_by_side(self) -> bool:
        """Whether stream jobs start as they come and advance together now (not while :mod:`mlxchat.profiling`
        is on, nor on a worker made with ``side_by_side=False``): only then may a job wait for another's."""
        return self.side_by_side and not profiling.enabled

    @property
    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._failure is not None:
            raise copy.copy(self._failure)
        if self._closed:
            raise ModelClosedError("the model is closed: load it again to use it")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        self._wake.set()
        return future

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the worker and wait for its result (inline when already on the worker)."""
        if self.on_worker:
            return fn(*args)
        return self.submit(fn, *args).result()

    async def arun(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def start(self, produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled,
              put: Callable[[Any], Any], *, paced: bool = True) -> StreamJob:
        """Run the generator ``produce(cancel)`` on the worker beside other stream jobs, handing its items to
        ``put`` one at a time (see :class:`StreamJob`). ``paced=False``: the job never waits for its reader
        (for a reader that takes every item to the end, as a blocking call does: pacing would only keep the
        job out of the steps its reader's thread is too slow to ask for)."""
        return StreamJob(self, produce, cancel, put, paced=paced)

    def stream(self, produce: Callable[[Cancelled], Iterator[T]],
               cancel: Cancelled | None = None, *, paced: bool = True) -> Generator[T, None, None]:
        """Run the generator ``produce(cancel)`` on the worker; yield its items here as they come.

        The job runs at most :data:`LEAD` items ahead of the reader (unless ``paced=False``: see
        :meth:`start`), so what the reader has seen is what was produced, give or take that many. Stopping
        early (``break``, ``close()``) sets ``cancel``, which ``produce`` must check between items, and waits
        for the job to wind up, so whatever it commits on its way out is in place on return.
        """
        cancel = Cancelled() if cancel is None else cancel
        if self.on_worker:  # nothing runs beside a job started from the worker itself
            for item in produce(cancel):
                if isinstance(item, Together | Gathered):
                    run_step(item.items if isinstance(item, Gathered) else [item])  # the job raises a failure
                else:
                    yield item
            return
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        job = self.start(produce, cancel, items.put, paced=paced)
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

    def close(self) -> None:
        """Finish the queued jobs (stream jobs lose their readers), then stop the thread. A failed worker's
        thread is waited for :data:`_FAILED_JOIN` seconds at most (it ends once the call it was in returns)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._wake.set()
            if not self.on_worker:
                self._thread.join()
        elif self._failure is not None and not self.on_worker:
            self._thread.join(_FAILED_JOIN)

    def fail(self, error: BaseException) -> None:
        """Give up on this worker, from any thread, when its thread may never move again (a model split over
        processes whose collective waits for a rank that is gone; see :mod:`mlxchat.distributed`): the job it
        runs and every job it holds end with ``error``, later ones are refused with it, and :meth:`close` waits
        for the thread :data:`_FAILED_JOIN` seconds at most. The thread is left where it is (a daemon, which the
        interpreter does not wait for); should it move again, it ends nothing twice and stops."""
        with self._settling:
            if self._failure is not None:
                return
            self._failure, self._closed = error, True
            queued = list(self._later)
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    queued.append(job)
            held = [(future, args[2] if fn is _StreamTask else None) for future, fn, args in queued]
            held += [(task.future, task.handoff) for task in self._tasks]
            if self._running is not None:
                held.append((self._running, None))
            for future, handoff in held:
                _give_up(future, handoff, error)
        self._jobs.put(None)
        self._wake.set()


class _StreamTask:
    """The marker of a stream job in the worker's queue (its arguments: produce, cancel, handoff)."""


def _give_up(future: Future[Any], handoff: _Handoff | None, error: BaseException) -> None:
    """End a job of a worker given up (:meth:`Worker.fail`): a stream job's reader gets ``error`` through its
    ``handoff`` (and its ``stop()`` returns), a plain job's caller through the future."""
    if handoff is not None:
        handoff.fail(error)
    if future.done():
        return
    if handoff is not None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _closed_under(cancel: Cancelled, handoff: _Handoff) -> None:
    """A stream job the worker's closing catches: it stops at its next check, and its reader gets an error
    rather than waiting for items that will not come."""
    cancel.set()
    handoff.fail(ModelClosedError("the model was closed while this reply streamed"))


class _Task:
    def __init__(self, future: Future[Any], handoff: _Handoff, cancel: Cancelled):
        self.future = future
        self.handoff = handoff
        self.cancel = cancel
        self.iterator: Iterator[Any] = iter(())
        self.waiting: list[Together] | None = None


class StreamJob:
    """A generator job on the worker whose items go to one reader, at most :data:`LEAD` items ahead of it
    (unless it is not ``paced``).

    The reader passes every item it takes through :meth:`received` (which re-raises the job's failure) until
    it gets :data:`END`; a reader that stops early calls :meth:`stop` (blocking, for sync code) or
    :meth:`astop`, which cancels the job and waits for it to wind up, or drops it if it has not started, or
    :meth:`stop_soon`, which waits for nothing."""

    def __init__(self, worker: Worker, produce: Callable[[Cancelled], Iterator[Any]], cancel: Cancelled,
                 put: Callable[[Any], Any], *, paced: bool = True):
        self.cancel = cancel
        self._handoff = _Handoff(put, worker._wake, cancel, paced)
        self._future = worker.submit(_StreamTask, produce, cancel, self._handoff)

    def received(self, item: Any) -> Any:
        if isinstance(item, _Failure):
            raise item.error
        if item is not END:
            self._handoff.taken()
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

    def stop_soon(self, then: Callable[[], None]) -> None:
        """Tell the job its reader has gone without waiting: ``then`` runs once the job has wound up (at once
        when it never started, else on the worker's thread), so an event loop never waits for the worker."""
        self._abandon()
        self._future.add_done_callback(lambda _: then())


class _Handoff:
    """Passes a job's items to its reader, at most :data:`LEAD` ahead when ``paced``; drops them once the
    reader has gone."""

    def __init__(self, put: Callable[[Any], Any], wake: threading.Event, cancel: Cancelled, paced: bool = True):
        self._put = put
        self._wake = wake
        self._cancel = cancel
        self._paced = paced
        self._lock = threading.Lock()
        self._ahead = 0
        self._abandoned = False

    def ready(self) -> bool:
        """Whether the job may produce its next item (the reader is fewer than :data:`LEAD` behind, or has
        gone, or the job is not paced)."""
        with self._lock:
            return self._abandoned or not self._paced or self._ahead < LEAD

    def put(self, item: Any) -> None:
        with self._lock:
            if self._abandoned:
                return
            self._ahead += 1
        self._send(item)

    def put_last(self, item: Any) -> None:
        """The job's end (or failure): handed over whatever the reader has taken."""
        if not self._abandoned:
            self._send(item)

    def fail(self, error: BaseException) -> None:
        """End the job with ``error`` from another thread (:meth:`Worker.fail`); what it hands over later is
        dropped."""
        with self._lock:
            if self._abandoned:
                return
            self._abandoned = True
        self._send(_Failure(error))
        self._send(END)

    def _send(self, item: Any) -> None:
        """Hand ``item`` to the reader. A reader that cannot take it (an asyncio reader whose event loop has
        closed) has gone, and its job stops at its next check: the failure must not end the worker's thread,
        which every other job of the model waits on."""
        try:
            self._put(item)
        except Exception:  # noqa: BLE001 - nobody is left to tell
            self.abandon()
            self._cancel.set()

    def taken(self) -> None:
        with self._lock:
            self._ahead = max(0, self._ahead - 1)
        self._wake.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
        self._wake.set()
