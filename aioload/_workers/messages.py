"""The messages between the worker pool (in the engine's loop) and a worker process.

Each is a ``NamedTuple``: it pickles as its class and its fields (a few bytes more than a
plain tuple, the class name being memoised per message) and is read by field name on both
sides. They travel as length-prefixed pickles (:mod:`aioload._workers.wire`) over a worker's task
socket; slot memory travels on its control socket, as file descriptors.

Pool to worker, in the order a worker sees them in an epoch: :class:`StartEpoch`, for a
resumed epoch of persistent workers :class:`SetStreams`, for a resumed dataset's copy
:class:`ResumeCopy`, then :class:`Task` and :class:`DropSlots` in any order, :class:`CancelReads`
when an epoch ends early, :class:`ReportStreams` once every task is answered (persistent workers
without ``seed=``), and :class:`Shutdown` when the loader stops its workers. Worker to pool:
:class:`WorkerReady` or :class:`InitError` once, when it has started; then one :class:`Done`
(or, for an ``IterableDataset``, :class:`Stopped`) per task, in the order the tasks came, and
:class:`Streams` for a :class:`ReportStreams`. Window mode's shards fetched by the workers
(:mod:`aioload._workers.fetches`): a :class:`FetchShard` at any time, answered by one
:class:`Fetched` whenever the fetch ends, the shard's memfd sent on the control socket just
before it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# -- pool to worker ----------------------------------------------------------------------------


class StartEpoch(NamedTuple):
    """An epoch begins: the worker seeds its RNGs as torch seeds a worker of this epoch, and
    its copy of an ``IterableDataset`` gets ``set_epoch(epoch)`` where it has one."""

    base_seed: int  # the epoch's base seed (a worker's seed is base seed + worker id)
    per_sample_seeds: bool  # seed= given: every sample is seeded from (base seed, index)
    epoch: int = 0  # the loader's epoch


class ResumeCopy(NamedTuple):
    """This epoch resumes a saved one: the worker's copy of the ``IterableDataset`` gets its
    saved state back (:mod:`aioload._workers.state`) before it yields anything."""

    record: dict | None  # the copy's saved record (None: nothing of it is Stateful)
    skip: int  # a copy that is not Stateful: items to drop (those delivered before the save)
    fresh: bool  # the saved epoch had ended: only the dataset's state applies, to a new epoch


class SetStreams(NamedTuple):
    """A resumed epoch of persistent workers: the worker takes back the random streams (its
    seed, torch's, ``random``'s and numpy's) that the saved run's worker had then."""

    record: dict  # aioload._base.seeding.capture_streams's


class ReportStreams(NamedTuple):
    """The epoch is over (every task answered): reply with the worker's random streams, which
    a persistent worker takes into the next epoch (a state saved between epochs holds them)."""


class RowsWork(NamedTuple):
    """Some samples of one batch, each written into its row of the slot from ``row0``."""

    # (index, raw) pairs, or bare indices for a dataset without a read stage (or one whose
    # workers read: the worker pairs them with what its own reads return)
    items: list
    row0: int  # the slot row of the first item
    # Collate the chunk into the slot's columns (chunk mode, see aioload._handoff.chunks), where
    # its samples allow it; else, and when False, one skeleton per row (rows mode).
    chunks: bool


class WholeWork(NamedTuple):
    """A whole batch, collated in the worker by ``collate_fn``."""

    items: list  # as RowsWork.items
    skip_errors: bool  # on_error="skip": collate the samples that did not fail


class IterWork(NamedTuple):
    """The next batch of the worker's own copy of an ``IterableDataset``."""


class Task(NamedTuple):
    """One task of the epoch: what to make (``work``) and where its samples go (``slot``)."""

    task_id: int  # unique in the epoch; the reply's Done.task_id
    # Where the samples go: (slot id, layout description, (lo, hi) of the slot's overflow area
    # this task may use), or None while the layout is unknown (everything comes back pickled).
    slot: tuple | None
    work: RowsWork | WholeWork | IterWork
    drops: tuple | list = ()  # slot ids the pool has retired since this worker's last task: unmap them


class DropSlots(NamedTuple):
    """Unmap these retired slots (tasks carry the same list in ``Task.drops``)."""

    slot_ids: list


class CancelReads(NamedTuple):
    """The epoch ended early: fail the reads in flight of every task sent so far, so that each
    is answered at once (a worker that reads, see :mod:`aioload._workers.reads`)."""


class FetchShard(NamedTuple):
    """Fetch a whole shard into a memfd of this worker's making and send it back
    (:mod:`aioload._workers.fetches`). ``storage_key`` names ``storage`` for the worker's life, so
    that its connections serve every fetch of it."""

    fetch_id: int
    url: str
    storage: Any
    storage_key: tuple


class Shutdown(NamedTuple):
    """Stop serving and exit: the loader is closing its workers."""


# -- worker to pool ----------------------------------------------------------------------------


class WorkerReady(NamedTuple):
    """The worker has run ``worker_init_fn`` and takes tasks."""

    pid: int


class InitError(NamedTuple):
    """``worker_init_fn`` raised; the worker exits and the epoch fails with this error."""

    packed: bytes  # aioload._base.errors.pack_exception of what it raised


class Fetched(NamedTuple):
    """A :class:`FetchShard` ended: ``size`` bytes received (its memfd is on the control socket,
    sent just before this), or ``size == -1`` and the error, packed."""

    fetch_id: int
    size: int
    packed: bytes | None = None


class Streams(NamedTuple):
    """The reply to :class:`ReportStreams`: the worker's random streams now."""

    record: dict  # aioload._base.seeding.capture_streams's


class TaskError(NamedTuple):
    """One failure inside a task: a sample's load, a chunk's collation, a batch's collate_fn."""

    pos: int  # the sample's position in the task's items (0 for a batch-wide failure)
    index: Any  # the dataset index; a list for a whole batch's or chunk's failure; None: unknown
    stage: str  # where it failed: "read", "decode", "__getitem__", "__getitems__", "collate", ...
    packed: bytes  # aioload._base.errors.pack_exception of the exception, traceback included


class RowsOut(NamedTuple):
    """Rows mode: each sample's skeleton (its containers, labels and strings, with each leaf
    replaced by its place in its row of the slot)."""

    skeletons: list[bytes]  # the task's distinct skeletons, pickled, in the order first met
    # Per item of the task: the position of its skeleton in ``skeletons``, or -1 for a sample
    # that failed. Uniform samples share one skeleton: the parent unpickles it once.
    rows: list[int]

    @property
    def count(self) -> int:
        return len(self.rows)


class ChunkOut(NamedTuple):
    """Chunk mode: the task's samples collated into the slot's columns as one chunk."""

    skeleton: bytes  # the collated chunk's skeleton (aioload._handoff.chunks, CHUNK_MAGIC first)
    rows: int  # samples collated: they fill the rows from RowsWork.row0, in order, less those that failed
    count: int  # items in the task


class BatchOut(NamedTuple):
    """A whole batch (``collate_fn``'s, or an ``IterableDataset``'s), pickled with its leaves
    in the slot; ``None`` when the batch failed."""

    skeleton: bytes | None

    @property
    def count(self) -> int:
        return 1


class ReadReport(NamedTuple):
    """What a worker that reads its samples itself found while reading a task's samples."""

    latencies: list  # seconds each real read took
    nbytes: int  # bytes those reads returned
    stall: Any  # an aioload._data.reads.Stall the first time the worker's reads blocked their loop, else None
    waited_s: float  # seconds the worker's decoding waited for this task's reads
    limited_s: float  # of which, seconds its reads in flight were at the limit (reads queued behind it)
    limit: int  # the worker's reads-in-flight limit after this task
    worker: int  # the worker's id


class CopyNote(NamedTuple):
    """What an ``IterableDataset`` task did to the worker's copy: its state after the task's
    items (``record``, only where the dataset or its iterator is Stateful), whether it ran out,
    and how many items it drew (a copy that is not Stateful is fast-forwarded by them)."""

    record: dict | None
    ended: bool
    taken: int


class Done(NamedTuple):
    """A task finished (possibly with failures in ``errors``)."""

    task_id: int
    out: RowsOut | ChunkOut | BatchOut
    errors: list  # TaskError, in the order they happened
    # The leaf specs that teach the layout, sent by a task without a slot; [] when the
    # samples hold no leaves; None when the task had a slot.
    specs: list | None
    overflow_wanted: int  # overflow bytes the task lacked (the pool grows its slots' area)
    seconds: float  # wall time of the task in the worker
    cpu_s: float | None = None  # the worker's CPU seconds on the task (None: not measured)
    reads: ReadReport | None = None  # None when the worker read nothing itself
    copy: CopyNote | None = None  # an IterableDataset task's: the copy after it
    # (worker id, ((kind, bytes), ...)): what the worker's caches hold after the task
    # (aioload._storage.cache.held_bytes); None where it has no cache
    caches: tuple | None = None


class Stopped(NamedTuple):
    """The worker's copy of an ``IterableDataset`` ran out: no batch for this task."""

    task_id: int
    copy: CopyNote | None = None  # the copy's state once it ran out

