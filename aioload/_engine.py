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
import concurrent.futures
import functools
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from aioload._budget import ErrorBudget, where
from aioload._errors import (
    DataLoaderTimeoutError, TooManyErrorsError, WorkerCrashedError, forget_locals, unpack_exception,
)
from aioload._dataset import NOT_READY, Dataset
from aioload._chunks import CHUNK_MAGIC, join_chunks, load_chunk, move_chunk_into_slot
from aioload._layout import ALIGN, Layout, SlotView, collate_rows, column_views, load_batch, load_rows, move_into_slot
from aioload._limiter import Limiter
from aioload._pool import PoolSession, WorkerPool
from aioload._ready import SKIP, ReadyQueue
from aioload._slots import SlotPool
from aioload._stats import StatsRecorder
from aioload._worker import COLLATING

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

DRAIN_TIMEOUT = 5.0
"""How long an abandoned epoch waits for workers to finish what they were sent."""

IO_GRACE = 1.0
"""How long an ending epoch waits for blocking reads still running in its threads."""

CHUNK_SECONDS = 0.1
"""Target decode time of one task: long enough to hide the hand-off, short enough to balance."""

WHOLE_BATCH_SECONDS = 0.02
"""A batch that decodes in less time than this goes to one worker whole: splitting it would cost
more in hand-offs (a message each way and a join per chunk) than it saves in latency."""


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
    tuner: Any = None  # an aioload._tune.Tuner when a limit is "auto"
    read_timeout: float | None = None  # seconds one dataset.read may take
    max_errors: int | float | None = None  # on_error="skip": the bound on skips per epoch
    epoch_samples: int | None = None  # the base of a fractional max_errors
    auto_collation: bool = True  # False with batch_size=None: each index (even a list) is one sample
    batched_fetch: bool = False  # the dataset's __getitems__ gets each batch whole, as in torch


@dataclass
class Plan:
    """One epoch: the numbered index batches ``(seq, indices)`` (map-style) and the seeds.
    ``delivered`` holds the sequence numbers the consumer already has (a resumed epoch's)."""

    batches: Iterator
    base_seed: int
    per_sample_seeds: bool
    delivered: Any = None


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
    chunked: bool | None = None  # rows collated by chunk in the workers (see _chunks)


def new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def _chunk_blob(payloads: list):
    """A chunk-mode reply's skeleton (its first payload that is there), else ``None``."""
    for payload in payloads:
        if payload is not None:
            return payload if payload.startswith(CHUNK_MAGIC) else None
    return None


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
        self._permits: Limiter | None = None
        self._io: Limiter | None = None
        self._session: PoolSession | None = None
        self.clean = True  # False when workers may still be writing into slots
        self.drain_timeout = DRAIN_TIMEOUT  # 0 once a sample is known to be stuck
        self.budget = ErrorBudget(spec.on_error, spec.max_errors, spec.epoch_samples, stats.skipped.extend)
        self._open: dict[int, list] = {}  # batches started and not yet handed to the ready queue
        self._reading: dict[Any, str] = {}  # index -> "read" or "waiting for a read slot"

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
        # Batches made and never taken hold slot memory: let it go now, not when the
        # iterator is collected (an exception's traceback can keep that alive for long).
        # A consumer that asks again is told the epoch was stopped, even when the engine
        # had already made every batch (it must not wait for batches that were let go).
        self.ready.fail(_Cancelled())
        self.ready.drain()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def outstanding(self, timeout: float = 1.0) -> list[tuple[Any, str]] | None:
        """Where the oldest unfinished batch is held up: ``(index, stage)`` pairs, asked of
        the engine's own loop. ``None`` when the loop does not answer within ``timeout``
        (something blocks it, such as a blocking call inside ``async def read``)."""
        loop = self._loop
        if loop is None or not self.running:
            return []
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def ask() -> None:
            try:
                answer.set_result(self._outstanding())
            except BaseException as exc:  # noqa: BLE001 - reported to the asking thread
                answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(ask)
            return answer.result(timeout)
        except RuntimeError:
            return []  # the loop has already finished
        except concurrent.futures.TimeoutError:
            return None

    def _outstanding(self) -> list[tuple[Any, str]]:
        if not self._open:
            return []
        seq = min(self._open)
        stuck = [(i, self._reading[i]) for i in self._open[seq] if i in self._reading]
        if self._session is not None:
            for indices, wid, task_id in self._session.requests_for(seq):
                stuck += self._in_worker(indices, wid)
        return list(dict.fromkeys(stuck))

    def _in_worker(self, indices: list, wid: int | None) -> list[tuple[Any, str]]:
        """Where a task of the awaited batch is: queued, or in a worker on a known sample
        (possibly of an earlier task that the worker is stuck on)."""
        if wid is None:
            ready = sum(self.pool.ready)
            waiting = ("waiting for a free worker" if ready == len(self.pool.ready) else
                       f"waiting for the workers to start ({ready} of {len(self.pool.ready)} ready)")
            return [(i, waiting) for i in indices] or [(None, waiting)]
        where = f"worker {wid} (pid {self.pool.procs[wid].pid})"
        task_id, index = self.pool.current(wid)
        if task_id in self._session.tasks_of(wid):
            if index == COLLATING:
                return [(None, f"collate_fn in {where}")]
            if index >= 0:
                return [(index, f"{self._stage()} in {where}")]
        return [(i, f"{self._stage()} in {where}") for i in indices] or [(None, f"{self._stage()} in {where}")]

    def _stage(self) -> str:
        if self.spec.mode == "iter":
            return "__iter__"
        return "decode" if self.spec.split else "__getitem__"

    def describe_stuck(self, stuck: list[tuple[Any, str]]) -> str:
        """``stuck`` in words, one clause per stage; a lone sample gets its path or URL."""
        stages: dict[str, list] = {}
        for index, stage in stuck:
            stages.setdefault(stage, []).append(index)
        parts = []
        for stage, indices in stages.items():
            known = [i for i in indices if i is not None]
            if not known:
                subject, verb = "the batch", "is"
            elif len(known) == 1:
                subject, verb = f"dataset index {known[0]}{self._where(known[0])}", "is"
            else:
                subject, verb = f"dataset indices {known}", "are"
            parts.append(f"{subject} {verb} {'' if stage.startswith('waiting') else 'stuck in '}{stage}")
        return "; ".join(parts)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        loop = new_loop()
        # The loop's own threads for blocking work (aioload.read_bytes, asyncio.to_thread):
        # a read stuck in one of them must not hold the epoch's end (read_timeout gave up on it).
        executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="aioload-io")
        loop.set_default_executor(executor)
        self._loop = loop
        try:
            loop.run_until_complete(self._entry(started))
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                _shutdown_executor(executor, IO_GRACE)
                loop.close()

    async def _entry(self, started: threading.Event) -> None:
        self._task = asyncio.current_task()
        self._permits = Limiter(self.spec.permits)
        self._io = Limiter(self.spec.io_concurrency)
        nowait = getattr(self.spec.dataset, "read_nowait", None)
        self._nowait = None if getattr(nowait, "__func__", None) is Dataset.read_nowait else nowait
        self._probing = False  # a batch is teaching the layout
        self._taught = asyncio.Event()  # set once the layout is known (or the teacher is done)
        started.set()
        try:
            total = await self._tuned()
        except asyncio.CancelledError:
            self.ready.fail(_Cancelled())
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            self.ready.fail(forget_locals(_first(exc)))
        else:
            self.ready.finish(total)
        finally:
            await self._release_holds()

    async def _tuned(self) -> int:
        """The epoch, with the autotuner resizing the limits beside it when asked."""
        if self.spec.tuner is None:
            return await self._main()
        async with asyncio.TaskGroup() as tg:
            tuning = tg.create_task(self.spec.tuner.run(self.stats, self._io, self._permits, self.shared))
            try:
                return await self._main()
            finally:
                tuning.cancel()

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
                failed = await session.started()
                if failed is not None:
                    raise failed
            finally:
                if not await session.drain(self.drain_timeout):
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
        total = 0
        for seq, indices in self.plan.batches:
            await self._permits.acquire()
            tg.create_task(self._batch(seq, indices))
            total = seq + 1
        return total

    async def _batch(self, seq: int, indices) -> None:
        self._open[seq] = indices if isinstance(indices, list) else [indices]
        try:
            item = await self._learn_first(self._make, seq, indices)
        except (WorkerCrashedError, TooManyErrorsError):
            raise
        except Exception as exc:  # noqa: BLE001 - this batch fails, the epoch goes on
            if self.pool is not None and self.pool.broken is not None:
                raise  # no worker will serve this epoch again
            item = Failure(forget_locals(exc))
        finally:
            self._open.pop(seq, None)
        if item is SKIP:
            self._permits.release()  # nothing for the consumer to take
        self._put(seq, item)

    async def _learn_first(self, make, *args):
        """Until the first reply has shown the batch layout, one batch runs alone and the others
        wait for that reply: every later batch can then be written straight into a slot."""
        if self._learning():
            if not self._probing:
                self._probing = True
                try:
                    return await make(*args)
                finally:
                    self._taught.set()
            await self._taught.wait()
        return await make(*args)

    def _learning(self) -> bool:
        shared = self.shared
        return self.pool is not None and shared.layout is None and not shared.no_leaves

    async def _make(self, seq: int, indices):
        if self.spec.mode == "read":
            return await self._read_only(indices)
        if self.spec.mode == "rows":
            return await self._rows(seq, indices)
        return await self._whole(seq, indices)

    # -- stage 2: reads -------------------------------------------------------------------------
    def _where(self, index) -> str:
        """`` (path)`` when the dataset's ``describe`` knows where ``index`` lives."""
        return where(self.spec.describe, index)

    async def _read(self, index):
        self._reading[index] = f"waiting for a read slot (io_concurrency={self.spec.io_concurrency})"
        try:
            async with self._io:
                self._reading[index] = "read"
                self.stats.read_started()
                started = time.perf_counter()
                try:
                    raw = await self._read_within(index)
                except Exception as exc:
                    self.stats.read_done(time.perf_counter() - started, 0)
                    exc.add_note(f"while reading dataset index {index}{self._where(index)}")
                    raise
                self.stats.read_done(time.perf_counter() - started, _nbytes(raw))
                return raw
        finally:
            self._reading.pop(index, None)

    async def _read_within(self, index):
        limit = self.spec.read_timeout
        if limit is None:
            return await self.spec.dataset.read(index)
        try:
            async with asyncio.timeout(limit):
                return await self.spec.dataset.read(index)
        except TimeoutError:
            raise DataLoaderTimeoutError(
                f"dataset.read({index!r}) did not return within read_timeout={limit} seconds; "
                "raise read_timeout if the storage is just slow, or use on_error='skip' to leave "
                "such samples out",
                stuck=[(index, "read")],
            ) from None

    async def _read_items(self, indices) -> list:
        """``(index, raw)`` pairs; the indices themselves when the dataset has no read stage
        (the worker pairs them with ``None``: a plain list pickles at a third of the cost).
        With ``on_error="skip"`` failed reads are left out and recorded."""
        if not self.spec.split:
            return indices  # plain indices: the workers call __getitem__
        results = self._read_nowait(indices)
        waiting = [i for i, r in zip(indices, results) if r is NOT_READY]
        if waiting:
            read = iter(await asyncio.gather(*(self._read(i) for i in waiting), return_exceptions=True))
            results = [next(read) if r is NOT_READY else r for r in results]
        items = []
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError) or not isinstance(result, Exception):
                    raise result
                self.budget.failed([index], result)
                continue
            items.append((index, result))
        return items

    def _read_nowait(self, indices) -> list:
        """What ``dataset.read_nowait`` has at hand for each index (``NOT_READY`` for the
        rest): a local file the worker will open needs no trip through the event loop."""
        nowait = self._nowait
        if nowait is None:
            return [NOT_READY] * len(indices)
        results = []
        for index in indices:
            try:
                raw = nowait(index)
            except Exception as exc:  # noqa: BLE001 - reported like a failed read
                exc.add_note(f"while reading dataset index {index}{self._where(index)}")
                raw = exc
            if raw is not NOT_READY:
                self.stats.read_started()
                self.stats.read_done(0.0, 0)
            results.append(raw)
        return results

    def _batch_indices(self, indices) -> list:
        """The indices of one batch: a batch sampler's list (or tuple, or tensor), or, without
        automatic batching, the one index the sampler gave (which may itself be a list)."""
        return list(indices) if self.spec.auto_collation else [indices]

    async def _read_only(self, indices) -> Ready:
        batch_indices = self._batch_indices(indices)
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
        self._taught.set()

    def _note_reply(self, reply, rows: int) -> None:
        _, _, payloads, _, specs, overflow_wanted, seconds, *cpu = reply
        self._learn(specs, rows)
        self.stats.decoded_batch(len(payloads), seconds, cpu[0] if cpu else seconds)
        if payloads:
            per_sample = seconds / len(payloads)
            old = self.shared.per_sample_s
            self.shared.per_sample_s = per_sample if old is None else 0.8 * old + 0.2 * per_sample
        if overflow_wanted and self.shared.slots is not None:
            self.shared.slots.grow_overflow(overflow_wanted * max(1, rows // max(1, len(payloads))))

    def _chunk(self, n: int) -> int:
        """Rows per task: the whole batch split across the workers, smaller once decode time
        is known so that no task takes much longer than ``CHUNK_SECONDS``."""
        if self.spec.batched_fetch:
            return n
        size = max(1, math.ceil(n / self.spec.num_workers))
        per_sample = self.shared.per_sample_s
        if per_sample is None:
            return size  # the first batches: split, so that the first one arrives fast
        if per_sample * n <= WHOLE_BATCH_SECONDS:
            return n
        return min(size, max(1, int(CHUNK_SECONDS / per_sample)))

    def _errors(self, reply, offset: int = 0) -> list:
        return [(offset + pos, index, stage, packed) for pos, index, stage, packed in reply[3]]

    def _unpack(self, error) -> BaseException:
        pos, index, stage, packed = error
        if index is None:
            where = f"in stage {stage}"
        elif isinstance(index, list):  # collate_fn's batch, or a chunk fetched by __getitems__
            what = "the batch of dataset indices" if stage == "collate_fn" else "dataset indices"
            where = f"while running {stage} for {what} {index}"
        else:
            where = f"while running {stage} for dataset index {index}{self._where(index)}"
        return unpack_exception(packed, where + " in an aioload worker")

    def _raise_first(self, errors) -> None:
        raise self._unpack(min(errors, key=lambda e: e[0]))

    def _skip(self, errors) -> None:
        if not self.budget.skip:
            self._raise_first(errors)
        for error in sorted(errors, key=lambda e: e[0]):
            index = error[1]
            self.budget.failed(index if isinstance(index, list) else [index], self._unpack(error))

    async def _rows(self, seq: int, indices, chunked: bool | None = None) -> Ready:
        indices = self._batch_indices(indices) if chunked is None else indices
        probe = None
        if self._learning() and not self.spec.batched_fetch:  # __getitems__ gets whole batches only
            # This batch teaches the layout: one sample first; its reply shows the layout, and
            # the rest of the batch is then written straight into a slot.
            probe = await self._probe(seq, indices[0])
        slot = self._slot()
        layout = slot.layout if slot is not None else None
        size = self._chunk(len(indices))
        starts = list(range(0 if probe is None else 1, len(indices), size))

        async def chunk(start: int):
            part = indices[start : start + size]
            items = await self._read_items(part)
            desc = None
            if slot is not None:
                # A batch sampler's batch may be longer than the layout's rows; each row's share
                # of the overflow area stays aligned for the leaves written into it.
                per_row = layout.overflow // max(layout.rows, len(indices)) // ALIGN * ALIGN
                lo = layout.fixed_bytes + start * per_row
                desc = (slot.id, layout.describe(), (lo, lo + len(part) * per_row))
            if not items:
                return None
            mode = self.shared.chunked if chunked is None else chunked
            return await self._session.submit("rows", desc, (items, start, mode), part, seq)

        # gather, not a task group: a chunk already sent to a worker must finish before the
        # slot can be reused, even when a sibling chunk failed to read.
        try:
            if len(starts) == 1:  # the whole batch in one task: no gather to pay for
                replies = [await chunk(starts[0])]
            else:
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
        if probe is not None:
            starts, replies = [0, *starts], [probe, *replies]
            if slot is not None and probe != _NOTHING and probe[2][0] is not None:
                payload = probe[2][0]
                if payload.startswith(CHUNK_MAGIC):
                    payload = move_chunk_into_slot(payload, slot.segment, layout, column_views(slot.segment, layout), 0)
                else:
                    payload = move_into_slot(payload, slot.segment, layout, 0)
                probe = probe[:2] + ([payload],) + probe[3:]
                replies[0] = probe
        if chunked is None and any(r not in (None, _NOTHING) and any(e[2] == "collate" for e in r[3]) for r in replies):
            # A chunk could not be collated (samples of different shapes, say): collate the
            # whole batch in this process instead, so the error is default_collate's own.
            if slot is not None:
                self.shared.slots.release(slot)
            return await self._rows(seq, indices, chunked=False)
        rows, errors, chunks = [], [], []
        for start, reply in zip(starts, replies):
            if reply is None or reply is _NOTHING:
                continue
            if reply is not probe:
                self._note_reply(reply, self.spec.batch_size or len(indices))
                self._note_mode(reply)
            if reply[3]:
                errors += self._errors(reply, start)
            payloads = reply[2]
            blob = _chunk_blob(payloads)
            if blob is not None:
                # chunk mode: the chunk's samples fill its rows from ``start``, in order
                chunks.append((start, len(payloads) - payloads.count(None), load_chunk(blob)))
            else:
                rows += [(start + pos, p) for pos, p in enumerate(payloads) if p is not None]
        if errors:
            try:
                self._skip(errors)
            except BaseException:
                if slot is not None:
                    self.shared.slots.release(slot)
                raise
        if chunks:
            if rows:
                if slot is not None:
                    self.shared.slots.release(slot)
                raise TypeError("the samples of this batch differ in kind: some hold only tensors, numbers "
                                "and strings, others types with their own collate function; give the "
                                "DataLoader a collate_fn that handles them all")
            return self._assemble_chunks(slot, chunks)
        return self._assemble(slot, rows, rows_mode=True)

    async def _probe(self, seq: int, index):
        """Decode one sample without a slot and learn the layout from it."""
        items = await self._read_items([index])
        if not items:
            return _NOTHING
        reply = await self._session.submit("rows", None, (items, 0, None), [index], seq)
        self._note_reply(reply, self.spec.batch_size or 1)
        self._note_mode(reply)
        return reply

    def _note_mode(self, reply) -> None:
        """The first reply with a sample decides chunk mode or rows mode for good."""
        if self.shared.chunked is None:
            done = [p for p in reply[2] if p]
            if done:
                self.shared.chunked = done[0].startswith(CHUNK_MAGIC)

    async def _whole(self, seq: int, indices) -> Ready:
        batch_indices = self._batch_indices(indices)
        items = await self._read_items(batch_indices)
        if not items:
            return SKIP
        slot = self._slot()  # after the reads: a read that fails must not hold a slot
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
        failed = sum(1 for error in reply[3] if not isinstance(error[1], list))
        return self._assemble(slot, [(0, reply[2][0])] if reply[2][0] is not None else [], rows_mode=False,
                              samples=len(items) - failed)

    def _assemble_chunks(self, slot, chunks):
        """A batch from chunk-mode replies: columns joined, views of the slot where whole."""
        slots = self.shared.slots
        view = None
        if slot is not None:
            view = SlotView(slot.segment, slot.layout, functools.partial(slots.release, slot))
        batch = join_chunks(chunks, view)
        if view is not None:
            view.release()
        return self._deliver(batch, sum(n for _, n, _ in chunks))

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
            batch = collate_rows(load_rows(rows), [row for row, _ in rows], view)
        else:
            batch = load_batch(rows[0][1], view)
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
        await self._learn_first(self._iter_batch_in, seq, wid, active)

    async def _iter_batch_in(self, seq: int, wid: int, active: list) -> None:
        slot = self._slot()
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        self._open[seq] = []
        try:
            reply = await self._session.submit("iter", desc, None, [], seq, worker=wid)
        except BaseException:
            if slot is not None:
                self.shared.slots.release(slot)
            raise
        finally:
            self._open.pop(seq, None)
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
        self._put(seq, item)

    # -- stage 4: hand-off ------------------------------------------------------------------
    def _put(self, seq: int, item) -> None:
        if self.ready.put(seq, item):
            self._permits.release()  # handed to a waiting consumer, which owes no permit
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


def _shutdown_executor(executor: concurrent.futures.ThreadPoolExecutor, grace: float) -> None:
    """Stop ``executor``, waiting at most ``grace`` seconds for work already running. A call
    blocked for good (a hung network mount) keeps its thread; nothing else waits for it."""
    stopper = threading.Thread(target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True},
                               name="aioload-io-shutdown")
    stopper.start()
    stopper.join(grace)


_NOTHING = ("nothing",)
"""The probe's sample was skipped at its read: no reply."""


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
