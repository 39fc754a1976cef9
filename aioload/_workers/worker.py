"""The worker process: receives tasks, decodes samples, writes them into shared-memory slots.

A worker gets its copy of the dataset once, when it starts. It then serves tasks until the
loader stops it or its socket closes (the parent went away): a worker never outlives its loader.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import queue
import signal
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.data._utils.worker as torch_worker

from aioload._workers import wire as _wire
from aioload._base.errors import pack_exception
from aioload._handoff.chunks import ChunkWriter
from aioload._workers.parent import exit_with
from aioload._handoff.layout import Layout
from aioload._handoff.writers import RowWriter, SlotWriter, column_views
from aioload._workers.messages import (BatchOut, CancelReads, ChunkOut, Done, DropSlots, Fetched, FetchShard,
                                      InitError, IterWork, ReadReport, ReportStreams, ResumeCopy, RowsOut, RowsWork,
                                      SetStreams, Shutdown, StartEpoch, Stopped, Streams, Task, TaskError, WholeWork,
                                      WorkerReady)
from aioload._base.seeding import capture_streams, restore_streams, sample_seed, seed_everything, seed_worker
from aioload._handoff import shared as _shared
from aioload._handoff.shm import Segment, recv_fd, send_fd
from aioload._base.walk import caches_of, held_bytes
from aioload._workers.fetches import ShardFetches
from aioload._workers.reads import FailedRead, WorkerReads
from aioload._workers import stacks as _stacks
from aioload._workers.state import CopyState, dataset_note, load_dataset_state

SLOT_HEADER = struct.Struct("<qq")


@dataclass
class WorkerConfig:
    """What every worker needs, delivered once at start-up."""

    dataset: Any
    num_workers: int
    split: bool
    iterable: bool
    auto_collation: bool
    collate_fn: Callable | None
    batch_size: int | None
    drop_last: bool
    worker_init_fn: Callable | None
    base_seed: int
    exact_seeds: bool = False  # seed= given: every sample is seeded alone
    keep_rng: bool = False  # persistent_workers=True: RNG streams go on across epochs, as in torch
    batched_fetch: bool = False  # a batch is fetched with one __getitems__ call, as torch does
    stateful: bool = False  # a map-style dataset with state_dict/load_state_dict: captured after each task
    read_in_workers: bool = False  # the workers await dataset.read themselves (aioload._workers.reads)
    read_limit: int = 1  # with read_in_workers: reads in flight per worker, at first
    read_ceiling: int = 1  # ... and how far that limit may grow (read_limit: it stays)
    read_timeout: float | None = None  # with read_in_workers: seconds one read may take
    fetch_shards: bool = False  # window mode's shards are fetched here (aioload._workers.fetches)


def _set_worker_info(worker_id: int, cfg: WorkerConfig, seed: int) -> None:
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )


PROGRESS_ID = -1
"""The slot id under which the pool sends a worker its progress cells."""

COLLATING = -2
"""The progress cell's index while ``collate_fn`` runs (``-1``: no sample index known)."""

_CELL_MAX = (1 << 63) - 1

def _cell(index) -> int:
    """What a progress cell (an int64) holds for ``index``: the index when it is an ``int``
    that fits, else ``-1`` (not known). A sampler may yield any index, 2**64 or a key."""
    return index if isinstance(index, int) and (0 <= index <= _CELL_MAX or index == COLLATING) else -1


class _Abandoned(Exception):
    """The pool said Shutdown while a task was being decoded: nobody waits for its result."""


class _Worker:
    def __init__(self, worker_id: int, cfg: WorkerConfig, sock, ctrl, progress=None):
        self.id = worker_id
        self.progress = progress  # shared (task id, index) per worker: what a stuck worker is on
        self.task = -1
        self.cfg = cfg
        self.sock = sock
        self.reader = _wire.Reader(sock)
        self.ctrl = ctrl
        self.segments: dict[int, Segment] = {}
        self.shared_fds: dict[int, int] = {}  # shared bytes' descriptors received before they were asked for
        self.layouts: dict[int, tuple] = {}  # slot id -> (description, Layout, column views)
        self.base_seed = cfg.base_seed
        self.per_sample_seeds = True
        self.copy: CopyState | None = None  # an IterableDataset's copy in this epoch
        self.resume: ResumeCopy | None = None  # what the epoch's copy resumes from
        self.seeded: int | None = None
        self.served = False  # a task ran since the worker was last seeded  # the base seed the worker's RNGs were last seeded from
        self.reads: WorkerReads | None = None  # with cfg.read_in_workers, once worker_init_fn has run
        self.fetches: ShardFetches | None = None  # with cfg.fetch_shards, once worker_init_fn has run
        self.sending = threading.Lock()  # replies (this thread) and fetches' answers (theirs) share the socket
        self.inbox: queue.SimpleQueue | None = None  # with reads here: (message, reading) in arrival order
        # set by the receiving thread once Shutdown has arrived: the tasks still in the inbox
        # are dropped, not decoded (nobody waits for them: the pool is closing)
        self.stopping = threading.Event()
        self.caches: list | None = None  # the dataset's caches, whose bytes each reply reports

    # -- set-up -------------------------------------------------------------------------
    def start_epoch(self, base_seed: int, per_sample_seeds: bool, epoch: int = 0) -> None:
        """Seed as torch seeds a worker started for this epoch. A fresh worker already seeded
        from this base seed (after worker_init_fn, which may seed in its turn), and one whose
        streams go on across epochs (``keep_rng``, torch's persistent workers), keep their RNG
        state; a worker that served an epoch is seeded again even from the same base seed (a
        resumed epoch replays its seeds)."""
        self.base_seed = base_seed
        self.per_sample_seeds = per_sample_seeds
        self.epoch = epoch  # given to the epoch's copy of an IterableDataset (its set_epoch)
        self.copy = None
        self.resume = None
        reused = self.served and not self.cfg.keep_rng
        if self.seeded is None or reused or (base_seed != self.seeded and not self.cfg.keep_rng):
            self.seeded = base_seed
            _set_worker_info(self.id, self.cfg, seed_worker(base_seed, self.id))
        self.served = False

    def segment(self, slot_id: int) -> Segment:
        seg = self.segments.get(slot_id)
        while seg is None:
            self.receive_fd()
            seg = self.segments.get(slot_id)
        return seg

    def shared_fd(self, segment_id: int) -> int:
        """The descriptor of the shared bytes ``segment_id``, sent just before the task being
        unpickled (see :mod:`aioload._handoff.shared`); the caller closes it."""
        while segment_id not in self.shared_fds:
            self.receive_fd()
        return self.shared_fds.pop(segment_id)

    def receive_fd(self) -> None:
        """The next descriptor on the control socket: a slot's is mapped and kept, shared
        bytes' kept for :meth:`shared_fd`."""
        header, fd = recv_fd(self.ctrl, SLOT_HEADER.size)
        sid, size = SLOT_HEADER.unpack(header)
        if _shared.is_shared(sid):
            self.shared_fds[sid] = fd
        else:
            self.segments[sid] = Segment(fd, size)

    def drop(self, slot_ids) -> None:
        for sid in slot_ids:
            self.layouts.pop(sid, None)
            seg = self.segments.pop(sid, None)
            if seg is not None:
                seg.close()

    def writer(self, slot, kind=SlotWriter):
        """A :class:`SlotWriter` (whole batches) or :class:`RowWriter` (rows) for ``slot``."""
        if slot is None:
            return kind(None, None, None)
        slot_id, layout_desc, overflow = slot
        segment = self.segment(slot_id)
        cached = self.layouts.get(slot_id)
        if cached is None or cached[0] != layout_desc:
            leaves, rows, ovf = layout_desc
            layout = Layout(leaves, rows, ovf)
            cached = self.layouts[slot_id] = (layout_desc, layout, column_views(segment, layout))
        return kind(segment, cached[1], overflow, cached[2])

    # -- the work ------------------------------------------------------------------------
    def mark(self, index) -> None:
        """Note in shared memory which sample this worker is on (read by the parent only when
        ``timeout=`` expires, to name the sample that is stuck)."""
        if self.progress is not None:
            self.progress[2 * self.id + 1] = _cell(index)
            self.progress[2 * self.id] = self.task

    def fetch_batch(self, indices: list) -> Any:
        if self.per_sample_seeds:
            seed_everything(sample_seed(self.base_seed, indices[0]))
        return self.cfg.dataset.__getitems__(indices)

    def load(self, index, raw):
        self.mark(index)
        ds = self.cfg.dataset
        if self.per_sample_seeds and index is not None:
            seed_everything(sample_seed(self.base_seed, index))
        if self.cfg.split:
            if isinstance(raw, FailedRead):
                raise raw.error
            return ds.decode(raw)
        return ds[index]

    def pairs(self, items) -> list:
        """A task's ``(index, raw)`` pairs; a dataset without a read stage is sent bare indices."""
        return items if self.cfg.split else list(zip(items, itertools.repeat(None)))

    def indices(self, items) -> list:
        """A task's dataset indices (``items`` as sent)."""
        return [i for i, _ in items] if self.cfg.split else list(items)

    def fetch_each(self, items) -> tuple[list, list]:
        """A task's samples one by one, in order: ``(samples, errors)``; a sample that failed
        is left out of ``samples`` and has its error (at its position) in ``errors``."""
        stopping = self.stopping
        if self.cfg.split or self.per_sample_seeds:
            samples, errors = [], []
            for pos, (index, raw) in enumerate(self.pairs(items)):
                if stopping.is_set():
                    raise _Abandoned
                try:
                    samples.append(self.load(index, raw))
                except Exception as exc:  # noqa: BLE001
                    errors.append(TaskError(pos, index, self.stage(raw), pack_exception(exc)))
            return samples, errors
        # Bare indices, no seeding: the loop that torch's fetcher runs, plus one store per
        # sample saying which index this worker is on.
        dataset, progress, cell = self.cfg.dataset, self.progress, 2 * self.id + 1
        if progress is not None:
            progress[cell - 1] = self.task
        samples, errors = [], []
        for pos, index in enumerate(items):
            if stopping.is_set():
                raise _Abandoned
            if progress is not None:
                progress[cell] = index if type(index) is int and 0 <= index <= _CELL_MAX else -1
            try:
                samples.append(dataset[index])
            except Exception as exc:  # noqa: BLE001
                errors.append(TaskError(pos, index, self.stage(), pack_exception(exc)))
        return samples, errors

    def fetch(self, items) -> tuple[list, list] | TaskError:
        """A rows task's samples: ``fetch_each``'s, or one ``__getitems__`` call
        (``batched_fetch``), whose failure is the whole task's error."""
        if not self.cfg.batched_fetch:
            return self.fetch_each(items)
        indices = self.indices(items)
        try:
            return list(self.fetch_batch(indices)), []
        except Exception as exc:  # noqa: BLE001 - reported to the consumer with its indices
            return TaskError(0, indices, "__getitems__", pack_exception(exc))

    def stage(self, raw=None) -> str:
        """The stage a sample failed in: its read (in this worker), decode or __getitem__."""
        if isinstance(raw, FailedRead):
            return "read"
        return "decode" if self.cfg.split else "__getitem__"

    def run_rows(self, task_id: int, slot, work: RowsWork) -> Done:
        """Some samples of a batch into their rows of the slot: collated as one chunk where
        ``work.chunks`` asks for it and the samples allow it (see :mod:`aioload._handoff.chunks`),
        else one skeleton per row."""
        started = time.perf_counter()
        fetched = self.fetch(work.items)
        if isinstance(fetched, TaskError):
            out = RowsOut([], [-1] * len(work.items))
            return Done(task_id, out, [fetched], None, 0, time.perf_counter() - started)
        samples, errors = fetched
        if work.chunks and samples:
            done = self.chunk(task_id, slot, work, samples, errors, started)
            if done is not None:
                return done
        return self.rows(task_id, slot, work, samples, errors, started)

    def chunk(self, task_id: int, slot, work: RowsWork, samples: list, errors: list, started: float) -> Done | None:
        """``samples`` collated into the slot as one chunk; ``None`` when they cannot be (a type
        with its own collate function, or samples that ``collate`` rejects): rows mode then
        takes them as they are, and the parent collates the batch, so that its result or
        its error is ``default_collate``'s over the whole batch."""
        writer = self.chunk_writer(slot, work.row0)
        try:
            blob = writer.dump(samples)
        except Exception:  # noqa: BLE001 - Unsupported, or collate's error: rows mode, then the parent's collate
            return None
        specs = writer.specs if slot is None else None
        out = ChunkOut(blob, len(samples), len(work.items))
        return Done(task_id, out, errors, specs, 0, time.perf_counter() - started)

    def rows(self, task_id: int, slot, work: RowsWork, samples: list, errors: list, started: float) -> Done:
        """Rows mode: each sample's leaves into its row of the slot, its skeleton pickled;
        samples that failed (``errors``) have no row."""
        writer = self.writer(slot, RowWriter)
        failed = {error.pos for error in errors}
        # each sample's position in the task: the items that did not fail, in order (one
        # __getitems__ call gives one sample per position, however many it returns)
        positions = range(len(samples)) if self.cfg.batched_fetch else \
            [pos for pos in range(len(work.items)) if pos not in failed]
        rows = [-1] * max(len(work.items), len(samples))
        skeletons: list[bytes] = []
        previous = None
        for pos, sample in zip(positions, samples):
            try:
                data = writer.dump(sample, work.row0 + pos)
            except Exception as exc:  # noqa: BLE001
                errors.append(TaskError(pos, self.indices(work.items[pos:pos + 1])[0] if pos < len(work.items) else None,
                                        self.stage(), pack_exception(exc)))
                continue
            # uniform batches share one skeleton: the parent unpickles it once
            if data != previous:
                skeletons.append(data)
                previous = data
            rows[pos] = len(skeletons) - 1
        specs = writer.first_specs if slot is None else None
        errors.sort(key=lambda e: e.pos)
        return Done(task_id, RowsOut(skeletons, rows), errors, specs, writer.overflow_wanted,
                    time.perf_counter() - started)

    def chunk_writer(self, slot, row0: int) -> ChunkWriter:
        if slot is None:
            return ChunkWriter(None, None, row0, None)
        writer = self.writer(slot, SlotWriter)
        return ChunkWriter(writer.segment, writer.layout, row0, writer.columns)

    def run_whole(self, task_id: int, slot, work: WholeWork) -> Done:
        """One whole batch, collated by ``collate_fn``; ``work.items`` as :class:`RowsWork`'s."""
        writer = self.writer(slot)
        started = time.perf_counter()
        items = work.items
        indices = self.indices(items)
        if self.cfg.auto_collation and self.cfg.batched_fetch:
            try:
                samples = self.fetch_batch(indices)
            except Exception as exc:  # noqa: BLE001 - reported to the consumer with its index
                errors = [TaskError(0, indices[0], "__getitems__", pack_exception(exc))]
                return Done(task_id, BatchOut(None), errors, None, 0, time.perf_counter() - started)
            return self.finish_batch(task_id, slot, writer, samples, [], started, indices)
        samples, errors = self.fetch_each(items)
        if (errors and not work.skip_errors) or not samples:
            return Done(task_id, BatchOut(None), errors, None, 0, time.perf_counter() - started)
        failed = {error.pos for error in errors}
        collated = [index for pos, index in enumerate(indices) if pos not in failed]
        return self.finish_batch(task_id, slot, writer, samples, errors, started, collated)

    def finish_batch(self, task_id, slot, writer, samples, errors, started, index) -> Done:
        cfg = self.cfg
        self.mark(COLLATING)
        try:
            if cfg.auto_collation:
                batch = cfg.collate_fn(samples)
            else:
                batch = cfg.collate_fn(samples[0])
            payload = writer.dump(batch, 0)
        except Exception as exc:  # noqa: BLE001
            errors.append(TaskError(0, index, "collate_fn", pack_exception(exc)))
            payload = None
        specs = writer.first_specs if slot is None else None
        seconds = time.perf_counter() - started
        return Done(task_id, BatchOut(payload), errors, specs, writer.overflow_wanted, seconds)

    def run_iter(self, task_id, slot):
        """The next batch of this worker's copy of the IterableDataset, with what it did to the
        copy (its state where the copy is Stateful: see :mod:`aioload._workers.state`)."""
        cfg = self.cfg
        started = time.perf_counter()
        try:
            if self.copy is None:
                self.copy = CopyState(self.id, cfg.dataset, self.resume, self.epoch)
                self.resume = None
            samples = self.copy.batch(cfg.batch_size if cfg.auto_collation else None, cfg.drop_last)
        except Exception as exc:  # noqa: BLE001
            errors = [TaskError(0, None, "__iter__", pack_exception(exc))]
            return Done(task_id, BatchOut(None), errors, None, 0, time.perf_counter() - started)
        if samples is None:
            return Stopped(task_id, self.copy.note(0))
        done = self.finish_batch(task_id, slot, self.writer(slot), samples, [], started, None)
        return done._replace(copy=self.copy.note(len(samples)))

    def serve(self) -> None:
        while (message := self.next_message()) is not None:
            msg, reading = message
            if isinstance(msg, Shutdown):
                return
            if self.stopping.is_set():
                return  # the pool is closing: the tasks still queued go undone
            if isinstance(msg, StartEpoch):
                self.start_epoch(msg.base_seed, msg.per_sample_seeds, msg.epoch)
                continue
            if isinstance(msg, DropSlots):
                self.drop(msg.slot_ids)
                continue
            if isinstance(msg, ReportStreams):  # every task before it is answered: the epoch is over
                with self.sending:
                    _wire.send_blocking(self.sock, Streams(capture_streams(torch_worker._worker_info.seed)))
                continue
            if isinstance(msg, SetStreams):  # a resumed epoch: the saved run's worker's streams
                restore_streams(msg.record)
                _set_worker_info(self.id, self.cfg, msg.record["seed"])
                continue
            if isinstance(msg, ResumeCopy):
                if self.cfg.iterable:
                    self.resume = msg  # given to the epoch's copy when it is made
                else:
                    load_dataset_state(self.cfg.dataset, msg.record)
                continue
            try:
                reply = self.run(msg, reading)
            except _Abandoned:
                return
            # the task's items go before the reply does: the shared bytes they map are unmapped
            # by the time the loader learns that the task is done (aioload._handoff.shared)
            message = msg = reading = None
            with self.sending:
                _wire.send_blocking(self.sock, reply)

    def run(self, task: Task, reading) -> Done | Stopped:
        """One task, its reads (started on arrival, ``reading``) awaited first."""
        self.task = task.task_id
        self.served = True
        self.drop(task.drops)
        cpu = time.process_time()
        work, report = task.work, None
        if reading is not None:
            work, report = self.with_reads(work, reading)
        kind = type(work)
        if kind is RowsWork:
            reply = self.run_rows(task.task_id, task.slot, work)
        elif kind is WholeWork:
            reply = self.run_whole(task.task_id, task.slot, work)
        elif kind is IterWork:
            reply = self.run_iter(task.task_id, task.slot)
        else:  # pragma: no cover - a bug in the engine
            raise RuntimeError(f"unknown task {kind.__name__}")
        if isinstance(reply, Done):
            # CPU seconds (compared to wall time in stats), and the reads made here
            reply = reply._replace(cpu_s=time.process_time() - cpu, reads=report)
            if self.cfg.stateful:  # the dataset's state after this task's samples
                reply = reply._replace(copy=dataset_note(self.id, self.cfg.dataset))
            if self.caches is None:  # found once: a dataset makes its caches when it is made
                self.caches = caches_of(self.cfg.dataset)
            held = held_bytes(self.caches)
            if held:
                reply = reply._replace(caches=(self.id, tuple(held.items())))
        return reply

    # -- reads in this worker (cfg.read_in_workers) ------------------------------------------
    def next_message(self) -> tuple | None:
        """The next message and, for a task, its reads started here (else ``None``); ``None``
        once the parent has gone away. With reads in this worker, a receiving thread takes
        every message in as it arrives and starts its task's reads at once: they run on the
        worker's loop while this thread decodes the tasks before it."""
        if self.inbox is None:
            msg = self.reader.recv_blocking()
            return None if msg is None else (msg, None)
        return self.inbox.get()

    def _cancel_reads(self) -> None:
        """Every read and shard fetch in flight in this worker, cancelled."""
        if self.reads is not None:
            self.reads.cancel()
        if self.fetches is not None:
            self.fetches.cancel()

    def receive(self) -> None:
        """The receiving thread: messages in order into the inbox, reads started on the way;
        ``None`` last, once the parent has gone away or said to stop."""
        try:
            while (msg := self.reader.recv_blocking()) is not None:
                if isinstance(msg, CancelReads):  # at once: the tasks it ends wait in the inbox
                    self._cancel_reads()
                    continue
                if isinstance(msg, FetchShard):
                    self.fetches.start(msg)
                    continue
                reading = None
                if isinstance(msg, Shutdown):  # the pool is closing (an epoch left early, close()): no queued task runs
                    self.stopping.set()
                    self._cancel_reads()
                if isinstance(msg, Task) and not isinstance(msg.work, IterWork) and self.reads is not None:
                    reading = self.reads.start(list(msg.work.items))
                self.inbox.put((msg, reading))
                if isinstance(msg, Shutdown):
                    break
                # not kept while the next message is awaited: a task's items may map shared
                # bytes, which go when the thread that decodes is done with them
                msg = reading = None
        finally:
            self.inbox.put(None)

    def answer_fetch(self, fetch_id: int, size: int, memory, packed: bytes | None) -> None:
        """A fetch's end, to the pool (from the fetches' thread): its memfd first, on the
        control socket, then :class:`Fetched` on the task socket. A parent gone meanwhile is
        found by the thread that decodes."""
        with self.sending:
            try:
                if memory is not None:
                    send_fd(self.ctrl, memory.fd, SLOT_HEADER.pack(fetch_id, size))
                _wire.send_blocking(self.sock, Fetched(fetch_id, size, packed))
            except OSError:
                pass

    def with_reads(self, work: RowsWork | WholeWork, reading) -> tuple:
        """``work`` with its bare indices paired with what their reads returned, as if the
        engine had read them, and the :class:`ReadReport` of those reads (the limit adapted
        to what this task waited for)."""
        indices = work.items
        raws, latencies, nbytes, waited, limited = self.reads.wait(indices, reading, self.mark)
        limit = self.reads.adapt(waited, limited)
        report = ReadReport(latencies, nbytes, self.reads.meter.take(), waited, limited, limit, self.id)
        return work._replace(items=list(zip(indices, raws))), report


def _receive_progress(ctrl):
    """The pool's progress cells: the first memory the control socket carries."""
    try:
        header, fd = recv_fd(ctrl, SLOT_HEADER.size)
    except (OSError, ConnectionError):
        return None, None  # the loader is gone; serving stops at once
    sid, size = SLOT_HEADER.unpack(header)
    memory = Segment(fd, size)
    return memory, memoryview(memory.map).cast("q")


FORKED = b"\x01"
"""The first byte a worker forked from the training process sends: it is running."""


def worker_main(worker_id: int, cfg: WorkerConfig, sock, ctrl, inherited=(), parent: int | None = None,
                forked: bool = False) -> None:
    """Entry point of a worker process; ``parent``: the loader's process, which it never outlives
    (:func:`aioload._workers.parent.exit_with`: a worker stuck in a decode would not see its socket close);
    ``forked``: forked from the training process, whose pool waits for :data:`FORKED` first."""
    if forked:
        sock.sendall(FORKED)  # out of the fork: the pool takes a worker that never says so for stuck in it
    # Everything this process starts with (a fork worker: the training process's objects, torch
    # and the dataset among them; else the template's or the unpickled configuration) is out of
    # the garbage collector's sight from here on: a full collection no longer walks those
    # hundreds of thousands of objects (in a process holding torch, a remote Parquet read's
    # client CPU fell from about 136 to 106 us a row over 12,000 rows with them frozen), nor
    # writes to their headers, which copied their shared pages into this process (109 MB for a
    # dataset of a million small lists). Cycles among them that become garbage here are not
    # freed, as the template's are not.
    gc.freeze()
    if parent is not None:
        exit_with(parent)
    # A forked worker inherits the parent's ends of its siblings' sockets: close them, so
    # that each socket reports end-of-stream as soon as its real peer is gone.
    for other in inherited:
        # detach, not close: a socket that an event loop was watching at the fork counts as in
        # use, and close() would then leave its descriptor open
        fd = other.detach()
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    # Ctrl-C is the parent's business: it stops the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stacks.install()  # every thread's stack on request, even stuck in C code (the stuck report)
    torch.set_num_threads(1)
    progress_memory, progress = _receive_progress(ctrl)
    worker = _Worker(worker_id, cfg, sock, ctrl, progress)
    _shared.receive_with(worker.shared_fd)
    worker.start_epoch(cfg.base_seed, per_sample_seeds=False)
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(worker_id)
    except Exception as exc:  # noqa: BLE001
        _wire.send_blocking(sock, InitError(pack_exception(exc)))
        return
    receiver = None
    if cfg.fetch_shards:
        worker.fetches = ShardFetches(worker.answer_fetch)
    if cfg.read_in_workers:
        worker.reads = WorkerReads(cfg.dataset, cfg.read_limit, cfg.read_timeout, ceiling=cfg.read_ceiling)
    if cfg.read_in_workers or cfg.fetch_shards:
        worker.inbox = queue.SimpleQueue()
        # daemon: it blocks on the socket, and the parent's end closing ends it; a worker
        # told to stop does not wait for it
        receiver = threading.Thread(target=worker.receive, name="aioload-worker-recv", daemon=True)
    _wire.send_blocking(sock, WorkerReady(os.getpid()))
    if receiver is not None:
        receiver.start()
    try:
        worker.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        if worker.reads is not None:
            worker.reads.close()
        if worker.fetches is not None:
            worker.fetches.close()
        worker.drop(list(worker.segments))
        for fd in worker.shared_fds.values():
            os.close(fd)
