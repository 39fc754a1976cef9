"""Stage 3, decoding in the workers and assembling: a batch (or chunks of it) goes to the worker
pool, which writes it into a shared-memory slot; the replies become the batch, as views of the slot.

Each batch is made under its :class:`~aioload._engine.lease.Lease`, which holds its slot (and
its permit) until the batch is delivered: a stage here takes a slot into it and hands it on to
the batch's tensors, and never releases one itself.
"""

from __future__ import annotations

import asyncio
import math
from typing import Callable

from torch.utils.data._utils.collate import collate, default_collate_fn_map

from aioload._engine.budget import SAMPLE_STAGES
from aioload._engine.ready import SKIP
from aioload._engine.spec import Collation, Mode, Ready
from aioload._base.errors import SKIP_HINT, BlockingReadWarning, unpack_exception
from aioload._handoff.chunks import chunk_samples, join_chunks, load_chunk, move_chunk_into_slot
from aioload._handoff.layout import ALIGN, Layout
from aioload._handoff.slots import SlotPool
from aioload._handoff.views import collate_rows, load_batch, load_rows, row_samples
from aioload._handoff.writers import column_views, move_into_slot
from aioload._data.reads import stall_message
from aioload._workers.messages import ChunkOut, Done, RowsOut, RowsWork, TaskError, WholeWork

CHUNK_SECONDS = 0.1
"""Target decode time of one task: long enough to hide the hand-off, short enough to balance."""

WHOLE_BATCH_SECONDS = 0.02
"""A batch that decodes in less time than this goes to one worker whole: splitting it would cost
more in hand-offs (a message each way and a join per chunk) than it saves in latency."""

_NOTHING = object()
"""The probe's sample was skipped at its read: no reply."""


class LayoutLesson:
    """Until a reply has shown the batch layout, batches that teach it start at once, as long
    as there are workers for them; the others wait for the layout, and are then written
    straight into slots. Every worker thus gets work at once, as in torch: workers that wait
    for one another (a barrier in per-worker set-up) do not deadlock."""

    def __init__(self, shared, workers: int):
        self.shared = shared
        self.workers = workers
        self.teachers = 0  # workers the batches teaching the layout occupy now (<= workers, or one batch)
        self._event = asyncio.Event()  # set (and replaced) when the layout is learned or a teacher ends

    def learning(self) -> bool:
        """Whether the layout is still unknown (and the samples may have leaves)."""
        return self.shared.layout is None and not self.shared.no_leaves

    async def run(self, make, *args, shares: int = 1):
        """``make(*args)``, once the layout is known or ``shares`` workers (those its first
        tasks occupy, one sample each) are free to teach it."""
        while self.learning():
            if self.teachers and self.teachers + shares > self.workers:
                await self._event.wait()
                continue
            self.teachers += shares
            try:
                return await make(*args)
            finally:
                self.teachers -= shares
                self.learned()
        return await make(*args)

    def learned(self) -> None:
        """Wake the batches waiting for the layout (it is known, or a teacher is done)."""
        self._event.set()
        self._event = asyncio.Event()


def noted(item, replies):
    """``item`` with the dataset states its tasks' replies captured (a Stateful map-style
    dataset: see aioload._plan.stateful), in the order the tasks ran."""
    notes = [(reply.copy.record["worker_id"], reply.copy) for reply in replies
             if isinstance(reply, Done) and reply.copy is not None]
    if notes and isinstance(item, Ready):
        item.note = notes
    return item


class DecodeStage:
    """One epoch's decoding in the worker pool, and the assembly of each batch from its slot.

    Given: ``reads`` (the :class:`~aioload._engine.reads.ReadStage` that fetches a task's items),
    ``session`` (the epoch's :class:`~aioload._workers.pool.PoolSession`), ``register`` (hands a new
    slot's memory to the workers), ``permits`` (the epoch's bound on batches, which sizes the
    slot pool), ``lesson`` (the :class:`LayoutLesson` shared with the sampler stage),
    ``finish`` (a built batch to the :class:`~aioload._engine.spec.Ready` the queue gets: its
    device copy started) and ``on_quick`` (told when batches turn out quick, or no longer are).
    Its learning (layout, collation, time per sample) lives in ``shared``, across epochs."""

    def __init__(self, spec, shared, stats, budget, reads, session, *, register: Callable, permits,
                 lesson: LayoutLesson, finish: Callable, on_quick: Callable[[bool], None]):
        self.spec = spec
        self.shared = shared
        self.stats = stats
        self.budget = budget
        self.reads = reads
        self.session = session
        self.register = register
        self.permits = permits
        self.lesson = lesson
        self.finish = finish
        self.on_quick = on_quick

    # -- slots and what the replies teach -------------------------------------------------------
    def slot(self, rows: int = 0):
        """A slot for the next batch (``None`` while the layout is unknown or has no leaves);
        a batch of ``rows`` samples, more than any slot holds so far (a batch sampler's batches
        vary), first makes the pool's later slots that much longer."""
        shared = self.shared
        if shared.layout is None or shared.no_leaves:
            return None
        if shared.slots is None:
            shared.slots = SlotPool(shared.layout, self.permits.limit + 1, self.register, self.spec.pin)
        if rows > shared.slots.layout.rows:
            shared.slots.grow_rows(rows)
        slot = shared.slots.acquire()
        for slot_id in shared.slots.take_retired():
            self.session.drop_slot(slot_id)
        return slot

    def _learn(self, specs, rows: int) -> None:
        shared = self.shared
        if shared.layout is not None or shared.no_leaves or specs is None:
            return
        if not specs:
            shared.no_leaves = True
        else:
            shared.layout = Layout(specs, rows, overflow=0)
        self.lesson.learned()

    def note_reply(self, reply: Done, rows: int, timed: bool = True) -> None:
        """Learn from a worker's reply: the layout, decode statistics (and the reads the
        worker did itself) and, when ``timed``, the time per sample that sizes later tasks."""
        count, seconds = reply.out.count, reply.seconds
        self._learn(reply.specs, rows)
        self.stats.decoded_batch(count, seconds, reply.cpu_s)
        if reply.caches is not None:
            self.stats.worker_caches(*reply.caches)
        report = reply.reads
        if report is not None:
            self.stats.worker_reads(report.latencies, report.nbytes, report.waited_s, report.limited_s)
            self.stats.read_limit(report.worker, report.limit)
            if report.stall is not None:
                self.stats.read_stalled(BlockingReadWarning(stall_message(report.stall, self.spec.dataset,
                                                                          "in an aioload worker")))
        if count and timed:
            per_sample = seconds / count
            old = self.shared.per_sample_s
            self.shared.per_sample_s = per_sample if old is None else 0.8 * old + 0.2 * per_sample
            # Quick batches (one task each, a few ms of decode) get more batches in flight; the
            # margin keeps a batch time near the line from resizing the slot pool back and forth.
            batch_s = self.shared.per_sample_s * rows
            if batch_s <= WHOLE_BATCH_SECONDS or batch_s > 2 * WHOLE_BATCH_SECONDS:
                self.on_quick(batch_s <= WHOLE_BATCH_SECONDS)
        if reply.overflow_wanted and self.shared.slots is not None:
            self.shared.slots.grow_overflow(reply.overflow_wanted * max(1, rows // max(1, count)))

    def _note_collation(self, reply: Done) -> None:
        """The first reply with a sample decides chunk mode or rows mode for good."""
        if self.shared.collation is Collation.UNKNOWN:
            out = reply.out
            if type(out) is ChunkOut:
                self.shared.collation = Collation.CHUNKS
            elif any(row >= 0 for row in out.rows):
                self.shared.collation = Collation.ROWS

    def _chunk(self, n: int) -> int:
        """Rows per task: the whole batch split across the workers, smaller once decode time
        is known so that no task takes much longer than ``CHUNK_SECONDS``."""
        if self.spec.batched_fetch or self.spec.round_robin:
            return n  # torch's way: the batch in one worker
        size = max(1, math.ceil(n / self.spec.num_workers))
        per_sample = self.shared.per_sample_s
        if per_sample is None:
            return size  # the first batches: split, so that the first one arrives fast
        if per_sample * n <= WHOLE_BATCH_SECONDS:
            return n
        return min(size, max(1, int(CHUNK_SECONDS / per_sample)))

    def shares(self, indices: list) -> int:
        """The workers a batch's first tasks go to: one per chunk in rows mode, else one."""
        if self.spec.mode is not Mode.ROWS or self.spec.batched_fetch or self.spec.round_robin:
            return 1
        n = len(indices)
        return min(self.spec.num_workers, len(range(0, n, self._chunk(n))))

    # -- errors -----------------------------------------------------------------------------
    def task_errors(self, reply: Done, offset: int = 0) -> list[TaskError]:
        """The reply's errors, their positions counted from the batch's row ``offset``."""
        return [error._replace(pos=offset + error.pos) for error in reply.errors]

    def unpack(self, error: TaskError) -> BaseException:
        """The exception a worker reported, with a note saying where it happened."""
        index, stage = error.index, error.stage
        if index is None:
            where = f"in stage {stage}"
        elif isinstance(index, list):  # collate_fn's batch, or a chunk fetched by __getitems__
            what = "the batch of dataset indices" if stage == "collate_fn" else "dataset indices"
            where = f"while running {stage} for {what} {index}"
        elif stage == "read":
            return unpack_exception(error.packed, None)  # noted in the worker: "while reading ..."
        else:
            where = f"while running {stage} for dataset index {index}{self.reads.where(index)}"
            if stage in SAMPLE_STAGES and not self.budget.skip:
                return unpack_exception(error.packed, where + " in an aioload worker" + SKIP_HINT)
        return unpack_exception(error.packed, where + " in an aioload worker")

    def raise_first(self, errors: list[TaskError]) -> None:
        """Raise the failure of the batch's first sample that failed."""
        raise self.unpack(min(errors, key=lambda e: e.pos))

    def skip(self, errors: list[TaskError]) -> None:
        """Record each failure with the error budget (``on_error="skip"``), else raise the first."""
        if not self.budget.skip:
            self.raise_first(errors)
        for error in sorted(errors, key=lambda e: e.pos):
            index = error.index
            self.budget.failed(index if isinstance(index, list) else [index], self.unpack(error))

    # -- sending ----------------------------------------------------------------------------
    async def _send(self, lease, work, slot, indices, last: bool = True) -> Done:
        """Submit one task of ``lease``'s batch; its reply. Under round-robin dispatch (the
        lease's turn), to the batch's worker once the worker's previous batch has queued its
        tasks; ``last``: this batch has no other task to queue, and the worker's next batch may go."""
        turn = lease.turn
        if turn is None:
            return await self.session.submit(work, slot, indices, lease.seq)
        await turn.wait()
        future = self.session.enqueue(work, slot, indices, lease.seq, worker=turn.worker)
        if last:
            lease.sent()
        return await future

    def _rows_work(self, items: list, row0: int) -> RowsWork:
        return RowsWork(items, row0, chunks=self.shared.collation is not Collation.ROWS)

    # -- rows mode (default collation) ------------------------------------------------------
    async def rows(self, lease):
        """``lease``'s batch with default collation: chunks of it to the workers, joined here."""
        indices = lease.indices
        n = len(indices)
        size = self._chunk(n)
        starts = list(range(0, n, size))
        probes = {}
        if self.lesson.learning() and not self.spec.batched_fetch:  # __getitems__ gets whole batches only
            # While the layout is unknown, each task's first sample goes alone, all at once (one
            # worker each); the first reply shows the layout, and the rest of every task is
            # then written straight into the slot.
            probes = dict(zip(starts, await self._probes(lease, [indices[s] for s in starts], n)))
        slot = lease.hold(self.slot(n))
        spans = [(lo, hi) for s in starts if (lo := s + (s in probes)) < (hi := min(s + size, n))]

        async def task(lo: int, hi: int):
            part = indices[lo:hi]
            items = await self.reads.items(part)
            if not items:
                return None
            desc = None
            if slot is not None:
                # A batch sampler's batch may be longer than the layout's rows; each row's share
                # of the overflow area stays aligned for the leaves written into it.
                layout = slot.layout
                per_row = layout.overflow // max(layout.rows, n) // ALIGN * ALIGN
                base = layout.fixed_bytes + lo * per_row
                desc = (slot.id, layout.describe(), (base, base + len(part) * per_row))
            return await self._send(lease, self._rows_work(items, lo), desc, part)

        if len(spans) == 1:  # the whole batch in one task: no gather to pay for
            replies = [await task(*spans[0])]
        else:
            # gather, not a task group: a task already sent to a worker must finish before the
            # slot can be reused, even when a sibling task failed to read.
            replies = await asyncio.gather(*(task(lo, hi) for lo, hi in spans), return_exceptions=True)
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
        parts = sorted([(s, self._into_slot(probe, slot, s), True) for s, probe in probes.items()]
                       + [(lo, reply, False) for (lo, _), reply in zip(spans, replies)], key=lambda p: p[0])
        return noted(self._assemble_rows(lease, parts, n), [reply for _, reply, _ in parts])

    def _assemble_rows(self, lease, parts: list, n: int):
        """The batch from its tasks' replies ``(first row, reply, probe)``: the chunks joined
        column by column, or the rows collated; ``SKIP`` when no sample is left."""
        chunks, rows, errors = [], [], []
        for start, reply, probe in parts:
            if reply is None or reply is _NOTHING:
                continue
            if not probe:
                self.note_reply(reply, self.spec.batch_size or n)
                self._note_collation(reply)
            errors += self.task_errors(reply, start)
            out = reply.out
            if type(out) is ChunkOut:
                if out.rows:
                    chunks.append((start, out.rows, load_chunk(out.skeleton)))
            else:
                rows += [(start + pos, out.skeletons[k]) for pos, k in enumerate(out.rows) if k >= 0]
        if errors:
            self.skip(errors)
        if not chunks and not rows:
            return SKIP
        view = lease.view()
        try:
            if not chunks:
                batch = collate_rows(load_rows(rows), [row for row, _ in rows], view)
                return self.finish(batch, len(rows))
            if not rows:
                try:
                    batch = join_chunks(chunks, view)
                except Exception:  # noqa: BLE001 - the chunks do not join: collated again below
                    pass
                else:
                    return self.finish(batch, sum(count for _, count, _ in chunks))
            # Chunks that do not join (samples that differ in shape or length across chunks),
            # or chunks beside rows (a task whose samples its worker could not collate, or that
            # hold a type with its own collate function): every sample, as it is, collated
            # here, so that the batch, or its error, is default_collate's over the whole batch.
            samples = [(r0 + i, sample) for r0, count, skeleton in chunks
                       for i, sample in enumerate(chunk_samples(skeleton, view, r0, count))]
            samples += zip((row for row, _ in rows), row_samples(load_rows(rows), [row for row, _ in rows], view))
            samples.sort(key=lambda pair: pair[0])
            batch = collate([sample for _, sample in samples], collate_fn_map=default_collate_fn_map)
            return self.finish(batch, len(samples))
        finally:
            if view is not None:
                view.release()

    async def _probes(self, lease, indices: list, batch_len: int) -> list:
        """Decode each of ``indices`` alone, at once, without a slot; the replies (``_NOTHING``
        for a sample skipped at its read). Each waits for the others, since they were sent
        together: none can fail while a sibling is still being decoded."""
        if len(indices) == 1:  # no gather: its extra hop would let waiting batches read first
            return [await self._probe(lease, indices[0], batch_len)]
        replies = await asyncio.gather(*(self._probe(lease, i, batch_len) for i in indices), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies

    async def _probe(self, lease, index, batch_len: int):
        """Decode one sample without a slot and learn the layout from it: slots of
        ``batch_size`` rows, or of ``batch_len`` (this batch's length) under a batch sampler."""
        items = await self.reads.items([index])
        if not items:
            return _NOTHING
        reply = await self._send(lease, self._rows_work(items, 0), None, [index], last=False)
        # Not timed: a worker's first sample pays for cold caches and lazy imports (8 ms
        # against 10 us for a 128-token row), which would cut the next batches into tiny tasks.
        self.note_reply(reply, self.spec.batch_size or batch_len, timed=False)
        self._note_collation(reply)
        return reply

    def _into_slot(self, probe, slot, row: int):
        """A probe's reply with its sample moved into ``row`` of ``slot`` (one small copy here)."""
        if slot is None or probe is _NOTHING:
            return probe
        out, layout = probe.out, slot.layout
        if type(out) is ChunkOut:
            if not out.rows:
                return probe
            moved = move_chunk_into_slot(out.skeleton, slot.segment, layout, column_views(slot.segment, layout), row)
            return probe._replace(out=out._replace(skeleton=moved))
        if not out.skeletons:
            return probe
        moved = move_into_slot(out.skeletons[0], slot.segment, layout, row)
        return probe._replace(out=RowsOut([moved], out.rows))

    # -- a whole batch (collate_fn) ---------------------------------------------------------
    async def whole(self, lease):
        """``lease``'s batch whole to one worker, collated there by ``collate_fn``."""
        items = await self.reads.items(lease.indices)
        if not items:
            return SKIP
        slot = lease.hold(self.slot())  # after the reads: a read that fails must not hold a slot
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        reply = await self._send(lease, WholeWork(items, self.spec.on_error == "skip"), desc, lease.indices)
        self.note_reply(reply, 1)
        if reply.errors:
            self.skip(self.task_errors(reply))
        failed = sum(1 for error in reply.errors if not isinstance(error.index, list))
        return noted(self.assemble_whole(lease, reply, samples=len(items) - failed), [reply])

    def assemble_whole(self, lease, reply: Done, samples: int):
        """The batch a worker collated whole (``BatchOut``), delivered; ``SKIP`` without one."""
        skeleton = reply.out.skeleton
        if skeleton is None:
            return SKIP
        view = lease.view()
        try:
            return self.finish(load_batch(skeleton, view), samples)
        finally:
            if view is not None:
                view.release()
