"""The worker process: receives tasks, decodes samples, writes them into shared-memory slots.

A worker gets its copy of the dataset once, when it starts. It then serves tasks until the
loader stops it or its socket closes (the parent went away): a worker never outlives its loader.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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
from aioload._errors import pack_exception
from aioload._handoff.chunks import ChunkWriter, Unsupported
from aioload._handoff.layout import Layout
from aioload._handoff.writers import RowWriter, SlotWriter, column_views
from aioload._workers.messages import (CancelReads, Done, DropSlots, InitError, Shutdown, StartEpoch, Stopped, Task,
                                      TaskError, WorkerReady)
from aioload._seeding import sample_seed, seed_everything, seed_worker
from aioload._handoff.shm import Segment, recv_fd
from aioload._workers.reads import FailedRead, WorkerReads

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
    exact_seeds: bool = False  # seed= given: fetch and seed every sample alone (no __getitems__)
    keep_rng: bool = False  # persistent_workers=True: RNG streams go on across epochs, as in torch
    read_in_workers: bool = False  # the workers await dataset.read themselves (aioload._workers.reads)
    io_limit: int = 1  # with read_in_workers: reads in flight per worker
    read_timeout: float | None = None  # with read_in_workers: seconds one read may take


def _batched_fetch(ds) -> bool:
    """Whether ``ds`` really fetches in batches (``Subset`` merely forwards to its dataset)."""
    if getattr(ds, "__getitems__", None) is None:
        return False
    if isinstance(ds, torch.utils.data.Subset):
        return _batched_fetch(ds.dataset)
    return True


def _set_worker_info(worker_id: int, cfg: WorkerConfig, seed: int) -> None:
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )


PROGRESS_ID = -1
"""The slot id under which the pool sends a worker its progress cells."""

COLLATING = -2
"""The progress cell's index while ``collate_fn`` runs (``-1``: no sample index known)."""

_CELL_MAX = (1 << 63) - 1

MARK_EVERY = 0.05
"""Seconds between updates of the progress cell while a task waits for its reads."""


def _cell(index) -> int:
    """What a progress cell (an int64) holds for ``index``: the index when it is an ``int``
    that fits, else ``-1`` (not known). A sampler may yield any index, 2**64 or a key."""
    return index if isinstance(index, int) and (0 <= index <= _CELL_MAX or index == COLLATING) else -1


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
        self.layouts: dict[int, tuple] = {}  # slot id -> (description, Layout, column views)
        self.base_seed = cfg.base_seed
        self.per_sample_seeds = True
        self.iterator = None
        self.seeded: int | None = None  # the base seed the worker's RNGs were last seeded from
        self.reads: WorkerReads | None = None  # with cfg.read_in_workers, once worker_init_fn has run
        self.inbox: queue.SimpleQueue | None = None  # with reads here: (message, reading) in arrival order

    # -- set-up -------------------------------------------------------------------------
    def start_epoch(self, base_seed: int, per_sample_seeds: bool) -> None:
        """Seed as torch seeds a worker started for this epoch. A worker that is already seeded
        from this base seed (a fresh one, after worker_init_fn) or whose streams go on across
        epochs (``keep_rng``, torch's persistent workers) keeps its RNG state."""
        self.base_seed = base_seed
        self.per_sample_seeds = per_sample_seeds
        self.iterator = None
        if self.seeded is None or (base_seed != self.seeded and not self.cfg.keep_rng):
            self.seeded = base_seed
            _set_worker_info(self.id, self.cfg, seed_worker(base_seed, self.id))

    def segment(self, slot_id: int) -> Segment:
        seg = self.segments.get(slot_id)
        while seg is None:
            header, fd = recv_fd(self.ctrl, SLOT_HEADER.size)
            sid, size = SLOT_HEADER.unpack(header)
            self.segments[sid] = Segment(fd, size)
            seg = self.segments.get(slot_id)
        return seg

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

    def batched(self) -> bool:
        """Whether batches are fetched with one ``__getitems__`` call, as torch does."""
        return not self.cfg.split and not self.cfg.exact_seeds and _batched_fetch(self.cfg.dataset)

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

    def fetch_each(self, items) -> tuple[list, list, list]:
        """A task's samples one by one, in order: ``(samples, payloads, errors)``, where a
        payload is ``b""`` for a sample fetched and ``None`` for one that failed."""
        if self.cfg.split or self.per_sample_seeds:
            samples, payloads, errors = [], [], []
            for pos, (index, raw) in enumerate(self.pairs(items)):
                try:
                    samples.append(self.load(index, raw))
                    payloads.append(b"")
                except Exception as exc:  # noqa: BLE001
                    payloads.append(None)
                    errors.append(TaskError(pos, index, self.stage(raw), pack_exception(exc)))
            return samples, payloads, errors
        # Bare indices, no seeding: the loop that torch's fetcher runs, plus one store per
        # sample saying which index this worker is on.
        dataset, progress, cell = self.cfg.dataset, self.progress, 2 * self.id + 1
        if progress is not None:
            progress[cell - 1] = self.task
        samples, errors = [], []
        for pos, index in enumerate(items):
            if progress is not None:
                progress[cell] = index if type(index) is int and 0 <= index <= _CELL_MAX else -1
            try:
                samples.append(dataset[index])
            except Exception as exc:  # noqa: BLE001
                errors.append(TaskError(pos, index, self.stage(), pack_exception(exc)))
        payloads = [b""] * len(items)
        for error in errors:
            payloads[error.pos] = None
        return samples, payloads, errors

    def stage(self, raw=None) -> str:
        """The stage a sample failed in: its read (in this worker), decode or __getitem__."""
        if isinstance(raw, FailedRead):
            return "read"
        return "decode" if self.cfg.split else "__getitem__"

    def run_rows(self, task_id, slot, items, row0):
        """Rows mode: each sample's leaves into its row of the slot; ``items`` as
        :meth:`run_chunk`'s."""
        writer = self.writer(slot, RowWriter)
        payloads, errors = [], []
        started = time.perf_counter()
        samples = None
        if self.batched():
            indices = self.indices(items)
            try:
                samples = self.fetch_batch(indices)
            except Exception as exc:  # noqa: BLE001 - reported to the consumer with its index
                errors.append(TaskError(0, indices, "__getitems__", pack_exception(exc)))
                return Done(task_id, [None] * len(items), errors, None, 0, time.perf_counter() - started)
        previous = None
        for pos, (index, raw) in enumerate(self.pairs(items)):
            try:
                sample = samples[pos] if samples is not None else self.load(index, raw)
                data = writer.dump(sample, row0 + pos)
            except Exception as exc:  # noqa: BLE001
                payloads.append(None)
                errors.append(TaskError(pos, index, self.stage(raw), pack_exception(exc)))
                continue
            # b"" stands for "the same skeleton as the previous row": uniform batches then
            # cost the parent one unpickle instead of one per row.
            payloads.append(b"" if data == previous else data)
            previous = data
        specs = writer.first_specs if slot is None else None
        seconds = time.perf_counter() - started
        return Done(task_id, payloads, errors, specs, writer.overflow_wanted, seconds)

    def run_chunk(self, task_id, slot, items, row0, must: bool):
        """Chunk mode (see :mod:`aioload._handoff.chunks`): collate the chunk straight into the slot.
        ``None`` when its samples hold a type chunk mode cannot join (rows mode then).
        ``items`` are as sent: ``(index, raw)`` pairs, or bare indices without a read stage."""
        started = time.perf_counter()
        payloads, errors, samples = [], [], []
        if self.batched():
            indices = self.indices(items)
            try:
                samples = list(self.fetch_batch(indices))
                payloads = [b""] * len(samples)
            except Exception as exc:  # noqa: BLE001 - reported to the consumer with its index
                errors.append(TaskError(0, indices, "__getitems__", pack_exception(exc)))
                return Done(task_id, [None] * len(items), errors, None, 0, time.perf_counter() - started)
        else:
            samples, payloads, errors = self.fetch_each(items)
        writer = self.chunk_writer(slot, row0)
        if samples:
            try:
                blob = writer.dump(samples)
            except Unsupported:
                if must:
                    raise
                return None
            except Exception as exc:  # noqa: BLE001 - collation failed: the batch fails
                errors.append(TaskError(0, self.indices(items[:1])[0], "collate", pack_exception(exc)))
                return Done(task_id, [None] * len(items), errors, None, 0, time.perf_counter() - started)
            payloads[payloads.index(b"")] = blob
        specs = writer.specs if slot is None else None
        return Done(task_id, payloads, errors, specs, 0, time.perf_counter() - started)

    def chunk_writer(self, slot, row0: int) -> ChunkWriter:
        if slot is None:
            return ChunkWriter(None, None, row0, None)
        writer = self.writer(slot, SlotWriter)
        return ChunkWriter(writer.segment, writer.layout, row0, writer.columns)

    def run_whole(self, task_id, slot, items, skip_errors: bool):
        """One whole batch, collated by ``collate_fn``; ``items`` as :meth:`run_chunk`'s."""
        writer = self.writer(slot)
        started = time.perf_counter()
        indices = self.indices(items)
        if self.cfg.auto_collation and self.batched():
            try:
                samples = self.fetch_batch(indices)
            except Exception as exc:  # noqa: BLE001 - reported to the consumer with its index
                errors = [TaskError(0, indices[0], "__getitems__", pack_exception(exc))]
                return Done(task_id, [None], errors, None, 0, time.perf_counter() - started)
            return self.finish_batch(task_id, slot, writer, samples, [], started, indices)
        samples, _, errors = self.fetch_each(items)
        if (errors and not skip_errors) or not samples:
            return Done(task_id, [None], errors, None, 0, time.perf_counter() - started)
        failed = {error.pos for error in errors}
        collated = [index for pos, index in enumerate(indices) if pos not in failed]
        return self.finish_batch(task_id, slot, writer, samples, errors, started, collated)

    def finish_batch(self, task_id, slot, writer, samples, errors, started, index):
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
        return Done(task_id, [payload], errors, specs, writer.overflow_wanted, seconds)

    def run_iter(self, task_id, slot):
        cfg = self.cfg
        started = time.perf_counter()
        try:
            if self.iterator is None:
                self.iterator = iter(cfg.dataset)
            if cfg.auto_collation:
                samples = []
                for _ in range(cfg.batch_size):
                    try:
                        samples.append(next(self.iterator))
                    except StopIteration:
                        break
                if not samples or (cfg.drop_last and len(samples) < cfg.batch_size):
                    return Stopped(task_id)
            else:
                samples = [next(self.iterator)]
        except StopIteration:
            return Stopped(task_id)
        except Exception as exc:  # noqa: BLE001
            errors = [TaskError(0, None, "__iter__", pack_exception(exc))]
            return Done(task_id, [None], errors, None, 0, time.perf_counter() - started)
        return self.finish_batch(task_id, slot, self.writer(slot), samples, [], started, None)

    def serve(self) -> None:
        while (message := self.next_message()) is not None:
            msg, reading = message
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, StartEpoch):
                self.start_epoch(msg.base_seed, msg.per_sample_seeds)
                continue
            if isinstance(msg, DropSlots):
                self.drop(msg.slot_ids)
                continue
            kind, task_id, slot, payload, drops = msg.kind, msg.task_id, msg.slot, msg.payload, msg.drops
            self.task = task_id
            self.drop(drops)
            cpu = time.process_time()
            reads = None
            if reading is not None:
                payload, reads = self.with_reads(payload, reading)
            if kind == "rows":
                items, row0, *chunked = payload
                chunked = chunked[0] if chunked else False
                reply = None
                if chunked is not False:
                    reply = self.run_chunk(task_id, slot, items, row0, must=chunked is True)
                if reply is None:
                    reply = self.run_rows(task_id, slot, items, row0)
            elif kind == "whole":
                items, skip_errors = payload
                reply = self.run_whole(task_id, slot, items, skip_errors)
            elif kind == "iter":
                reply = self.run_iter(task_id, slot)
            else:  # pragma: no cover - a bug in the engine
                raise RuntimeError(f"unknown task kind {kind!r}")
            if isinstance(reply, Done):
                # CPU seconds (compared to wall time in stats), and the reads made here
                reply = reply._replace(cpu_s=time.process_time() - cpu, reads=reads)
            _wire.send_blocking(self.sock, reply)

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

    def receive(self) -> None:
        """The receiving thread: messages in order into the inbox, reads started on the way;
        ``None`` last, once the parent has gone away or said to stop."""
        try:
            while (msg := self.reader.recv_blocking()) is not None:
                if isinstance(msg, CancelReads):  # at once: the tasks it ends wait in the inbox
                    self.reads.cancel()
                    continue
                reading = None
                if isinstance(msg, Task) and msg.kind in ("rows", "whole"):
                    reading = self.reads.start(list(msg.payload[0]))
                self.inbox.put((msg, reading))
                if isinstance(msg, Shutdown):
                    break
        finally:
            self.inbox.put(None)

    def with_reads(self, payload: tuple, reading) -> tuple:
        """The task's payload with its bare indices paired with what their reads returned,
        as if the engine had read them, and the reads' ``(latencies, bytes)``."""
        indices = payload[0]
        while True:
            try:
                raws, latencies, nbytes = reading.result(timeout=MARK_EVERY)
                break
            except concurrent.futures.TimeoutError:
                # what this worker waits for, should timeout= expire
                self.mark(self.reads.waiting_for(indices, None))
        return (list(zip(indices, raws)),) + tuple(payload[1:]), (latencies, nbytes, self.reads.meter.take())


def _receive_progress(ctrl):
    """The pool's progress cells: the first memory the control socket carries."""
    try:
        header, fd = recv_fd(ctrl, SLOT_HEADER.size)
    except (OSError, ConnectionError):
        return None, None  # the loader is gone; serving stops at once
    sid, size = SLOT_HEADER.unpack(header)
    memory = Segment(fd, size)
    return memory, memoryview(memory.map).cast("q")


def worker_main(worker_id: int, cfg: WorkerConfig, sock, ctrl, inherited=()) -> None:
    """Entry point of a worker process."""
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
    torch.set_num_threads(1)
    progress_memory, progress = _receive_progress(ctrl)
    worker = _Worker(worker_id, cfg, sock, ctrl, progress)
    worker.start_epoch(cfg.base_seed, per_sample_seeds=False)
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(worker_id)
    except Exception as exc:  # noqa: BLE001
        _wire.send_blocking(sock, InitError(pack_exception(exc)))
        return
    receiver = None
    if cfg.read_in_workers:
        worker.reads = WorkerReads(cfg.dataset, cfg.io_limit, cfg.read_timeout)
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
        worker.drop(list(worker.segments))
