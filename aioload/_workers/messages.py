"""The messages between the worker pool (in the engine's loop) and a worker process.

Each is a ``NamedTuple``: it pickles as its class and its fields (a few bytes more than a
plain tuple, the class name being memoised per message) and is read by field name on both
sides. They travel as length-prefixed pickles (:mod:`aioload._workers.wire`) over a worker's task
socket; slot memory travels on its control socket, as file descriptors.

Pool to worker, in the order a worker sees them in an epoch: :class:`StartEpoch`, then
:class:`Task` and :class:`DropSlots` in any order, :class:`CancelReads` when an epoch ends
early, and :class:`Shutdown` when the loader stops its workers. Worker to pool:
:class:`WorkerReady` or :class:`InitError` once, when it has started; then one :class:`Done`
(or, for an ``IterableDataset``, :class:`Stopped`) per task, in the order the tasks came.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# -- pool to worker ----------------------------------------------------------------------------


class StartEpoch(NamedTuple):
    """An epoch begins: the worker seeds its RNGs as torch seeds a worker of this epoch."""

    base_seed: int  # the epoch's base seed (a worker's seed is base seed + worker id)
    per_sample_seeds: bool  # seed= given: every sample is seeded from (base seed, index)


class Task(NamedTuple):
    """One task: some samples of one batch (``rows``), a whole batch (``whole``), or the next
    batch of the worker's own copy of an ``IterableDataset`` (``iter``)."""

    kind: str  # "rows", "whole" or "iter"
    task_id: int  # unique in the epoch; the reply's Done.task_id
    # Where the samples go: (slot id, layout description, (lo, hi) of the slot's overflow area
    # this task may use), or None while the layout is unknown (everything comes back pickled).
    slot: tuple | None
    # rows: (items, first row, chunked: True, False or None (try chunk mode, else rows mode));
    # whole: (items, skip_errors); iter: None. Items are (index, raw) pairs, or bare indices
    # for a dataset without a read stage (or one whose workers read).
    payload: Any
    drops: tuple | list = ()  # slot ids the pool has retired since this worker's last task: unmap them


class DropSlots(NamedTuple):
    """Unmap these retired slots (tasks carry the same list in ``Task.drops``)."""

    slot_ids: list


class CancelReads(NamedTuple):
    """The epoch ended early: fail the reads in flight of every task sent so far, so that each
    is answered at once (a worker that reads, see :mod:`aioload._workers.reads`)."""


class Shutdown(NamedTuple):
    """Stop serving and exit: the loader is closing its workers."""


# -- worker to pool ----------------------------------------------------------------------------


class WorkerReady(NamedTuple):
    """The worker has run ``worker_init_fn`` and takes tasks."""

    pid: int


class InitError(NamedTuple):
    """``worker_init_fn`` raised; the worker exits and the epoch fails with this error."""

    packed: bytes  # aioload._errors.pack_exception of what it raised


class TaskError(NamedTuple):
    """One failure inside a task: a sample's load, a chunk's collation, a batch's collate_fn."""

    pos: int  # the sample's position in the task's items (0 for a batch-wide failure)
    index: Any  # the dataset index; a list for a whole batch's or chunk's failure; None: unknown
    stage: str  # where it failed: "read", "decode", "__getitem__", "__getitems__", "collate", ...
    packed: bytes  # aioload._errors.pack_exception of the exception, traceback included


class Done(NamedTuple):
    """A task finished (possibly with failures in ``errors``)."""

    task_id: int
    # One entry per sample (rows mode) or one for the batch (whole, iter): the pickled
    # skeleton whose leaves are in the slot; b"" for "as the previous row"; None for a sample
    # that failed. In chunk mode the first entry present is the chunk's skeleton (CHUNK_MAGIC).
    payloads: list
    errors: list  # TaskError, in the order they happened
    # The leaf specs that teach the layout, sent by a task without a slot; [] when the
    # samples hold no leaves; None when the task had a slot.
    specs: list | None
    overflow_wanted: int  # overflow bytes the task lacked (the pool grows its slots' area)
    seconds: float  # wall time of the task in the worker
    cpu_s: float | None = None  # the worker's CPU seconds on the task (None: not measured)
    # Reads the worker did itself: (latencies in seconds, bytes read, an aioload._reads.Stall
    # the first time its reads were found blocking their loop, else None); None when it read nothing.
    reads: tuple | None = None


class Stopped(NamedTuple):
    """The worker's copy of an ``IterableDataset`` ran out: no batch for this task."""

    task_id: int

