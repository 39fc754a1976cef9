"""The engine: one epoch of reading, dispatching and assembling, on its own thread and loop.

Stages, in the order data moves (each a coroutine):

* ``_produce`` pulls index batches from the sampler, one permit per batch (the bound on
  everything between the sampler and the consumer);
* ``_read`` awaits ``dataset.read(i)``, at most ``io_concurrency`` at once;
* ``_rows`` / ``_whole`` / ``_iter_batches`` send chunks to the worker pool and assemble the
  finished batch from its shared-memory slot;
* ``_deliver`` starts the device copy and puts the batch in the :class:`ReadyQueue`.

The engine thread is started with a handshake and joined by :meth:`Engine.stop`; every task
lives in a task group; whatever happens, the ready queue learns that the epoch ended.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from aioload._errors import WorkerCrashedError, unpack_exception
from aioload._layout import Layout, SlotView, collate_rows, load_sample
from aioload._pool import PoolSession, WorkerPool
from aioload._ready import SKIP, ReadyQueue
from aioload._slots import SlotPool
from aioload._stats import StatsRecorder

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

DRAIN_TIMEOUT = 5.0
"""How long an abandoned epoch waits for workers to finish what they were sent."""

CHUNK_SECONDS = 0.03
"""Target decode time of one task: long enough to hide the hand-off, short enough to balance."""


@dataclass
class Spec:
    """What the engine needs from the loader; fixed when the loader is built."""

    dataset: Any
    split: bool
    mode: str  # "rows", "whole", "iter" or "read" (num_workers=0: the consumer decodes)
    batch_size: int | None
    num_workers: int
    io_concurrency: int
    permits: int
    in_order: bool
    on_error: str
    pin: bool
    prefetch_tasks: int
    describe: Callable[[Any], str] | None = None


@dataclass
class Plan:
    """One epoch: the index batches (map-style) and the seeds."""

    batches: Iterator
    base_seed: int
    per_sample_seeds: bool


class Failure:
    """A batch that could not be made; the consumer raises ``exc`` in its place."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


@dataclass
class Ready:
    batch: Any
    samples: int
    event: Any = None
    raw: list | None = None  # num_workers=0 with a split dataset: (index, raw) pairs


@dataclass
class Shared:
    """State that outlives an epoch: the learned layout and its slot pool."""

    layout: Layout | None = None
    no_leaves: bool = False
    slots: SlotPool | None = None
    per_sample_s: float | None = None
    holds: set = field(default_factory=set)


def new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


class Engine:
    def __init__(self, spec: Spec, plan: Plan, pool: WorkerPool | None, shared: Shared,
                 ready: ReadyQueue, stats: StatsRecorder, transfer=None, slot_target: int = 4):
        self.spec = spec
        self.plan = plan
        self.pool = pool
        self.shared = shared
        self.ready = ready
        self.stats = stats
        self.transfer = transfer
        self.slot_target = slot_target
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._permits: asyncio.Semaphore | None = None
        self._io: asyncio.Semaphore | None = None
        self._session: PoolSession | None = None
        self.clean = True  # False when workers may still be writing into slots

    # -- lifetime, called from the consumer's thread ----------------------------------------
    def start(self) -> None:
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="aioload-engine")
        self._thread.start()
        started.wait()

    def give_permit(self) -> None:
        loop = self._loop
        if loop is not None and self._permits is not None:
            try:
                loop.call_soon_threadsafe(self._permits.release)
            except RuntimeError:
                pass  # the loop has already finished

    def stop(self, timeout: float = DRAIN_TIMEOUT + 5.0) -> None:
        """Cancel the epoch and join the thread. Idempotent; safe from any thread but the
        engine's own."""
        thread, loop, task = self._thread, self._loop, self._task
        if thread is None:
            return
        if thread.is_alive() and loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass
        if threading.current_thread() is not thread:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        loop = new_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._entry(started))
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    async def _entry(self, started: threading.Event) -> None:
        self._task = asyncio.current_task()
        self._permits = asyncio.Semaphore(self.spec.permits)
        self._io = asyncio.Semaphore(self.spec.io_concurrency)
        started.set()
        try:
            total = await self._main()
        except asyncio.CancelledError:
            self.ready.fail(_Cancelled())
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            self.ready.fail(_first(exc))
        else:
            self.ready.finish(total)
        finally:
            await self._release_holds()

    async def _main(self) -> int:
        if self.pool is None:
            async with asyncio.TaskGroup() as batches:
                return await self._produce(batches)
        session = self._session = PoolSession(self.pool)
        async with asyncio.TaskGroup() as outer:
            serve = outer.create_task(session.serve())
            try:
                await session.broadcast(("epoch", self.plan.base_seed, self.plan.per_sample_seeds))
                async with asyncio.TaskGroup() as batches:
                    if self.spec.mode == "iter":
                        total = await self._iter_batches(batches)
                    else:
                        total = await self._produce(batches)
            finally:
                if not await session.drain(DRAIN_TIMEOUT):
                    self.clean = False
                serve.cancel()
        return total

    async def _release_holds(self) -> None:
        """Let in-flight device copies finish before their slots can be reused."""
        holds = list(self.shared.holds)
        if holds:
            await asyncio.gather(*holds, return_exceptions=True)

    # -- stage 1: the sampler ---------------------------------------------------------------
    async def _produce(self, tg: asyncio.TaskGroup) -> int:
        seq = 0
        for indices in self.plan.batches:
            await self._permits.acquire()
            tg.create_task(self._batch(seq, indices))
            seq += 1
        return seq

    async def _batch(self, seq: int, indices) -> None:
        try:
            if self.spec.mode == "read":
                item = await self._read_only(indices)
            elif self.spec.mode == "rows":
                item = await self._rows(seq, indices)
            else:
                item = await self._whole(seq, indices)
        except WorkerCrashedError:
            raise
        except Exception as exc:  # noqa: BLE001 - this batch fails, the epoch goes on
            item = Failure(exc)
        if item is SKIP:
            self._permits.release()  # nothing for the consumer to take
        self.ready.put(seq, item)

    # -- stage 2: reads -------------------------------------------------------------------------
    def _where(self, index) -> str:
        describe = self.spec.describe
        if describe is None:
            return ""
        try:
            return f" ({describe(index)})"
        except Exception:  # noqa: BLE001 - a note must never hide the real error
            return ""

    async def _read(self, index):
        async with self._io:
            self.stats.read_started()
            started = time.perf_counter()
            try:
                raw = await self.spec.dataset.read(index)
            except Exception as exc:
                self.stats.read_done(time.perf_counter() - started, 0)
                exc.add_note(f"while reading dataset index {index}{self._where(index)}")
                raise
            self.stats.read_done(time.perf_counter() - started, _nbytes(raw))
            return raw

    async def _read_items(self, indices) -> list:
        """``(index, raw)`` pairs, or ``(index, None)`` when the dataset has no read stage.
        With ``on_error="skip"`` failed reads are left out and recorded."""
        if not self.spec.split:
            return [(i, None) for i in indices]
        results = await asyncio.gather(*(self._read(i) for i in indices), return_exceptions=True)
        items = []
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError) or self.spec.on_error != "skip":
                    raise result
                self.stats.skipped.append(index)
                continue
            items.append((index, result))
        return items

    async def _read_only(self, indices) -> Ready:
        batch_indices = indices if isinstance(indices, list) else [indices]
        items = await self._read_items(batch_indices)
        return Ready(batch=indices, samples=len(items), raw=items)

    # -- stage 3: decode in workers and assemble --------------------------------------------
    def _slot(self):
        shared = self.shared
        if shared.layout is None or shared.no_leaves:
            return None
        if shared.slots is None:
            shared.slots = SlotPool(shared.layout, self.slot_target, self.pool.register, self.spec.pin)
        slot = shared.slots.acquire()
        for slot_id in shared.slots.take_retired():
            self._session.drop_slot(slot_id)
        return slot

    def _learn(self, specs, rows: int) -> None:
        shared = self.shared
        if shared.layout is not None or shared.no_leaves or specs is None:
            return
        if not specs:
            shared.no_leaves = True
        else:
            shared.layout = Layout(specs, rows, overflow=0)

    def _note_reply(self, reply, rows: int) -> None:
        _, _, payloads, _, specs, overflow_wanted, seconds = reply
        self._learn(specs, rows)
        self.stats.decoded_batch(len(payloads), seconds)
        if payloads:
            per_sample = seconds / len(payloads)
            old = self.shared.per_sample_s
            self.shared.per_sample_s = per_sample if old is None else 0.8 * old + 0.2 * per_sample
        if overflow_wanted and self.shared.slots is not None:
            self.shared.slots.grow_overflow(overflow_wanted * max(1, rows // max(1, len(payloads))))

    def _chunk(self, n: int) -> int:
        """Rows per task: the whole batch split across the workers, smaller once decode time
        is known so that no task takes much longer than ``CHUNK_SECONDS``."""
        size = max(1, math.ceil(n / self.spec.num_workers))
        per_sample = self.shared.per_sample_s
        if per_sample:
            size = min(size, max(1, int(CHUNK_SECONDS / per_sample)))
        return size

    def _errors(self, reply, offset: int = 0) -> list:
        return [(offset + pos, index, stage, packed) for pos, index, stage, packed in reply[3]]

    def _raise_first(self, errors) -> None:
        pos, index, stage, packed = min(errors, key=lambda e: e[0])
        if index is None:
            where = f"in stage {stage}"
        else:
            where = f"while running {stage} for dataset index {index}{self._where(index)}"
        raise unpack_exception(packed, where + " in an aioload worker")

    def _skip(self, errors) -> None:
        if self.spec.on_error != "skip":
            self._raise_first(errors)
        self.stats.skipped.extend(index for _, index, _, _ in errors)

    async def _rows(self, seq: int, indices: list) -> Ready:
        slot = self._slot()
        layout = slot.layout if slot is not None else None
        size = self._chunk(len(indices))
        starts = list(range(0, len(indices), size))

        async def chunk(start: int):
            part = indices[start : start + size]
            items = await self._read_items(part)
            desc = None
            if slot is not None:
                per_row = layout.overflow // layout.rows
                lo = layout.fixed_bytes + start * per_row
                desc = (slot.id, layout.describe(), (lo, lo + len(part) * per_row))
            if not items:
                return None
            return await self._session.submit("rows", desc, (items, start), part, seq)

        # gather, not a task group: a chunk already sent to a worker must finish before the
        # slot can be reused, even when a sibling chunk failed to read.
        try:
            replies = await asyncio.gather(*(chunk(s) for s in starts), return_exceptions=True)
        except BaseException:
            if slot is not None:
                self.shared.slots.release(slot)
            raise
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            if slot is not None:
                self.shared.slots.release(slot)
            raise failed[0]
        rows, errors = [], []
        for start, reply in zip(starts, replies):
            if reply is None:
                continue
            self._note_reply(reply, self.spec.batch_size)
            errors += self._errors(reply, start)
            rows += [(start + pos, p) for pos, p in enumerate(reply[2]) if p is not None]
        if errors:
            try:
                self._skip(errors)
            except BaseException:
                if slot is not None:
                    self.shared.slots.release(slot)
                raise
        return self._assemble(slot, rows, rows_mode=True)

    async def _whole(self, seq: int, indices) -> Ready:
        batch_indices = indices if isinstance(indices, list) else [indices]
        slot = self._slot()
        items = await self._read_items(batch_indices)
        if not items:
            return SKIP
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        try:
            reply = await self._session.submit(
                "whole", desc, (items, self.spec.on_error == "skip"), batch_indices, seq
            )
            self._note_reply(reply, 1)
            if reply[3]:
                self._skip(self._errors(reply))
        except BaseException:
            if slot is not None:
                self.shared.slots.release(slot)
            raise
        return self._assemble(slot, [(0, reply[2][0])] if reply[2][0] is not None else [], rows_mode=False,
                              samples=len(items))

    def _assemble(self, slot, rows, rows_mode: bool, samples: int | None = None):
        slots = self.shared.slots
        if not rows:
            if slot is not None:
                slots.release(slot)
            return SKIP
        view = None
        if slot is not None:
            view = SlotView(slot.segment, slot.layout, functools.partial(slots.release, slot))
        if rows_mode:
            batch = collate_rows([load_sample(p, view, row, True) for row, p in rows])
        else:
            batch = load_sample(rows[0][1], view, 0, False)
        if view is not None:
            view.release()
        return self._deliver(batch, len(rows) if samples is None else samples)

    async def _iter_batches(self, tg: asyncio.TaskGroup) -> int:
        """IterableDataset: torch's scheme. Each task asks one worker for the next batch of
        its own copy; tasks go round-robin to the workers that have not run out; a worker
        that ran out yields nothing for its task and gets no more tasks."""
        n = self.spec.num_workers
        active = [True] * n
        cycle = itertools.cycle(range(n))
        seq = 0
        outstanding: set[asyncio.Task] = set()
        while any(active):
            await self._permits.acquire()
            for _ in range(n):
                wid = next(cycle)
                if active[wid]:
                    break
            else:
                self._permits.release()
                break
            task = tg.create_task(self._iter_batch(seq, wid, active))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
            seq += 1
            if len(outstanding) >= self.spec.prefetch_tasks:
                await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
        if outstanding:
            await asyncio.wait(outstanding)
        return seq

    async def _iter_batch(self, seq: int, wid: int, active: list) -> None:
        if not active[wid]:
            self.ready.put(seq, SKIP)
            self._permits.release()
            return
        slot = self._slot()
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        try:
            reply = await self._session.submit("iter", desc, None, [], seq, worker=wid)
        except BaseException:
            if slot is not None:
                self.shared.slots.release(slot)
            raise
        if reply[0] == "stop":
            active[wid] = False
            if slot is not None:
                self.shared.slots.release(slot)
            self.ready.put(seq, SKIP)
            self._permits.release()
            return
        try:
            self._note_reply(reply, 1)
            if reply[3]:
                self._raise_first(self._errors(reply))
            item = self._assemble(slot, [(0, reply[2][0])], rows_mode=False, samples=0)
        except Exception as exc:  # noqa: BLE001
            item = Failure(exc)
        self.ready.put(seq, item)

    # -- stage 4: hand-off ------------------------------------------------------------------
    def _deliver(self, batch, samples: int) -> Ready:
        if self.transfer is None:
            return Ready(batch=batch, samples=samples)
        out, event = self.transfer.start(batch)
        hold = self._loop.create_task(_hold_until(event, batch))
        self.shared.holds.add(hold)
        hold.add_done_callback(self.shared.holds.discard)
        return Ready(batch=out, samples=samples, event=event)


async def _hold_until(event, batch) -> None:
    """Keep the CPU batch (and so its slot) alive until the copy out of it has finished."""
    while not event.query():
        await asyncio.sleep(0.0005)
    del batch


class _Cancelled(Exception):
    """The epoch was stopped by the consumer (break, close, garbage collection)."""


def _first(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or exc.exceptions)[0]
    return exc


def _nbytes(raw) -> int:
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return len(raw)
    if isinstance(raw, tuple) and raw and isinstance(raw[0], (bytes, bytearray, memoryview)):
        return len(raw[0])
    return 0
