"""The engine: one epoch of reading, dispatching and assembling, on its own thread and loop.

Stages, in the order data moves, each an object given what it needs when the epoch's loop
starts (:meth:`Engine._build`):

* the sampler stage pulls index batches from the plan, one permit per batch (the bound on
  everything between the sampler and the consumer), here (``_produce``, ``_batch``);
* :class:`~aioload._engine.reads.ReadStage` awaits ``dataset.read(i)``, at most ``io_concurrency``
  at once;
* :class:`~aioload._engine.decode.DecodeStage` sends a batch or chunks of it to the worker pool and
  assembles the finished batch from its shared-memory slot;
  :class:`~aioload._engine.iterable.IterableStage` does the same for an IterableDataset, and an
  :class:`~aioload._engine.executor.ExecutorEpoch` for ``executor=``;
* the hand-off starts the device copy and puts the batch in the :class:`ReadyQueue`, here
  (``_deliver``, ``_put``).

The engine owns the lifetime: the thread, the loop, the task groups, the permits and the pool
session. The stages never reach back into it: what they share is passed to them (the
:class:`~aioload._engine.stuck.InFlight` record the stuck report reads, the ``deliver`` callback).
What the engine shares with the loader and the consumer is in :mod:`aioload._engine.spec`.

The engine thread is started with a handshake and joined by :meth:`Engine.stop`; every task
lives in a task group; whatever happens, the ready queue learns that the epoch ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from aioload._engine.budget import ErrorBudget
from aioload._engine.decode import DecodeStage, LayoutLesson
from aioload._errors import TooManyErrorsError, WorkerCrashedError, forget_locals
from aioload._engine.iterable import IterableStage
from aioload._engine.limiter import Limiter
from aioload._workers.messages import StartEpoch
from aioload._workers.pool import PoolSession, WorkerPool
from aioload._engine.reads import ReadStage
from aioload._engine.ready import SKIP, ReadyQueue
from aioload._engine.spec import Failure, Plan, Ready, Shared, Spec, Turn, _Cancelled, resize_permits
from aioload._observe.stats import StatsRecorder
from aioload._engine.stuck import InFlight, StuckReport, describe_stuck

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

DRAIN_TIMEOUT = 5.0
"""How long an abandoned epoch waits for workers to finish what they were sent."""

IO_GRACE = 1.0
"""How long an ending epoch waits for blocking reads still running in its threads."""


def new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


class Engine:
    """One epoch on its own thread and loop: the loader starts it, the iterator stops it."""

    def __init__(self, spec: Spec, plan: Plan, pool: WorkerPool | None, shared: Shared,
                 ready: ReadyQueue, stats: StatsRecorder, transfer=None):
        self.spec = spec
        self.plan = plan
        self.pool = pool
        self.shared = shared
        self.ready = ready
        self.stats = stats
        self.transfer = transfer
        self.clean = True  # False when workers may still be writing into slots
        self.drain_timeout = DRAIN_TIMEOUT  # 0 once a sample is known to be stuck
        self.budget = ErrorBudget(spec.on_error, spec.max_errors, spec.epoch_samples, stats.skip)
        self._inflight = InFlight()  # written by the stages, read by the stuck report
        # torch's dispatch wherever a user can tell: without seed= (per-sample seeds), which
        # worker loads a batch decides its random draws, so batch i goes whole to worker i mod N
        # and each worker loads its batches in order (see Turn). in_order=False lets torch
        # give a batch to any worker with room: the least-loaded one, split into chunks, here.
        self._round_robin = (pool is not None and spec.in_order and spec.mode in ("rows", "whole")
                             and not plan.per_sample_seeds)
        self._turns: list[Turn | None] = [None] * spec.num_workers  # round-robin: each worker's last batch
        # Made on the engine's loop, all in _build, before the thread's handshake:
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._permits: Limiter | None = None  # batches between the sampler and the consumer
        self._io: Limiter | None = None  # reads in flight
        self._session: PoolSession | None = None  # None without a worker pool
        self._reads: ReadStage | None = None
        self._lesson: LayoutLesson | None = None  # None without a worker pool
        self._decode: DecodeStage | None = None  # None without a worker pool
        self._iterable: IterableStage | None = None  # an IterableDataset's epoch only
        self._executor = None  # an aioload._engine.executor.ExecutorEpoch with executor=
        self._stuck: StuckReport | None = None

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
        the engine's own loop (see :class:`~aioload._engine.stuck.StuckReport`). ``None`` when the
        loop does not answer within ``timeout`` (something blocks it, such as a blocking call
        inside ``async def read``)."""
        loop, report = self._loop, self._stuck
        if loop is None or report is None or not self.running:
            return []
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def ask() -> None:
            try:
                answer.set_result(report.where())
            except BaseException as exc:  # noqa: BLE001 - reported to the asking thread
                answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(ask)
            return answer.result(timeout)
        except RuntimeError:
            return []  # the loop has already finished
        except concurrent.futures.TimeoutError:
            return None

    def describe_stuck(self, stuck: list[tuple[Any, str]]) -> str:
        """``stuck`` (from :meth:`outstanding`) in words, one clause per stage."""
        return describe_stuck(stuck, self.spec.describe)

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
                _cancel_leftovers(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                _shutdown_executor(executor, IO_GRACE)
                loop.close()

    async def _entry(self, started: threading.Event) -> None:
        self._task = asyncio.current_task()
        self._build()
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

    def _build(self) -> None:
        """The epoch's loop-bound objects and its stages, each given what it uses."""
        spec, stats, budget, inflight = self.spec, self.stats, self.budget, self._inflight
        self._permits = permits = Limiter(self._permit_limit())
        self._io = Limiter(spec.io_concurrency)
        self._reads = reads = ReadStage(spec, stats, budget, self._io, inflight, pickled=self.pool is not None)
        if self.pool is not None:
            self._session = session = PoolSession(self.pool)
            self._lesson = lesson = LayoutLesson(self.shared, spec.num_workers)
            self._decode = DecodeStage(
                spec, self.shared, stats, budget, reads, session, register=self.pool.register, permits=permits,
                lesson=lesson, deliver=self._deliver, on_quick=self._note_quick, round_robin=self._round_robin,
            )
            if spec.mode == "iter":
                self._iterable = IterableStage(spec, session, permits, self.ready, self._decode, lesson, inflight,
                                               self._put)
        if spec.mode == "executor":
            self._executor = spec.executor.epoch(reads, stats, budget, self._deliver, base_seed=self.plan.base_seed,
                                                 pin=self.transfer is not None and spec.pin)
        self._stuck = StuckReport(spec, self.pool, self._session, inflight)

    def _permit_limit(self) -> int:
        """Batches in flight plus ready: the tuner's number, or the spec's; more once batches
        are known to be quick (:func:`aioload._workers.pool.batches_in_flight`)."""
        if self.spec.tuner is not None:
            return self.spec.tuner.controller.permits
        return self.spec.permits_quick if self.shared.quick else self.spec.permits

    def _note_quick(self, quick: bool) -> None:
        """Batches turned out quick (or no longer are): resize the permits and the slot pool."""
        if quick == self.shared.quick:
            return
        self.shared.quick = quick
        if self.spec.tuner is not None:
            self.spec.tuner.controller.quick = quick
        resize_permits(self._permits, self.shared, self._permit_limit())

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
        session = self._session
        if session is None:
            async with asyncio.TaskGroup() as batches:
                return await self._produce(batches)
        async with asyncio.TaskGroup() as outer:
            serve = outer.create_task(session.serve())
            try:
                await session.broadcast(StartEpoch(self.plan.base_seed, self.plan.per_sample_seeds))
                async with asyncio.TaskGroup() as batches:
                    if self._iterable is not None:
                        total = await self._iterable.run(batches)
                    else:
                        total = await self._produce(batches)
                failed = await session.started()
                if failed is not None:
                    raise failed
            finally:
                try:
                    if not await session.drain(self.drain_timeout):
                        self.clean = False
                finally:
                    serve.cancel()
                    if not await session.aclose():
                        self.clean = False
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
            tg.create_task(self._batch(seq, indices, self._turn(seq)))
            total = seq + 1
        return total

    def _turn(self, seq: int) -> Turn | None:
        """Batch ``seq``'s place in the queue of worker ``seq mod N`` (round-robin dispatch)."""
        if not self._round_robin:
            return None
        wid = seq % self.spec.num_workers
        turn = self._turns[wid] = Turn(wid, self._turns[wid])
        return turn

    async def _batch(self, seq: int, indices, turn: Turn | None = None) -> None:
        self._inflight.batches[seq] = indices if isinstance(indices, list) else [indices]
        try:
            lesson = self._lesson
            if lesson is not None and lesson.learning():
                item = await lesson.run(self._make, seq, indices, turn, shares=self._decode.shares(indices))
            else:
                item = await self._make(seq, indices, turn)
        except (WorkerCrashedError, TooManyErrorsError):
            raise
        except Exception as exc:  # noqa: BLE001 - this batch fails, the epoch goes on
            if self.pool is not None and self.pool.broken is not None:
                raise  # no worker will serve this epoch again
            item = Failure(forget_locals(exc))
        finally:
            self._inflight.batches.pop(seq, None)
            if turn is not None:
                turn.sent()  # a batch that failed or sent nothing holds up no other
        if item is SKIP:
            self._permits.release()  # nothing for the consumer to take
        self._put(seq, item)

    async def _make(self, seq: int, indices, turn: Turn | None):
        mode = self.spec.mode
        if mode == "executor":
            return await self._executor.make(seq, indices)
        if mode == "read":
            return await self._reads.read_only(indices)
        if mode == "rows":
            return await self._decode.rows(seq, indices, turn=turn)
        return await self._decode.whole(seq, indices, turn)

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


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await what still runs on ``loop`` once the epoch is over, as ``asyncio.run``
    does: tasks a dataset's ``read`` left behind (a prefetch, a client's clean-up). The engine's
    own tasks have all ended by then; a task left pending would print "Task was destroyed but
    it is pending!" when the loop is closed."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _shutdown_executor(executor: concurrent.futures.ThreadPoolExecutor, grace: float) -> None:
    """Stop ``executor``, waiting at most ``grace`` seconds for work already running. A call
    blocked for good (a hung network mount) keeps its thread; nothing else waits for it."""
    stopper = threading.Thread(target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True},
                               name="aioload-io-shutdown")
    stopper.start()
    stopper.join(grace)


def _first(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or exc.exceptions)[0]
    return exc
