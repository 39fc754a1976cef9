"""Stage 3, decoding in the workers and assembling: a batch (or chunks of it) goes to the worker
pool, which writes it into a shared-memory slot; the replies become the batch, as views of the slot."""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Callable

from aioload._handoff.chunks import CHUNK_MAGIC, join_chunks, load_chunk, move_chunk_into_slot
from aioload._errors import SKIP_HINT, BlockingReadWarning, unpack_exception
from aioload._reads import stall_message
from aioload._handoff.layout import ALIGN, Layout
from aioload._handoff.views import SlotView, collate_rows, load_batch, load_rows
from aioload._handoff.writers import column_views, move_into_slot
from aioload._workers.messages import Done, TaskError
from aioload._engine.budget import SAMPLE_STAGES
from aioload._engine.ready import SKIP
from aioload._handoff.slots import SlotPool
from aioload._engine.spec import Ready

CHUNK_SECONDS = 0.1
"""Target decode time of one task: long enough to hide the hand-off, short enough to balance."""

WHOLE_BATCH_SECONDS = 0.02
"""A batch that decodes in less time than this goes to one worker whole: splitting it would cost
more in hand-offs (a message each way and a join per chunk) than it saves in latency."""

_NOTHING = object()
"""The probe's sample was skipped at its read: no reply."""


def _chunk_blob(payloads: list):
    """A chunk-mode reply's skeleton (its first payload that is there), else ``None``."""
    for payload in payloads:
        if payload is not None:
            return payload if payload.startswith(CHUNK_MAGIC) else None
    return None


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


class DecodeStage:
    """One epoch's decoding in the worker pool, and the assembly of each batch from its slot.

    Given: ``reads`` (the :class:`~aioload._engine.reads.ReadStage` that fetches a task's items),
    ``session`` (the epoch's :class:`~aioload._workers.pool.PoolSession`), ``register`` (hands a new
    slot's memory to the workers), ``permits`` (the epoch's bound on batches, which sizes the
    slot pool), ``lesson`` (the :class:`LayoutLesson` shared with the sampler stage),
    ``deliver`` (a finished batch to the :class:`~aioload._engine.spec.Ready` the queue gets),
    ``on_quick`` (told when batches turn out quick, or no longer are) and ``round_robin``
    (torch's dispatch: each batch whole to its worker, see :class:`~aioload._engine.spec.Turn`).
    Its learning (layout, chunk mode, time per sample) lives in ``shared``, across epochs."""

    def __init__(self, spec, shared, stats, budget, reads, session, *, register: Callable, permits,
                 lesson: LayoutLesson, deliver: Callable, on_quick: Callable[[bool], None], round_robin: bool):
        self.spec = spec
        self.shared = shared
        self.stats = stats
        self.budget = budget
        self.reads = reads
        self.session = session
        self.register = register
        self.permits = permits
        self.lesson = lesson
        self.deliver = deliver
        self.on_quick = on_quick
        self.round_robin = round_robin

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
        payloads, seconds = reply.payloads, reply.seconds
        self._learn(reply.specs, rows)
        self.stats.decoded_batch(len(payloads), seconds, reply.cpu_s)
        if reply.reads is not None:
            latencies, nbytes, stall = reply.reads
            self.stats.worker_reads(latencies, nbytes)
            if stall is not None:
                self.stats.read_stalled(BlockingReadWarning(stall_message(stall, self.spec.dataset,
                                                                          "in an aioload worker")))
        if payloads and timed:
            per_sample = seconds / len(payloads)
            old = self.shared.per_sample_s
            self.shared.per_sample_s = per_sample if old is None else 0.8 * old + 0.2 * per_sample
            # Quick batches (one task each, a few ms of decode) get more batches in flight; the
            # margin keeps a batch time near the line from resizing the slot pool back and forth.
            batch_s = self.shared.per_sample_s * rows
            if batch_s <= WHOLE_BATCH_SECONDS or batch_s > 2 * WHOLE_BATCH_SECONDS:
                self.on_quick(batch_s <= WHOLE_BATCH_SECONDS)
        if reply.overflow_wanted and self.shared.slots is not None:
            self.shared.slots.grow_overflow(reply.overflow_wanted * max(1, rows // max(1, len(payloads))))

    def _chunk(self, n: int) -> int:
        """Rows per task: the whole batch split across the workers, smaller once decode time
        is known so that no task takes much longer than ``CHUNK_SECONDS``."""
        if self.spec.batched_fetch or self.round_robin:
            return n  # torch's way: the batch in one worker
        size = max(1, math.ceil(n / self.spec.num_workers))
        per_sample = self.shared.per_sample_s
        if per_sample is None:
            return size  # the first batches: split, so that the first one arrives fast
        if per_sample * n <= WHOLE_BATCH_SECONDS:
            return n
        return min(size, max(1, int(CHUNK_SECONDS / per_sample)))

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

    def _skip(self, errors: list[TaskError]) -> None:
        """Record each failure with the error budget (``on_error="skip"``), else raise the first."""
        if not self.budget.skip:
            self.raise_first(errors)
        for error in sorted(errors, key=lambda e: e.pos):
            index = error.index
            self.budget.failed(index if isinstance(index, list) else [index], self.unpack(error))

    def shares(self, indices) -> int:
        """The workers a batch's first tasks go to: one per chunk in rows mode, else one."""
        if self.spec.mode != "rows" or self.spec.batched_fetch or self.round_robin:
            return 1
        n = len(self.reads.batch_indices(indices))
        return min(self.spec.num_workers, len(range(0, n, self._chunk(n))))

    async def _send(self, kind: str, slot, payload, indices, seq: int, turn, last: bool = True) -> Done:
        """Submit one task of batch ``seq``; its reply. With a ``turn`` (round-robin dispatch),
        to the batch's worker once the worker's previous batch has queued its tasks; ``last``:
        this batch has no other task to queue, and the worker's next batch may go."""
        if turn is None:
            return await self.session.submit(kind, slot, payload, indices, seq)
        await turn.wait()
        future = self.session.enqueue(kind, slot, payload, indices, seq, worker=turn.worker)
        if last:
            turn.sent()
        return await future

    async def rows(self, seq: int, indices, chunked: bool | None = None, turn=None) -> Ready:
        """Batch ``seq`` in rows or chunk mode: chunks of it to the workers, joined here."""
        indices = self.reads.batch_indices(indices) if chunked is None else indices
        n = len(indices)
        size = self._chunk(n)
        starts = list(range(0, n, size))
        probes = {}
        if self.lesson.learning() and not self.spec.batched_fetch:  # __getitems__ gets whole batches only
            # While the layout is unknown, each task's first sample goes alone, all at once (one
            # worker each); the first reply shows the layout, and the rest of every task is
            # then written straight into the slot.
            probes = await self._probes(seq, [indices[s] for s in starts], n, turn)
            probes = dict(zip(starts, probes))
        slot = self.slot(n)
        layout = slot.layout if slot is not None else None
        spans = [(s + (s in probes), min(s + size, n)) for s in starts]

        async def chunk(start: int, end: int):
            part = indices[start:end]
            items = await self.reads.items(part)
            desc = None
            if slot is not None:
                # A batch sampler's batch may be longer than the layout's rows; each row's share
                # of the overflow area stays aligned for the leaves written into it.
                per_row = layout.overflow // max(layout.rows, n) // ALIGN * ALIGN
                lo = layout.fixed_bytes + start * per_row
                desc = (slot.id, layout.describe(), (lo, lo + len(part) * per_row))
            if not items:
                return None
            mode = self.shared.chunked if chunked is None else chunked
            return await self._send("rows", desc, (items, start, mode), part, seq, turn)

        spans = [(lo, hi) for lo, hi in spans if lo < hi]
        # gather, not a task group: a chunk already sent to a worker must finish before the
        # slot can be reused, even when a sibling chunk failed to read.
        try:
            if len(spans) == 1:  # the whole batch in one task: no gather to pay for
                replies = [await chunk(*spans[0])]
            else:
                replies = await asyncio.gather(*(chunk(lo, hi) for lo, hi in spans), return_exceptions=True)
        except BaseException:
            self.release_slot(slot)
            raise
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            self.release_slot(slot)
            raise failed[0]
        parts = sorted([(s, self._into_slot(probe, slot, s), True) for s, probe in probes.items()]
                       + [(lo, reply, False) for (lo, _), reply in zip(spans, replies)], key=lambda p: p[0])
        if chunked is None and any(r is not None and r is not _NOTHING and any(e.stage == "collate" for e in r.errors)
                                   for _, r, _ in parts):
            # A chunk could not be collated (samples of different shapes, say): collate the
            # whole batch in this process instead, so the error is default_collate's own.
            self.release_slot(slot)
            return await self.rows(seq, indices, chunked=False, turn=turn)
        rows, errors, chunks = [], [], []
        for start, reply, probe in parts:
            if reply is None or reply is _NOTHING:
                continue
            if not probe:
                self.note_reply(reply, self.spec.batch_size or n)
                self._note_mode(reply)
            if reply.errors:
                errors += self.task_errors(reply, start)
            payloads = reply.payloads
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
                self.release_slot(slot)
                raise
        if chunks:
            if rows:
                self.release_slot(slot)
                raise TypeError("the samples of this batch differ in kind: some hold only tensors, numbers "
                                "and strings, others types with their own collate function; give the "
                                "DataLoader a collate_fn that handles them all")
            ready = self._assemble_chunks(slot, chunks)
            if ready is None:
                # Chunks that collated one by one do not join (samples of different shapes or
                # lengths): collate the whole batch here, so the error is default_collate's own.
                return await self.rows(seq, indices, chunked=False, turn=turn)
            return ready
        return self.assemble(slot, rows, rows_mode=True)

    async def _probes(self, seq: int, indices: list, batch_len: int, turn=None) -> list:
        """Decode each of ``indices`` alone, at once, without a slot; the replies (``_NOTHING``
        for a sample skipped at its read). Each waits for the others, since they were sent
        together: none can fail while a sibling is still being decoded."""
        if len(indices) == 1:  # no gather: its extra hop would let waiting batches read first
            return [await self._probe(seq, indices[0], batch_len, turn)]
        replies = await asyncio.gather(*(self._probe(seq, i, batch_len) for i in indices), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies

    def _into_slot(self, probe, slot, row: int):
        """A probe's reply with its sample moved into ``row`` of ``slot`` (one small copy here)."""
        if slot is None or probe is _NOTHING or probe.payloads[0] is None:
            return probe
        payload = probe.payloads[0]
        layout = slot.layout
        if payload.startswith(CHUNK_MAGIC):
            payload = move_chunk_into_slot(payload, slot.segment, layout, column_views(slot.segment, layout), row)
        else:
            payload = move_into_slot(payload, slot.segment, layout, row)
        return probe._replace(payloads=[payload])

    async def _probe(self, seq: int, index, batch_len: int, turn=None):
        """Decode one sample without a slot and learn the layout from it: slots of
        ``batch_size`` rows, or of ``batch_len`` (this batch's length) under a batch sampler."""
        items = await self.reads.items([index])
        if not items:
            return _NOTHING
        reply = await self._send("rows", None, (items, 0, None), [index], seq, turn, last=False)
        # Not timed: a worker's first sample pays for cold caches and lazy imports (8 ms
        # against 10 us for a 128-token row), which would cut the next batches into tiny tasks.
        self.note_reply(reply, self.spec.batch_size or batch_len, timed=False)
        self._note_mode(reply)
        return reply

    def _note_mode(self, reply: Done) -> None:
        """The first reply with a sample decides chunk mode or rows mode for good."""
        if self.shared.chunked is None:
            done = [p for p in reply.payloads if p]
            if done:
                self.shared.chunked = done[0].startswith(CHUNK_MAGIC)

    async def whole(self, seq: int, indices, turn=None) -> Ready:
        """Batch ``seq`` whole to one worker, collated there by ``collate_fn``."""
        batch_indices = self.reads.batch_indices(indices)
        items = await self.reads.items(batch_indices)
        if not items:
            return SKIP
        slot = self.slot()  # after the reads: a read that fails must not hold a slot
        desc = None
        if slot is not None:
            layout = slot.layout
            desc = (slot.id, layout.describe(), (layout.fixed_bytes, layout.size))
        try:
            reply = await self._send("whole", desc, (items, self.spec.on_error == "skip"), batch_indices, seq, turn)
            self.note_reply(reply, 1)
            if reply.errors:
                self._skip(self.task_errors(reply))
        except BaseException:
            self.release_slot(slot)
            raise
        failed = sum(1 for error in reply.errors if not isinstance(error.index, list))
        payload = reply.payloads[0]
        return self.assemble(slot, [(0, payload)] if payload is not None else [], rows_mode=False,
                             samples=len(items) - failed)

    def release_slot(self, slot) -> None:
        """Give ``slot`` (``None`` when the batch has none) back to the pool unused."""
        if slot is not None:
            self.shared.slots.release(slot)

    def _view(self, slot) -> SlotView | None:
        """The hand-out of ``slot`` a batch is built from; the slot goes back to the pool when
        the batch's last tensor is gone."""
        if slot is None:
            return None
        return SlotView(slot.segment, slot.layout, functools.partial(self.shared.slots.release, slot))

    def _assemble_chunks(self, slot, chunks):
        """A batch from chunk-mode replies: columns joined, views of the slot where whole;
        ``None`` when the chunks do not join (each was collated alone: samples that differ in
        shape or length across chunks)."""
        view = self._view(slot)
        try:
            batch = join_chunks(chunks, view)
        except Exception:  # noqa: BLE001 - the batch is collated again, whole, by default_collate
            return None
        finally:
            if view is not None:
                view.release()
        return self.deliver(batch, sum(n for _, n, _ in chunks))

    def assemble(self, slot, rows, rows_mode: bool, samples: int | None = None):
        """The batch from its ``(row, payload)`` replies, delivered; ``SKIP`` without rows."""
        if not rows:
            self.release_slot(slot)
            return SKIP
        view = self._view(slot)
        if rows_mode:
            batch = collate_rows(load_rows(rows), [row for row, _ in rows], view)
        else:
            batch = load_batch(rows[0][1], view)
        if view is not None:
            view.release()
        return self.deliver(batch, len(rows) if samples is None else samples)
