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
with the engine's loop. At most ``limit`` reads are in flight per worker (the loader's
``io_concurrency`` split across its workers), each within ``read_timeout``.

A read that fails comes back as a :class:`FailedRead`; the worker reports it like a failed
decode, with the stage ``"read"`` and the note ``while reading dataset index i (path)``, so
``on_error="skip"`` and the consumer's error look as they do for a read on the engine's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from aioload._engine.budget import where
from aioload._dataset import NOT_READY, Dataset
from aioload._engine.reads import raw_nbytes, read_within

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

CLOSE_GRACE = 1.0
"""How long a stopping worker waits for its loop's thread (a read stuck for good keeps it)."""


class FailedRead:
    """What a task's sample holds in place of its raw item when its read failed."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class WorkerReads:
    """One worker's event loop for ``dataset.read``: started with the worker, closed with it."""

    def __init__(self, dataset, limit: int, read_timeout: float | None):
        self.dataset = dataset
        self.limit = max(1, limit)  # reads in flight in this worker
        self.read_timeout = read_timeout
        nowait = getattr(dataset, "read_nowait", None)
        overridden = nowait is not None and getattr(nowait, "__func__", None) is not Dataset.read_nowait
        self._nowait = nowait if overridden else None
        self._describe = getattr(dataset, "describe", None)
        self._loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="aioload-worker-io")
        self._loop.set_default_executor(self._executor)
        self._slots: asyncio.Semaphore | None = None  # made on the loop, by its thread
        self._reading: set = set()  # indices whose read has started and not ended (loop thread writes)
        started = threading.Event()
        # A daemon thread: a read stuck for good (a hung network mount) must not keep the
        # worker process alive once it is told to stop; close() joins it within CLOSE_GRACE.
        self._thread = threading.Thread(target=self._run, args=(started,), name="aioload-worker-loop", daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self.limit)
        self._loop.call_soon(started.set)
        self._loop.run_forever()

    def start(self, indices: list) -> concurrent.futures.Future:
        """Start reading ``indices``; the future's result is ``(raws, latencies, nbytes)``:
        each index's raw item (a :class:`FailedRead` where its read failed), in order, and the
        seconds each real read took and the bytes they returned."""
        at_hand = self._read_nowait(indices)
        return asyncio.run_coroutine_threadsafe(self._read_all(indices, at_hand), self._loop)

    def _read_nowait(self, indices: list) -> list:
        if self._nowait is None:
            return [NOT_READY] * len(indices)
        results = []
        for index in indices:
            try:
                results.append(self._nowait(index))
            except Exception as exc:  # noqa: BLE001 - reported like a failed read
                results.append(self._failed(index, exc))
        return results

    async def _read_all(self, indices: list, at_hand: list) -> tuple[list, list, int]:
        waiting = [(pos, index) for pos, (index, raw) in enumerate(zip(indices, at_hand)) if raw is NOT_READY]
        latencies: list[float] = []
        nbytes = 0
        if waiting:
            done = await asyncio.gather(*(self._read(index) for _, index in waiting))
            for (pos, _), (raw, seconds, size) in zip(waiting, done):
                at_hand[pos] = raw
                latencies.append(seconds)
                nbytes += size
        return at_hand, latencies, nbytes

    async def _read(self, index) -> tuple:
        async with self._slots:
            started = time.perf_counter()
            self._reading.add(index)
            try:
                raw = await read_within(self.dataset, index, self.read_timeout)
            except Exception as exc:  # noqa: BLE001 - reported with the task's reply
                return self._failed(index, exc), time.perf_counter() - started, 0
            finally:
                self._reading.discard(index)
            return raw, time.perf_counter() - started, raw_nbytes(raw)

    def waiting_for(self, indices: list, default):
        """The first of ``indices`` still being read (``default`` when none is): what a task
        waits for, for the progress cell that names a stuck sample."""
        reading = self._reading
        return next((index for index in indices if index in reading), default)

    def _failed(self, index, exc: Exception) -> FailedRead:
        exc.add_note(f"while reading dataset index {index}{where(self._describe, index)}")
        return FailedRead(exc)

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

