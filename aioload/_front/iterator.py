"""The epoch fed by the engine, for ``for`` or ``async for``: finished batches from the ready
queue, the ``timeout=`` error, and the async wait on the caller's own event loop. Dropping the
iterator, ``break``, an exception or Ctrl-C stops the engine. What every epoch shares (the lazy
start, ``len()``, the end of an epoch) is :class:`aioload._front.epoch.EpochIterator`'s."""

from __future__ import annotations

import sys
import time
import warnings
from typing import TYPE_CHECKING

import anyio

from aioload._handoff import device as _device
from aioload._front.compat import WAITING_ASYNC, profiled
from aioload._front.epoch import EpochContext, EpochIterator, EpochSource
from aioload._base.errors import DataLoaderTimeoutError, StalledWarning
from aioload._engine.gpudecode import DecodeTransfer
from aioload._engine.budget import AllSkipped
from aioload._front.inprocess import decode_in_process
from aioload._engine.ready import EndOfEpoch
from aioload._engine.spec import Cancelled, Failure, Reads, Ready
from aioload._observe.stats import outside_frames

if TYPE_CHECKING:
    from aioload._engine.engine import Engine
    from aioload._engine.ready import ReadyQueue

_END = object()


class _NotYet(Exception):
    """Nothing is ready yet (the async consumer then waits for a wake-up)."""


class EngineIterator(EpochIterator):
    """An epoch fed by the engine: finished batches from its ready queue."""

    def _open(self, source: EpochSource) -> EpochContext:
        return source._start_engine()

    @property
    def _ready(self) -> ReadyQueue | None:
        """The epoch's ready queue, once it started."""
        return self._ctx.ready if self._ctx is not None else None

    def _take(self, ctx: EpochContext, get=None, started: float | None = None):
        """Block until the next item (or, with ``get``, take it without blocking); returns
        ``(item, seconds waited)``."""
        if self._done:
            raise StopIteration
        if started is None:
            started = time.perf_counter()
        try:
            item, owed = get() if get is not None else _wait(ctx)
        except _NotYet:
            raise
        except EndOfEpoch:
            ctx.noted()
            self._epoch_over(ctx, started)
            raise StopIteration from None
        except TimeoutError:
            raise _timed_out(ctx.engine, ctx.timeout) from None
        except Cancelled:
            raise self._stopped_error(ctx) from None
        except BaseException:
            self._end()
            raise
        if owed:
            ctx.engine.give_permit()
        ctx.noted()
        return item, time.perf_counter() - started

    def _finish(self, ctx: EpochContext, item, waited: float):
        if isinstance(item, Failure):
            raise item.exc
        if item.raw is not None:
            batch = decode_in_process(ctx, item)
            if isinstance(ctx.transfer, DecodeTransfer):  # encoded images, decoded here
                batch = ctx.transfer.finish(batch)
        else:
            batch = item.batch
        if item.event is not None:
            batch = ctx.transfer.hand_over(batch, item.event)
        elif ctx.device is not None:
            batch = _device.apply(batch, lambda t: t.to(ctx.device, non_blocking=True))
        elif ctx.pin:
            batch = _device.pin_batch(batch)
        if ctx.batches is not None and len(ctx.ready.delivered) >= ctx.batches:
            # Every batch is delivered: the epoch ran to its end even if nothing asks for the
            # StopIteration (Lightning stops after len(loader) batches), so the workers stay.
            ctx.exhausted = True
        self._handed_over(ctx, item.samples, waited)
        return batch

    def _next(self, ctx: EpochContext):
        while True:
            item, waited = self._take(ctx)
            try:
                return self._finish(ctx, item, waited)
            except AllSkipped:
                continue

    def _ready_now(self):
        found, item, owed = self._ctx.ready.get_nowait()
        if not found:
            raise _NotYet
        return item, owed

    async def _wait_async(self, ctx: EpochContext, started: float) -> None:
        """Sleep until the engine puts something in the ready queue, without a thread: the
        engine wakes this coroutine's own event loop (asyncio, uvloop or trio)."""
        event, wake = _async_waker()
        if not ctx.ready.when_ready(wake):
            return
        if ctx.timeout is None:
            if ctx.stall_warning and not ctx.stall_warned:
                with anyio.move_on_after(max(0.0, ctx.stall_warning - (time.perf_counter() - started))) as scope:
                    await event.wait()
                if not scope.cancelled_caught:
                    return
                stalled = await anyio.to_thread.run_sync(_stalled, ctx)
                warnings.warn(stalled, stacklevel=outside_frames())
            await event.wait()
            return
        left = ctx.timeout - (time.perf_counter() - started)
        with anyio.move_on_after(max(0.0, left)) as scope:
            await event.wait()
        if scope.cancelled_caught:
            raise _timed_out(ctx.engine, ctx.timeout)

    async def _take_async(self, ctx: EpochContext):
        started = time.perf_counter()
        while True:
            try:
                return self._take(ctx, self._ready_now, started)
            except StopIteration:
                return _END, 0.0
            except _NotYet:
                await self._wait_async(ctx, started)

    async def __anext__(self):
        with profiled(WAITING_ASYNC):
            return await self._anext()

    async def _anext(self):
        if self._done:
            raise StopAsyncIteration
        ctx = self._ctx
        if ctx is None:
            # The epoch's start (the order, the worker processes, the engine's thread) takes
            # 0.1-0.3 s: in a thread, so that it does not hold the caller's event loop.
            ctx = await anyio.to_thread.run_sync(self._context)
        while True:
            item, waited = await self._take_async(ctx)
            if item is _END:
                raise StopAsyncIteration
            try:
                if isinstance(item, Ready) and item.raw is not None:
                    return await anyio.to_thread.run_sync(self._finish, ctx, item, waited)
                return self._finish(ctx, item, waited)
            except AllSkipped:
                continue


def _wait(ctx: EpochContext):
    """The next ``(item, owed)`` of the ready queue, waiting up to ``timeout=``; without one,
    a wait longer than ``stall_warning=`` seconds warns once in the epoch (:func:`_stalled`)
    and goes on waiting."""
    if ctx.timeout is None and ctx.stall_warning and not ctx.stall_warned:
        try:
            return ctx.ready.get(timeout=ctx.stall_warning)
        except TimeoutError:
            warnings.warn(_stalled(ctx), stacklevel=outside_frames())
    return ctx.ready.get(timeout=ctx.timeout)


def _held_up(engine: Engine) -> tuple[list, str]:
    """``(stuck, detail)``: where the awaited batch is held up, as pairs and in words."""
    stuck = engine.outstanding()
    if stuck is None:
        return [], ("the engine's event loop does not answer: a blocking call inside "
                    "'async def read' holds it; make the read asynchronous (await it)")
    if stuck:
        return stuck, engine.describe_stuck(stuck)
    return stuck, "no sample of the next batch is being read or decoded"


def _stalled(ctx: EpochContext) -> StalledWarning:
    """The stall warning (once per epoch): where the awaited batch is, and the stacks of the
    workers holding it."""
    ctx.stall_warned = True
    _, detail = _held_up(ctx.engine)
    return StalledWarning(
        f"DataLoader has waited {ctx.stall_warning:g} seconds for a batch: {detail}. It goes on waiting; set "
        f"timeout= to fail instead, or stall_warning=None to silence this.{ctx.engine.stuck_stacks()}"
    )


def _timed_out(engine: Engine, timeout: float) -> DataLoaderTimeoutError:
    """The ``timeout=`` error, naming the samples the awaited batch is stuck on and where,
    with the stacks of the workers that hold them."""
    stuck, detail = _held_up(engine)
    if stuck:
        engine.drain_timeout = 0  # do not wait for stuck workers when the epoch is abandoned
    advice = ("Set read_timeout= to bound each read, or raise timeout= if batches are just slow."
              if engine.spec.reads is not Reads.NONE else "Raise timeout= if batches are just slow.")
    return DataLoaderTimeoutError(
        f"DataLoader timed out after {timeout} seconds waiting for a batch: {detail}. {advice}"
        f"{engine.stuck_stacks()}",
        stuck=stuck,
    )


def _async_waker():
    """An event for the running async library and a thread-safe function that sets it."""
    trio = _running_trio()
    if trio is not None:
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


def _running_trio():
    """The trio module where trio runs this task, else ``None``.

    A program that runs trio has imported it, so ``sys.modules`` tells without importing
    anything (trio is not a dependency); ``current_task`` raises outside trio's tasks: outside
    ``trio.run``, and in an asyncio task beside trio in guest mode."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        trio.lowlevel.current_task()  # set only while one of trio's tasks runs
    except RuntimeError:
        return None
    return trio
