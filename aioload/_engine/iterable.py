"""IterableDataset epochs, torch's way: each task asks one worker for the next batch of its own
copy of the dataset, round-robin over the workers that have not run out."""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from aioload._workers.messages import Stopped
from aioload._engine.ready import SKIP
from aioload._engine.spec import Failure


class IterableStage:
    """One IterableDataset epoch. Given: the epoch's ``session`` (the pool), ``permits`` (one
    per batch between here and the consumer), the ``ready`` queue, the ``decode`` stage (slots
    and assembly), the ``lesson`` (the layout learned from the first batches), ``inflight``
    (open batches, for the stuck report) and ``put`` (a finished batch to the ready queue,
    returning its permit when the consumer was already waiting)."""

    def __init__(self, spec, session, permits, ready, decode, lesson, inflight, put: Callable):
        self.spec = spec
        self.session = session
        self.permits = permits
        self.ready = ready
        self.decode = decode
        self.lesson = lesson
        self.inflight = inflight
        self.put = put
        self.active = [True] * spec.num_workers  # False once a worker's copy has run out

    async def run(self, tg: asyncio.TaskGroup) -> int:
        """Tasks go round-robin to the workers that have not run out; a worker that ran out
        yields nothing for its task and gets no more tasks. The number of batches started."""
        n = self.spec.num_workers
        active = self.active
        cycle = itertools.cycle(range(n))
        seq = 0
        outstanding: set[asyncio.Task] = set()
        while any(active):
            await self.permits.acquire()
            for _ in range(n):
                wid = next(cycle)
                if active[wid]:
                    break
            else:
                self.permits.release()
                break
            task = tg.create_task(self._batch(seq, wid))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
            seq += 1
            if len(outstanding) >= self.spec.prefetch_tasks:
                await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
        if outstanding:
            await asyncio.wait(outstanding)
        return seq

    def _nothing(self, seq: int) -> None:
        """Batch ``seq`` yields nothing: the consumer skips it and its permit comes back."""
        self.ready.put(seq, SKIP)
        self.permits.release()

    async def _batch(self, seq: int, wid: int) -> None:
        if not self.active[wid]:
            self._nothing(seq)
            return
        await self.lesson.run(self._batch_in, seq, wid)

    async def _batch_in(self, seq: int, wid: int) -> None:
        decode = self.decode
        slot = decode.slot()
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        self.inflight.batches[seq] = []
        try:
            reply = await self.session.submit("iter", desc, None, [], seq, worker=wid)
        except BaseException:
            decode.release_slot(slot)
            raise
        finally:
            self.inflight.batches.pop(seq, None)
        if isinstance(reply, Stopped):
            self.active[wid] = False
            decode.release_slot(slot)
            self._nothing(seq)
            return
        try:
            decode.note_reply(reply, 1)
            if reply.errors:
                decode.raise_first(decode.task_errors(reply))
            item = decode.assemble(slot, [(0, reply.payloads[0])], rows_mode=False, samples=0)
        except Exception as exc:  # noqa: BLE001
            item = Failure(exc)
        self.put(seq, item)
