"""IterableDataset epochs, torch's way: each task asks one worker for the next batch of its own
copy of the dataset, round-robin over the workers that have not run out."""

from __future__ import annotations

import asyncio
import itertools

from aioload._ready import SKIP
from aioload._spec import Failure


class IterableStage:
    """The IterableDataset epoch of :class:`~aioload._engine.Engine`, whose state it uses."""

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
            self._release_slot(slot)
            raise
        finally:
            self._open.pop(seq, None)
        if reply[0] == "stop":
            active[wid] = False
            self._release_slot(slot)
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
