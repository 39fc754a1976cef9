"""Stage 3, decoding in the workers and assembling: a batch (or chunks of it) goes to the worker
pool, which writes it into a shared-memory slot; the replies become the batch, as views of the slot."""

from __future__ import annotations

import asyncio
import functools
import math

from aioload._chunks import CHUNK_MAGIC, join_chunks, load_chunk, move_chunk_into_slot
from aioload._errors import unpack_exception
from aioload._slotlayout import ALIGN, Layout
from aioload._slotread import SlotView, collate_rows, load_batch, load_rows
from aioload._slotwrite import column_views, move_into_slot
from aioload._ready import SKIP
from aioload._slots import SlotPool
from aioload._spec import Ready

CHUNK_SECONDS = 0.1
"""Target decode time of one task: long enough to hide the hand-off, short enough to balance."""

WHOLE_BATCH_SECONDS = 0.02
"""A batch that decodes in less time than this goes to one worker whole: splitting it would cost
more in hand-offs (a message each way and a join per chunk) than it saves in latency."""

_NOTHING = ("nothing",)
"""The probe's sample was skipped at its read: no reply."""


def _chunk_blob(payloads: list):
    """A chunk-mode reply's skeleton (its first payload that is there), else ``None``."""
    for payload in payloads:
        if payload is not None:
            return payload if payload.startswith(CHUNK_MAGIC) else None
    return None


class DecodeStage:
    """The decode and assembly stage of :class:`~aioload._engine.Engine`, whose state it uses."""

    def _slot(self, rows: int = 0):
        """A slot for the next batch (``None`` while the layout is unknown or has no leaves);
        a batch of ``rows`` samples, more than any slot holds so far (a batch sampler's batches
        vary), first makes the pool's later slots that much longer."""
        shared = self.shared
        if shared.layout is None or shared.no_leaves:
            return None
        if shared.slots is None:
            shared.slots = SlotPool(shared.layout, self._permits.limit + 1, self.pool.register, self.spec.pin)
        if rows > shared.slots.layout.rows:
            shared.slots.grow_rows(rows)
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
        self._lesson_learned()

    def _note_reply(self, reply, rows: int, timed: bool = True) -> None:
        """Learn from a worker's reply: the layout, decode statistics and, when ``timed``,
        the time per sample that sizes later tasks."""
        _, _, payloads, _, specs, overflow_wanted, seconds, *cpu = reply
        self._learn(specs, rows)
        self.stats.decoded_batch(len(payloads), seconds, cpu[0] if cpu else seconds)
        if payloads and timed:
            per_sample = seconds / len(payloads)
            old = self.shared.per_sample_s
            self.shared.per_sample_s = per_sample if old is None else 0.8 * old + 0.2 * per_sample
            # Quick batches (one task each, a few ms of decode) get more batches in flight; the
            # margin keeps a batch time near the line from resizing the slot pool back and forth.
            batch_s = self.shared.per_sample_s * rows
            if batch_s <= WHOLE_BATCH_SECONDS or batch_s > 2 * WHOLE_BATCH_SECONDS:
                self._note_quick(batch_s <= WHOLE_BATCH_SECONDS)
        if overflow_wanted and self.shared.slots is not None:
            self.shared.slots.grow_overflow(overflow_wanted * max(1, rows // max(1, len(payloads))))

    def _chunk(self, n: int) -> int:
        """Rows per task: the whole batch split across the workers, smaller once decode time
        is known so that no task takes much longer than ``CHUNK_SECONDS``."""
        if self.spec.batched_fetch or self._round_robin:
            return n  # torch's way: the batch in one worker
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

    def _shares(self, indices) -> int:
        """The workers a batch's first tasks go to: one per chunk in rows mode, else one."""
        if self.spec.mode != "rows" or self.spec.batched_fetch or self._round_robin:
            return 1
        n = len(self._batch_indices(indices))
        return min(self.spec.num_workers, len(range(0, n, self._chunk(n))))

    async def _send(self, kind: str, slot, payload, indices, seq: int, turn, last: bool = True) -> tuple:
        """Submit one task of batch ``seq``; its reply. With a ``turn`` (round-robin dispatch),
        to the batch's worker once the worker's previous batch has queued its tasks; ``last``:
        this batch has no other task to queue, and the worker's next batch may go."""
        if turn is None:
            return await self._session.submit(kind, slot, payload, indices, seq)
        await turn.wait()
        future = self._session.enqueue(kind, slot, payload, indices, seq, worker=turn.worker)
        if last:
            turn.sent()
        return await future

    async def _rows(self, seq: int, indices, chunked: bool | None = None, turn=None) -> Ready:
        indices = self._batch_indices(indices) if chunked is None else indices
        n = len(indices)
        size = self._chunk(n)
        starts = list(range(0, n, size))
        probes = {}
        if self._learning() and not self.spec.batched_fetch:  # __getitems__ gets whole batches only
            # While the layout is unknown, each task's first sample goes alone, all at once (one
            # worker each); the first reply shows the layout, and the rest of every task is
            # then written straight into the slot.
            probes = await self._probes(seq, [indices[s] for s in starts], n, turn)
            probes = dict(zip(starts, probes))
        slot = self._slot(n)
        layout = slot.layout if slot is not None else None
        spans = [(s + (s in probes), min(s + size, n)) for s in starts]

        async def chunk(start: int, end: int):
            part = indices[start:end]
            items = await self._read_items(part)
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
            self._release_slot(slot)
            raise
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            self._release_slot(slot)
            raise failed[0]
        parts = sorted([(s, self._into_slot(probe, slot, s), True) for s, probe in probes.items()]
                       + [(lo, reply, False) for (lo, _), reply in zip(spans, replies)], key=lambda p: p[0])
        if chunked is None and any(r not in (None, _NOTHING) and any(e[2] == "collate" for e in r[3])
                                   for _, r, _ in parts):
            # A chunk could not be collated (samples of different shapes, say): collate the
            # whole batch in this process instead, so the error is default_collate's own.
            self._release_slot(slot)
            return await self._rows(seq, indices, chunked=False, turn=turn)
        rows, errors, chunks = [], [], []
        for start, reply, probe in parts:
            if reply is None or reply is _NOTHING:
                continue
            if not probe:
                self._note_reply(reply, self.spec.batch_size or n)
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
                self._release_slot(slot)
                raise
        if chunks:
            if rows:
                self._release_slot(slot)
                raise TypeError("the samples of this batch differ in kind: some hold only tensors, numbers "
                                "and strings, others types with their own collate function; give the "
                                "DataLoader a collate_fn that handles them all")
            ready = self._assemble_chunks(slot, chunks)
            if ready is None:
                # Chunks that collated one by one do not join (samples of different shapes or
                # lengths): collate the whole batch here, so the error is default_collate's own.
                return await self._rows(seq, indices, chunked=False, turn=turn)
            return ready
        return self._assemble(slot, rows, rows_mode=True)

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
        if slot is None or probe is _NOTHING or probe[2][0] is None:
            return probe
        payload = probe[2][0]
        layout = slot.layout
        if payload.startswith(CHUNK_MAGIC):
            payload = move_chunk_into_slot(payload, slot.segment, layout, column_views(slot.segment, layout), row)
        else:
            payload = move_into_slot(payload, slot.segment, layout, row)
        return probe[:2] + ([payload],) + probe[3:]

    async def _probe(self, seq: int, index, batch_len: int, turn=None):
        """Decode one sample without a slot and learn the layout from it: slots of
        ``batch_size`` rows, or of ``batch_len`` (this batch's length) under a batch sampler."""
        items = await self._read_items([index])
        if not items:
            return _NOTHING
        reply = await self._send("rows", None, (items, 0, None), [index], seq, turn, last=False)
        # Not timed: a worker's first sample pays for cold caches and lazy imports (8 ms
        # against 10 us for a 128-token row), which would cut the next batches into tiny tasks.
        self._note_reply(reply, self.spec.batch_size or batch_len, timed=False)
        self._note_mode(reply)
        return reply

    def _note_mode(self, reply) -> None:
        """The first reply with a sample decides chunk mode or rows mode for good."""
        if self.shared.chunked is None:
            done = [p for p in reply[2] if p]
            if done:
                self.shared.chunked = done[0].startswith(CHUNK_MAGIC)

    async def _whole(self, seq: int, indices, turn=None) -> Ready:
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
            reply = await self._send("whole", desc, (items, self.spec.on_error == "skip"), batch_indices, seq, turn)
            self._note_reply(reply, 1)
            if reply[3]:
                self._skip(self._errors(reply))
        except BaseException:
            self._release_slot(slot)
            raise
        failed = sum(1 for error in reply[3] if not isinstance(error[1], list))
        return self._assemble(slot, [(0, reply[2][0])] if reply[2][0] is not None else [], rows_mode=False,
                              samples=len(items) - failed)

    def _release_slot(self, slot) -> None:
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
        return self._deliver(batch, sum(n for _, n, _ in chunks))

    def _assemble(self, slot, rows, rows_mode: bool, samples: int | None = None):
        if not rows:
            self._release_slot(slot)
            return SKIP
        view = self._view(slot)
        if rows_mode:
            batch = collate_rows(load_rows(rows), [row for row, _ in rows], view)
        else:
            batch = load_batch(rows[0][1], view)
        if view is not None:
            view.release()
        return self._deliver(batch, len(rows) if samples is None else samples)
