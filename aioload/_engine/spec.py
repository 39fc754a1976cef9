"""The values the loader, the engine and the consumer share: what an epoch is given
(:class:`Spec`, :class:`Plan`, :class:`Shared`) and what it hands back (:class:`Ready`,
:class:`Failure`, or :class:`Cancelled` once stopped)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from aioload._handoff.layout import Layout
from aioload._handoff.slots import SlotPool


class Mode(str, enum.Enum):
    """How an epoch's batches are made; decided by the loader from its settings."""

    ROWS = "rows"  # default collation: samples into the slot's rows (or columns), collated here
    WHOLE = "whole"  # a whole batch to one worker, collated there (a custom collate_fn, batch_size=None)
    ITER = "iter"  # an IterableDataset: each worker's copy makes its own batches
    READ = "read"  # num_workers=0 with a split dataset: reads here, decode in the consumer's thread
    EXECUTOR = "executor"  # executor=: one task per batch on the executor


class Reads(str, enum.Enum):
    """Where ``dataset.read`` runs; decided by the loader (``DataLoader._settings``)."""

    NONE = "none"  # no read stage: __getitem__ in the workers (or in the consumer's thread)
    ENGINE = "engine"  # on the engine's loop; what read returns goes to the workers
    WORKERS = "workers"  # where each sample is decoded: a worker's own loop, or the executor's task


MAX_AHEAD = 16
"""Tasks a worker holds at most to run its reads ahead (each holds a batch's slot)."""


@dataclass(frozen=True)
class BatchBound:
    """How many batches may be between the sampler and the ready queue (``queue_depth``
    comes on top; the permits are their sum, and the slot pool keeps one slot more).

    At least one batch per worker, and two in all. When a batch goes to one worker whole
    (``whole``: torch's round-robin dispatch, ``__getitems__``, a custom ``collate_fn``, an
    ``IterableDataset``; or, ``quick``, measured to decode within a few milliseconds),
    ``prefetch`` per worker: each worker holds that many tasks (the one it decodes and the
    next), and a finished batch keeps its permit until it is delivered, so with fewer a
    worker that ran ahead of another would find nothing queued, and ``queue_depth`` would be
    used up by the tasks the workers hold instead of buffering finished batches (measured:
    with one per worker, a worker idled 10-22 % of the time on 128-token rows; with two
    workers decoding images on this shared 2-CPU machine, aioload reached 80 % of the ceiling
    against 94 % with two per worker). When the engine's loop reads (``reads``), also enough
    batches to keep ``io`` reads busy. A dataset whose reads come in bursts (Parquet's window
    mode over remote files: each new window's row groups at once) asks for ``rows_ahead``
    (``dataset.rows_ahead``): each worker then holds enough tasks to read that far ahead."""

    workers: int
    prefetch: int  # tasks each worker holds (prefetch_factor)
    batch_size: int
    whole: bool
    reads: bool
    rows_ahead: int = 0  # rows the workers' reads should run ahead of their decode (a dataset's wish)

    @property
    def held(self) -> int:
        """Tasks each worker holds: ``prefetch``, or enough to read ``rows_ahead`` rows ahead
        (at most :data:`MAX_AHEAD`): a worker starts a task's reads when it receives it, so
        the tasks it holds are how far its reads run ahead of its decode."""
        ahead = -(-self.rows_ahead // max(1, self.workers * self.batch_size))
        return max(self.prefetch, min(MAX_AHEAD, ahead))

    def batches(self, io: int, quick: bool = False) -> int:
        held = self.held  # beyond prefetch only where the dataset asked to read ahead
        per_worker = held if held > self.prefetch else self.prefetch if self.whole or quick else 1
        for_reads = -(-io // max(1, self.batch_size)) if self.reads else 0
        return max(2, self.workers * per_worker, for_reads)


@dataclass
class Spec:
    """What the engine needs from the loader for one epoch: made by the loader when the epoch
    starts (``DataLoader._spec``), from its settings and its pool as they are then. Each fact
    is decided there once; the stages read it here."""

    dataset: Any
    split: bool
    mode: Mode
    reads: Reads
    batch_size: int | None
    num_workers: int
    io_concurrency: int  # reads in flight on the engine's loop (Reads.ENGINE)
    bound: BatchBound  # batches between the sampler and the ready queue
    queue_depth: int  # finished batches buffered ahead of the consumer, on top of ``bound``
    in_order: bool
    on_error: str
    pin: bool
    prefetch_tasks: int
    # torch's dispatch: batch i whole to worker i mod N, each worker's batches in the sampler's
    # order (see Turn); else the least-loaded worker gets a batch, split into chunks
    round_robin: bool = False
    describe: Callable[[Any], str] | None = None
    tuner: Any = None  # an aioload._observe.tune.Tuner when a limit is "auto"
    read_timeout: float | None = None  # seconds one dataset.read may take
    max_errors: int | float | None = None  # on_error="skip": the bound on skips per epoch
    epoch_samples: int | None = None  # the base of a fractional max_errors
    auto_collation: bool = True  # False with batch_size=None: each index (even a list) is one sample
    batched_fetch: bool = False  # the dataset's __getitems__ gets each batch whole, as in torch
    executor: Any = None  # an aioload._engine.executor.ExecutorStage with executor=

    def permits(self, io: int | None = None, quick: bool = False) -> int:
        """Batches between the sampler and the consumer: ``bound`` plus ``queue_depth``."""
        return self.bound.batches(self.io_concurrency if io is None else io, quick) + self.queue_depth

    def batch_indices(self, indices) -> list:
        """The indices of one batch: a batch sampler's list (or tuple, or tensor), or, without
        automatic batching, the one index the sampler gave (which may itself be a list)."""
        return list(indices) if self.auto_collation else [indices]


class Turn:
    """A batch's place in its worker's queue under round-robin dispatch: the batch sends its
    tasks once the batch before it on the same worker has sent all of its own, so that each
    worker loads its batches in the sampler's order, as torch's workers do (its RNG streams,
    seeded ``base seed + worker id``, then draw exactly as in torch). Reads still run ahead."""

    __slots__ = ("worker", "_before", "_sent")

    def __init__(self, worker: int, before: "Turn | None"):
        self.worker = worker
        self._before = before
        self._sent = asyncio.Event()

    async def wait(self) -> None:
        """Until the batch before this one on the worker has queued all of its tasks."""
        if self._before is not None:
            await self._before._sent.wait()
            self._before = None  # no chain of every batch of the epoch

    def sent(self) -> None:
        """This batch has queued all of its tasks (or will queue none)."""
        self._before = None
        self._sent.set()


@dataclass
class Plan:
    """One epoch: the numbered index batches ``(seq, indices)`` (map-style) and the seeds.
    ``delivered`` holds the sequence numbers the consumer already has (a resumed epoch's)."""

    batches: Iterator
    base_seed: int
    per_sample_seeds: bool
    delivered: Any = None
    # A resumed IterableDataset epoch: per worker, the ResumeCopy its copy starts from (None:
    # from scratch), and the worker the epoch's first batch comes from (round-robin)
    copies: tuple | None = None
    first_worker: int = 0
    epoch: int = 0  # the loader's epoch (an IterableDataset's copies get set_epoch(epoch))
    # Persistent workers without seed=: the workers' random streams at the epoch's end, asked of
    # them once every task is answered (None: not asked), and those a resumed epoch gives back
    # to each worker first (None: the workers' streams go on as they are)
    streams: EndStreams | None = None
    set_streams: tuple | None = None
    new_workers: bool = False  # the saved run's epoch started new workers: so does this one


class EndStreams:
    """The workers' random streams at the end of an epoch of persistent workers: set by the
    engine once every task of the epoch is answered (``None`` in it: not known, the epoch
    stopped without its workers answering), read by the loader's ``state_dict()`` after it."""

    __slots__ = ("records", "known")

    def __init__(self):
        self.records: tuple | None = None
        self.known = False  # set once: by the engine (the records, or None)

    def put(self, records: tuple | None) -> None:
        if not self.known:
            self.records, self.known = records, True


class Failure:
    """A batch that could not be made; the consumer raises ``exc`` in its place. ``note``: an
    IterableDataset's ``(worker id, None)``, the turn of that worker's copy that the batch used
    (see :class:`aioload._plan.stateful.Copies`)."""

    __slots__ = ("exc", "note")

    def __init__(self, exc: BaseException, note=None):
        self.exc = exc
        self.note = note


@dataclass
class Ready:
    batch: Any
    samples: int
    event: Any = None
    raw: list | None = None  # num_workers=0 with a split dataset: (index, raw) pairs
    # An IterableDataset's batch: (worker id, CopyNote), applied to the epoch's progress when
    # the consumer takes the batch (aioload._engine.ready.ReadyQueue.take_notes)
    note: Any = None


class Collation(enum.Enum):
    """How the workers write default-collated samples: learned from the first reply with a
    sample, then kept for the loader's life."""

    UNKNOWN = "unknown"  # nothing learned yet: the workers try chunk mode
    CHUNKS = "chunks"  # each task's samples collated into the slot's columns (aioload._handoff.chunks)
    ROWS = "rows"  # one skeleton per row (a type with its own collate function, say)


@dataclass
class Shared:
    """State that outlives an epoch: the learned layout and its slot pool."""

    layout: Layout | None = None
    no_leaves: bool = False
    slots: SlotPool | None = None
    per_sample_s: float | None = None
    holds: Any = None  # the device copies still reading slots (an aioload._engine.engine.Holds)
    collation: Collation = Collation.UNKNOWN
    quick: bool = False  # a batch goes to one worker whole and decodes within WHOLE_BATCH_SECONDS


def resize_permits(permits, shared: Shared | None, limit: int) -> None:
    """Allow ``limit`` batches between the sampler and the consumer (``permits``, a Limiter)
    and keep as many free slots, plus one for the batch being filled."""
    permits.set_limit(limit)
    slots = getattr(shared, "slots", None)
    if slots is not None:
        slots.target = limit + 1


class Cancelled(Exception):
    """The epoch was stopped by the consumer (break, close, garbage collection)."""
