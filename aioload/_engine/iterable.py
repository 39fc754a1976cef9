"""IterableDataset epochs, torch's way: each task asks one worker for the next batch of its own
copy of the dataset, round-robin over the workers that have not run out.

A worker's copy yields its items in the order its tasks reach it, so each worker's tasks are
sent in their batches' order: a batch waits for the one before it on the same worker to have
sent its task (a :class:`~aioload._engine.spec.Turn`, as round-robin dispatch of map-style
batches does) before it enters the layout lesson or the pool. Without that chain, a batch
woken early from the lesson (the first epoch, while a reply teaches the layout) reached its
worker before an earlier one: a worker's items came out of order in about one first epoch in
four where one worker had no data.

Each reply says what its task did to the worker's copy (a
:class:`~aioload._workers.messages.CopyNote`: its state where it is Stateful, whether it ran
out, how many items it drew). The note rides with the batch (``Ready.note``), or, for a copy
that ran out, with the number that yields nothing (:class:`~aioload._engine.ready.Passed`), so
that the consumer applies it exactly when it passes that batch. A resumed epoch
(``plan.copies``) first sends each worker its copy's saved state
(:class:`~aioload._workers.messages.ResumeCopy`) and starts the round-robin where the saved run
was (``plan.first_worker``)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from aioload._engine.ready import SKIP, Passed
from aioload._engine.spec import Failure, Turn
from aioload._workers.messages import IterWork, Stopped


class IterableStage:
    """One IterableDataset epoch. Given: the epoch's ``session`` (the pool), ``permits`` (one
    per batch between here and the consumer), the ``decode`` stage (slots and assembly), the
    ``lesson`` (the layout learned from the first batches) and ``lease`` (a batch's
    :class:`~aioload._engine.lease.Lease`, made for a sequence number once its permit is held)."""

    def __init__(self, spec, session, permits, decode, lesson, lease: Callable, plan=None):
        self.plan = plan
        self.spec = spec
        self.session = session
        self.permits = permits
        self.decode = decode
        self.lesson = lesson
        self.lease = lease
        self.active = [True] * spec.num_workers  # False once a worker's copy has run out
        self._turns: list[Turn | None] = [None] * spec.num_workers  # each worker's last batch

    def resume(self) -> None:
        """A resumed epoch (the engine has sent each worker its copy's saved state, before any
        task): copies that had run out get no task."""
        copies = self.plan.copies if self.plan is not None else None
        if copies is None:
            return
        for wid, resume in enumerate(copies):
            if resume is None:
                continue
            fetcher = (resume.record or {}).get("fetcher_state") or {}
            if fetcher.get("fetcher_ended") and not resume.fresh:
                self.active[wid] = False

    async def run(self, tg: asyncio.TaskGroup) -> int:
        """Tasks go round-robin to the workers that have not run out; a worker that ran out
        yields nothing for its task and gets no more tasks. The number of batches started."""
        n = self.spec.num_workers
        active = self.active
        first = self.plan.first_worker if self.plan is not None else 0
        cycle = itertools.cycle([(first + i) % n for i in range(n)])
        seq = 0
        outstanding: set[asyncio.Task] = set()
        while any(active):
            await self.permits.acquire()
            for _ in range(n):
                wid = next(cycle)
                if active[wid]:
                    break
            else:
                self.permits.release()  # every worker ran out while this permit was awaited
                break
            turn = self._turns[wid] = Turn(wid, self._turns[wid])
            task = tg.create_task(self._batch(self.lease(seq, None, turn), wid))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
            seq += 1
            if len(outstanding) >= self.spec.prefetch_tasks:
                await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
        if outstanding:
            await asyncio.wait(outstanding)
        return seq

    async def _batch(self, lease, wid: int) -> None:
        try:
            await lease.turn.wait()  # this worker's batch before this one has sent its task
            item = SKIP  # a worker that ran out yields nothing: the consumer skips the number
            if self.active[wid]:
                try:
                    item = await self.lesson.run(self._make, lease, wid)
                except Exception as exc:  # noqa: BLE001 - this batch fails, the epoch goes on
                    if self.session.pool.broken is not None:
                        raise
                    item = Failure(exc, note=(wid, None))  # its turn passed: the copies' state says so
            lease.deliver(item)
        finally:
            lease.close()

    async def _make(self, lease, wid: int):
        decode = self.decode
        slot = lease.hold(decode.slot())
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        reply = self.session.enqueue(IterWork(), desc, [], lease.seq, worker=wid)
        lease.sent()  # queued: the worker's next batch may go
        reply = await reply
        if isinstance(reply, Stopped):
            self.active[wid] = False
            return SKIP if reply.copy is None else Passed((wid, reply.copy))
        decode.note_reply(reply, 1)
        if reply.errors:
            decode.raise_first(decode.task_errors(reply))
        item = decode.assemble_whole(lease, reply, samples=0)
        if reply.copy is not None and item is not SKIP:
            item.note = (wid, reply.copy)
        return item
