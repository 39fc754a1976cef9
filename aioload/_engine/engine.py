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
from aioload._engine.iterable import IterableStage
from aioload._engine.lease import Lease
from aioload._engine.reads import ReadStage
from aioload._engine.ready import ReadyQueue
from aioload._engine.spec import Cancelled, Failure, Mode, Plan, Ready, Reads, Shared, Spec, Turn, resize_permits
from aioload._engine.stuck import InFlight, StuckReport, describe_stuck
from aioload._base.errors import TooManyErrorsError, WorkerCrashedError, forget_locals
from aioload._data.limiter import Limiter
from aioload._observe.stats import StatsRecorder
from aioload._workers.messages import SetStreams, StartEpoch
from aioload._workers import fetches as _fetches
from aioload._workers.pool import PoolSession, WorkerPool

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    uvloop = None

DRAIN_TIMEOUT = 5.0
"""How long an abandoned epoch waits for workers to finish what they were sent."""

STREAMS_TIMEOUT = 2.0
"""How long an ended epoch of persistent workers waits for their random streams (asked once
every task is answered, so an idle worker answers at once)."""

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
        self._turns: list[Turn | None] = [None] * spec.num_workers  # round-robin: each worker's last batch
        self._copies: dict[asyncio.Future, object] = {}  # device copies running: the CPU batch each reads
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
        """The consumer took a batch it owed a permit for (see :meth:`Lease.deliver`)."""
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
        self.ready.fail(Cancelled())
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

    def stuck_stacks(self) -> str:
        """The Python stacks of the workers :meth:`outstanding` last found holding a sample
        (see :meth:`~aioload._engine.stuck.StuckReport.stacks`); ``""`` when none did."""
        return self._stuck.stacks() if self._stuck is not None else ""

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
            self.ready.fail(Cancelled())
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            self.ready.fail(forget_locals(_first(exc)))
        else:
            self.ready.finish(total)
        finally:
            if self.plan.streams is not None:
                self.plan.streams.put(None)  # not asked (the epoch failed or was cut short): not known
            await self._copies_done()

    def _build(self) -> None:
        """The epoch's loop-bound objects and its stages, each given what it uses."""
        spec, stats, budget, inflight = self.spec, self.stats, self.budget, self._inflight
        self._permits = permits = Limiter(self._permit_limit())
        self._io = Limiter(spec.io_concurrency)
        self._reads = reads = ReadStage(spec, stats, budget, self._io, inflight, pickled=self.pool is not None)
        if self.pool is not None:
            self._session = session = PoolSession(self.pool, per_worker=spec.bound.held,
                                                  cancel_reads=spec.reads is Reads.WORKERS)
            if self.pool.fetching:  # window mode's shards: received by the workers, not here
                _fetches.offer(session.fetch)
            self._lesson = lesson = LayoutLesson(self.shared, spec.num_workers)
            self._decode = DecodeStage(
                spec, self.shared, stats, budget, reads, session, register=self.pool.register, permits=permits,
                lesson=lesson, finish=self._finish, on_quick=self._note_quick,
            )
            if spec.mode is Mode.ITER:
                self._iterable = IterableStage(spec, session, permits, self._decode, lesson, self._lease, self.plan)
        if spec.mode is Mode.EXECUTOR:
            self._executor = spec.executor.epoch(reads, stats, budget, self._finish, base_seed=self.plan.base_seed,
                                                 pin=self.transfer is not None and spec.pin)
        self._stuck = StuckReport(spec, self.pool, self._session, inflight)

    def _permit_limit(self) -> int:
        """Batches in flight plus ready: the tuner's number, or the spec's; more once batches
        are known to be quick (:class:`~aioload._engine.spec.BatchBound`)."""
        if self.spec.tuner is not None:
            return self.spec.tuner.controller.permits
        return self.spec.permits(quick=self.shared.quick)

    def _note_quick(self, quick: bool) -> None:
        """Batches turned out quick (or no longer are): resize the permits and the slot pool."""
        if quick == self.shared.quick:
            return
        self.shared.quick = quick
        if self.spec.tuner is not None:
            self.spec.tuner.controller.quick = quick
        resize_permits(self._permits, self.shared, self._permit_limit())

    async def _tuned(self) -> int:
        """The epoch, with the autotuner resizing the limits beside it when it has one to move
        (``io_concurrency="auto"`` where the workers read is theirs: see aioload._data.reads.next_limit)."""
        tuner = self.spec.tuner
        if tuner is None or not (tuner.controller.tune_io or tuner.controller.tune_depth):
            return await self._main()
        async with asyncio.TaskGroup() as tg:
            tuning = tg.create_task(self.spec.tuner.run(self.stats, self._apply_limits, self._slot_bytes))
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
                await session.broadcast(StartEpoch(self.plan.base_seed, self.plan.per_sample_seeds, self.plan.epoch))
                if self.plan.set_streams is not None and len(self.plan.set_streams) == self.pool.num_workers:
                    for wid, record in enumerate(self.plan.set_streams):
                        session.send(wid, SetStreams(record))  # the saved run's workers' streams
                for wid, resume in enumerate(self.plan.copies or ()):
                    if resume is not None and wid < self.pool.num_workers:
                        session.send(wid, resume)  # before any task: its saved state (aioload._plan.stateful)
                if self._iterable is not None:
                    self._iterable.resume()
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
                    elif self.plan.streams is not None and self.pool.broken is None:
                        # persistent workers take their streams into the next epoch: a state
                        # saved before it holds them (see aioload._plan.resume)
                        self.plan.streams.put(await session.report_streams(STREAMS_TIMEOUT))
                finally:
                    serve.cancel()
                    if not await session.aclose():
                        self.clean = False
        return total

    def _apply_limits(self, io: int, permits: int) -> None:
        """The tuner's numbers: reads in flight, and batches between the sampler and the consumer."""
        self._io.set_limit(io)
        resize_permits(self._permits, self.shared, permits)

    def _slot_bytes(self) -> int:
        """The size of one slot (0 while none exists), for the tuner's memory budget."""
        slots = self.shared.slots
        return slots.layout.size if slots is not None else 0

    async def _copies_done(self) -> None:
        """Let in-flight device copies finish before their slots can be reused, also when the
        epoch is stopped meanwhile (the consumer closing the loader right after its last batch):
        the copies are waited for, never cancelled, and the stop ends the epoch once they are done."""
        while pending := [copy for copy in self._copies if not copy.done()]:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:
                continue  # the epoch is ending anyway; its copies still read their slots

    # -- stage 1: the sampler ---------------------------------------------------------------
    async def _produce(self, tg: asyncio.TaskGroup) -> int:
        total = 0
        for seq, indices in self.plan.batches:
            await self._permits.acquire()
            tg.create_task(self._batch(self._lease(seq, indices, self._turn(seq))))
            total = seq + 1
        return total

    def _lease(self, seq: int, indices=None, turn: Turn | None = None) -> Lease:
        """Batch ``seq``'s lease, made once its permit is held."""
        batch = [] if indices is None else self.spec.batch_indices(indices)
        return Lease(seq, indices, batch, turn, permits=self._permits, ready=self.ready, shared=self.shared,
                     inflight=self._inflight)

    def _turn(self, seq: int) -> Turn | None:
        """Batch ``seq``'s place in the queue of worker ``seq mod N`` (round-robin dispatch)."""
        if not self.spec.round_robin:
            return None
        wid = seq % self.spec.num_workers
        turn = self._turns[wid] = Turn(wid, self._turns[wid])
        return turn

    async def _batch(self, lease: Lease) -> None:
        """Make the batch of ``lease`` and deliver what became of it; whatever happens, the
        lease returns what the batch still holds."""
        try:
            try:
                lesson = self._lesson
                if lesson is not None and lesson.learning():
                    item = await lesson.run(self._make, lease, shares=self._decode.shares(lease.indices))
                else:
                    item = await self._make(lease)
            except (WorkerCrashedError, TooManyErrorsError):
                raise
            except Exception as exc:  # noqa: BLE001 - this batch fails, the epoch goes on
                if self.pool is not None and self.pool.broken is not None:
                    raise  # no worker will serve this epoch again
                item = Failure(forget_locals(exc))
            lease.deliver(item)
        finally:
            lease.close()

    async def _make(self, lease: Lease):
        mode = self.spec.mode
        if mode is Mode.EXECUTOR:
            return await self._executor.make(lease.seq, lease.raw)
        if mode is Mode.READ:
            return await self._reads.read_only(lease.raw)
        if mode is Mode.ROWS:
            return await self._decode.rows(lease)
        return await self._decode.whole(lease)

    # -- stage 4: hand-off ------------------------------------------------------------------
    def _finish(self, batch, samples: int) -> Ready:
        """A built batch as the consumer gets it: its device copy started, the CPU batch (and
        so its slot) kept until the copy has read it."""
        if self.transfer is None:
            return Ready(batch=batch, samples=samples)
        out, event = self.transfer.start(batch)
        # A thread waits on the copy's event (its synchronize() lets go of the GIL), so the
        # slot goes back as soon as the copy has read it, without this loop polling the event.
        copy = self._loop.run_in_executor(None, event.synchronize)
        self._copies[copy] = batch
        copy.add_done_callback(self._copies.pop)
        return Ready(batch=out, samples=samples, event=event)


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
