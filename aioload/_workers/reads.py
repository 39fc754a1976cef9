"""Reads in a worker process: ``await dataset.read(i)`` on the worker's own event loop.

Why here and not on the engine's loop in the training process: every read there costs that
process CPU and holds its GIL -- aiofiles' three executor hops per file, pickling the bytes
for a worker, parsing HTTP -- which is time the training loop cannot launch kernels
(docs/overhead.md measured 0.26-0.34 ms of main-process CPU per image for the split protocol
on local files and 0.38-0.63 ms behind HTTP, against torch's 0.03-0.04). With the reads in
the workers the training process sends indices and receives slots, as for ``ImageFolder``.

Each worker runs one event loop in a thread of its own (``aioload-worker-loop``), beside the
thread that decodes. A task's reads are started as soon as the task arrives -- also while the
worker is still decoding the task before it -- so that reads and decoding overlap as they do
with the engine's loop; a task whose every item ``read_nowait`` has at hand (a local file)
does not touch the loop at all. At most ``limit`` reads are in flight per worker, each within
``read_timeout``: the loader's ``io_concurrency`` split across its workers, or, with
``io_concurrency="auto"``, a limit that starts at this worker's share of
:data:`~aioload._data.reads.START_IO` and doubles while the worker's decoding waits for reads held
at the limit (:func:`~aioload._data.reads.next_limit`), up to its share of
:data:`~aioload._data.reads.MAX_IO`. How long the decoding waited, and how long of that the limit
held the reads, goes back with each task's reply (:class:`~aioload._workers.messages.ReadReport`).

The reads go through the one read core, :class:`aioload._data.reads.BatchReads`, as on the engine's
loop and on an executor. A read that fails comes back as a :class:`~aioload._data.reads.FailedRead`
with the note ``while reading dataset index i (path) in an aioload worker``; the worker reports
it like a failed decode, with the stage ``"read"``, so ``on_error="skip"`` and the consumer's
error look as they do for a read on the engine's loop. When the epoch ends early (``break``),
the pool tells the worker to cancel the reads in flight (:meth:`WorkerReads.cancel`): each
becomes a failed read, its task is answered at once, and the worker stays for the next epoch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Callable

from aioload._data.limiter import Limiter
from aioload._data.reads import NOT_READY, BatchReads, FailedRead, StallMeter, Watch, next_limit

__all__ = ["CLOSE_GRACE", "FailedRead", "WorkerLoop", "WorkerReads"]

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

CLOSE_GRACE = 1.0
"""How long a stopping worker waits for its loop's thread (a read stuck for good keeps it)."""


class _Reading(Watch):
    """The indices whose read has started and not ended (written by the loop's thread), and
    the task the decoding thread waits for: while it waits, each read of that task that ends
    moves the worker's progress cell on to the next one still being read."""

    __slots__ = ("indices", "awaited")

    def __init__(self):
        self.indices: set = set()
        self.awaited: tuple[list, Callable] | None = None  # (indices, mark) while the decoding waits

    def started(self, index) -> None:
        self.indices.add(index)

    def ended(self, index) -> None:
        self.indices.discard(index)
        awaited = self.awaited
        if awaited is not None:
            indices, mark = awaited
            mark(self.first_reading(indices))

    def first_reading(self, indices: list):
        """The first of ``indices`` still being read, else ``None``."""
        reading = self.indices
        return next((index for index in indices if index in reading), None)


class WorkerLoop:
    """An event loop in a thread of a worker's own (``thread_name``), beside the thread that
    decodes: started with the worker, closed with it. ``_setup`` runs on the loop's thread
    before the loop does."""

    thread_name = "aioload-worker-loop"

    def __init__(self):
        self._loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="aioload-worker-io")
        self._loop.set_default_executor(self._executor)
        started = threading.Event()
        # A daemon thread: a read stuck for good (a hung network mount) must not keep the
        # worker process alive once it is told to stop; close() joins it within CLOSE_GRACE.
        self._thread = threading.Thread(target=self._run, args=(started,), name=self.thread_name, daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._setup()
        self._loop.call_soon(started.set)
        self._loop.run_forever()

    def _setup(self) -> None:
        pass

    def close(self) -> None:
        """Cancel what still runs on the loop, close its sessions (``shutdown_asyncgens``
        ends each loop-scoped HTTP session, see :mod:`aioload._storage.scope`) and stop the thread."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._wind_down(), self._loop).result(CLOSE_GRACE + 4.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a stuck read: the process is about to exit anyway
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_GRACE)
        if not self._thread.is_alive():
            self._loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _wind_down(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_GRACE)
        await self._loop.shutdown_asyncgens()


class WorkerReads(WorkerLoop):
    """One worker's event loop for ``dataset.read``: started with the worker, closed with it.
    ``limit``: reads in flight at first; ``ceiling``: how far the limit may grow (``limit``
    itself: a fixed limit)."""

    def __init__(self, dataset, limit: int, read_timeout: float | None, ceiling: int | None = None):
        self.dataset = dataset
        self.limit = max(1, limit)  # reads in flight in this worker, as the decoding thread last set it
        self.ceiling = max(self.limit, ceiling or self.limit)
        self.read_timeout = read_timeout
        self._watch = _Reading()
        self.meter = StallMeter()  # for the whole life of the worker
        self._core: BatchReads | None = None  # made on the loop, by its thread
        self._bound: Limiter | None = None  # the core's bound on reads in flight, made with it
        self._generation = 0  # cancel() counts up: reads started before it are not begun
        super().__init__()

    def _setup(self) -> None:
        self._bound = Limiter(self.limit)
        self._core = BatchReads(self.dataset, bound=self._bound, read_timeout=self.read_timeout,
                                place=" in an aioload worker", watch=self._watch, meter=self.meter)

    def start(self, indices: list) -> concurrent.futures.Future:
        """Start reading ``indices``; the future's result is ``(raws, latencies, nbytes)``:
        each index's raw item (a :class:`FailedRead` where its read failed), in order, and the
        seconds each real read took and the bytes they returned."""
        at_hand = self._core.at_hand(indices)  # in this thread: no trip through the loop
        if not any(raw is NOT_READY for raw in at_hand):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((at_hand, [], 0))
            return done
        return asyncio.run_coroutine_threadsafe(self._read(indices, at_hand, self._generation), self._loop)

    def wait(self, indices: list, reading: concurrent.futures.Future, mark: Callable) -> tuple:
        """``reading``'s result (from :meth:`start` for ``indices``), waited for by the thread
        that decodes: while it waits, ``mark`` is told the first of ``indices`` still being
        read (the worker's progress cell, which names a stuck sample), again each time one of
        them ends. Returns ``(raws, latencies, nbytes, waited_s, limited_s)``: how long it
        waited, and for how much of that reads were queued behind the limit."""
        if reading.done():
            return (*reading.result(), 0.0, 0.0)
        watch = self._watch
        started, bound0 = time.perf_counter(), self._bound.bound_seconds()
        watch.awaited = (indices, mark)
        try:
            mark(watch.first_reading(indices))
            raws, latencies, nbytes = reading.result()
        finally:
            watch.awaited = None
        return raws, latencies, nbytes, time.perf_counter() - started, self._bound.bound_seconds() - bound0

    def adapt(self, waited_s: float, limited_s: float) -> int:
        """The limit after a task whose decoding waited ``waited_s`` for its reads, of which
        ``limited_s`` behind the limit (:func:`~aioload._data.reads.next_limit`); changed on the
        loop's thread."""
        limit = next_limit(self.limit, self.ceiling, waited_s, limited_s)
        if limit != self.limit:
            self.limit = limit
            self._loop.call_soon_threadsafe(self._bound.set_limit, limit)
        return limit

    async def _read(self, indices: list, at_hand: list, generation: int) -> tuple[list, list, int]:
        if generation != self._generation:  # cancel() came after start() but before this began
            return self._core.abandon(indices, at_hand)
        return await self._core.read(indices, at_hand)

    def cancel(self) -> None:
        """Cancel the reads of every task started so far (not of those started after this
        call); called by the thread that calls :meth:`start`."""
        self._generation += 1
        try:
            self._loop.call_soon_threadsafe(self._core.cancel)
        except RuntimeError:
            pass  # the loop is closed: nothing is in flight
