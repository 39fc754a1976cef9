"""The sync/async front end of one epoch: the iterator starts the epoch at its first ``next()``
and takes finished batches from the ready queue for ``for`` or ``async for``; dropping it,
``break``, an exception or Ctrl-C stops the engine."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import anyio

from aioload import _device
from aioload._compat import WAITING, WAITING_ASYNC, _len_called, _warn_iterable_length, profiled
from aioload._errors import DataLoaderTimeoutError, LoaderClosedError
from aioload._inprocess import _AllSkipped, _decode_in_process
from aioload._ready import EndOfEpoch
from aioload._spec import Failure, Ready, _Cancelled

if TYPE_CHECKING:
    from aioload._engine import Engine
    from aioload._loader import DataLoader
    from aioload._ready import ReadyQueue
    from aioload._resources import _Resources

_END = object()


class _NotYet(Exception):
    """Nothing is ready yet (the async consumer then waits for a wake-up)."""


class _Iterator:
    """One epoch, as seen by the training loop (``for`` or ``async for``)."""

    def __init__(self, loader: DataLoader):
        self._loader = loader
        self._engine: Engine | None = None  # set, with what follows, by the first next()
        self._ready: ReadyQueue | None = None
        self._transfer = None
        self._timeout: float | None = None
        self._done = False
        self._yielded = 0
        self._len_called: int | None = None
        self._batches: int | None = None  # the epoch's batches, where the sampler knows them
        self._state = {"exhausted": False}
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        """The epoch starts at the first ``next()``, not at ``iter()``: frameworks make an
        iterator to probe a loader and drop it, and that must start no process or thread."""
        loader = self._loader
        self._len_called = _len_called(loader)
        self._timeout = loader.timeout or None
        self._batches = None if loader._iterable else len(loader)
        self._engine, self._ready, self._transfer = loader._start_engine(self._state)
        self._finalizer = weakref.finalize(
            self, _abandon_epoch, self._engine, loader._res, self._state, loader.persistent_workers
        )

    def __iter__(self) -> "_Iterator":
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _end(self, exhausted: bool = False) -> None:
        self._done = True
        self._state["exhausted"] = exhausted
        if self._finalizer is not None:
            self._finalizer()

    def _take(self, get=None, started: float | None = None):
        """Block until the next item (or, with ``get``, take it without blocking); returns
        ``(item, seconds waited)``."""
        if self._done:
            raise StopIteration
        if started is None:
            started = time.perf_counter()
        try:
            item, owed = get() if get is not None else self._ready.get(timeout=self._timeout)
        except _NotYet:
            raise
        except EndOfEpoch:
            self._loader._epoch_ends(time.perf_counter() - started)
            self._end(exhausted=True)
            raise StopIteration from None
        except TimeoutError:
            raise _timed_out(self._engine, self._timeout) from None
        except _Cancelled:
            self._end()
            if self._state.get("superseded"):
                raise LoaderClosedError(
                    "this epoch ended because iter() was called on the same DataLoader again: an "
                    "aioload.DataLoader runs one epoch at a time; use two loaders to walk two "
                    "epochs side by side"
                ) from None
            raise LoaderClosedError("the DataLoader was closed during iteration") from None
        except BaseException:
            self._end()
            raise
        if owed:
            self._engine.give_permit()
        return item, time.perf_counter() - started

    def _finish(self, item, waited: float):
        if isinstance(item, Failure):
            raise item.exc
        loader = self._loader
        if item.raw is not None:
            batch = _decode_in_process(loader, item, self._engine.budget)
        else:
            batch = item.batch
        if item.event is not None:
            batch = self._transfer.hand_over(batch, item.event)
        elif loader._device is not None:
            batch = _device.apply(batch, lambda t: t.to(loader._device, non_blocking=True))
        elif loader._pin:
            batch = _device.pin_batch(batch)
        self._yielded += 1
        if self._batches is not None and len(self._ready.delivered) >= self._batches:
            # Every batch is delivered: the epoch ran to its end even if nothing asks for the
            # StopIteration (Lightning stops after len(loader) batches), so the workers stay.
            self._state["exhausted"] = True
        loader._delivered(item.samples, waited)
        _warn_iterable_length(loader, self._yielded, self._len_called)
        return batch

    def __next__(self):
        with profiled(WAITING):
            return self._next()

    def _next(self):
        if self._ready is None and not self._done:
            self._start()
        while True:
            item, waited = self._take()
            try:
                return self._finish(item, waited)
            except _AllSkipped:
                continue

    def __aiter__(self) -> "_Iterator":
        return self

    def _ready_now(self):
        found, item, owed = self._ready.get_nowait()
        if not found:
            raise _NotYet
        return item, owed

    async def _wait_async(self, started: float) -> None:
        """Sleep until the engine puts something in the ready queue, without a thread: the
        engine wakes this coroutine's own event loop (asyncio, uvloop or trio)."""
        event, wake = _async_waker()
        if not self._ready.when_ready(wake):
            return
        if self._timeout is None:
            await event.wait()
            return
        left = self._timeout - (time.perf_counter() - started)
        with anyio.move_on_after(max(0.0, left)) as scope:
            await event.wait()
        if scope.cancelled_caught:
            raise _timed_out(self._engine, self._timeout)

    async def _take_async(self):
        started = time.perf_counter()
        while True:
            try:
                return self._take(self._ready_now, started)
            except StopIteration:
                return _END, 0.0
            except _NotYet:
                await self._wait_async(started)

    async def __anext__(self):
        with profiled(WAITING_ASYNC):
            return await self._anext()

    async def _anext(self):
        if self._ready is None and not self._done:
            self._start()
        while True:
            item, waited = await self._take_async()
            if item is _END:
                raise StopAsyncIteration
            try:
                if isinstance(item, Ready) and item.raw is not None:
                    return await anyio.to_thread.run_sync(self._finish, item, waited)
                return self._finish(item, waited)
            except _AllSkipped:
                continue

    def close(self) -> None:
        """Stop this epoch early (what ``break`` does once the iterator is dropped)."""
        self._end()


def _abandon_epoch(engine: Engine, res: _Resources, state: dict, persistent: bool) -> None:
    """An epoch's iterator is finished or dropped. Workers are kept for the next epoch when it
    ran to its end (or with ``persistent_workers=True``); an epoch left early (``break``, an
    exception, Ctrl-C) also stops them, so nothing keeps running behind an abandoned loop."""
    if not state["exhausted"] and not persistent and not state.get("superseded"):
        engine.drain_timeout = 0  # the workers go anyway: do not wait for their tasks
    engine.stop()
    if state.get("superseded"):
        return  # a newer epoch owns the pool now; stop_engine() already judged it
    if res.engine is engine:
        res.engine = None
    if not engine.clean or (not state["exhausted"] and not persistent):
        res.discard_pool()


def _timed_out(engine: Engine, timeout: float) -> DataLoaderTimeoutError:
    """The ``timeout=`` error, naming the samples the awaited batch is stuck on and where."""
    stuck = engine.outstanding()
    if stuck is None:
        stuck, detail = [], ("the engine's event loop does not answer: a blocking call inside "
                             "'async def read' holds it; make the read asynchronous (await it)")
    elif stuck:
        engine.drain_timeout = 0  # do not wait for stuck workers when the epoch is abandoned
        detail = engine.describe_stuck(stuck)
    else:
        detail = "no sample of the next batch is being read or decoded"
    return DataLoaderTimeoutError(
        f"DataLoader timed out after {timeout} seconds waiting for a batch: {detail}. "
        "Set read_timeout= to bound each read, or raise timeout= if batches are just slow.",
        stuck=stuck,
    )


def _async_waker():
    """An event for the running async library and a thread-safe function that sets it."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        import trio

        event = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake() -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass

        return event, wake
    import asyncio

    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:
            pass  # the consumer's loop is closed

    return event, wake
