"""One epoch as its iterator sees it: the :class:`EpochContext` the loader hands over when the
epoch starts, and :class:`EpochIterator`, the base of both epoch iterators (torch's
``_BaseDataLoaderIter``).

The base holds what every epoch shares: ``__iter__``/``__aiter__``/``__len__``, the lazy start
at the first ``next()``, the end of the epoch (exhausted, closed, superseded by a newer one),
and the statistics of each delivered batch. A subclass only says how the next batch is
obtained: :class:`aioload._front.iterator.EngineIterator` takes it from the engine's ready queue,
:class:`aioload._front.inprocess.InProcessIterator` loads it in the caller's thread.

The iterator knows its loader only as an :class:`EpochSource` (``len()`` and the two calls
that start an epoch); everything else it needs arrives in the context.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aioload._front.compat import WAITING, profiled, warn_iterable_length
from aioload._base.errors import LoaderClosedError

if TYPE_CHECKING:
    from aioload._engine.budget import ErrorBudget
    from aioload._engine.engine import Engine
    from aioload._observe.monitor import Monitor
    from aioload._engine.ready import ReadyQueue
    from aioload._front.resources import Resources
    from aioload._plan.sampling import EpochProgress
    from aioload._engine.spec import Plan
    from aioload._observe.stats import StatsRecorder

SUPERSEDED = ("this epoch ended because iter() was called on the same DataLoader again: an "
              "aioload.DataLoader runs one epoch at a time; use two loaders to walk two epochs side by side")
CLOSED_DURING = "the DataLoader was closed during iteration"


@dataclass(eq=False)
class EpochContext:
    """Everything one epoch's iterator needs, handed over by the loader when the epoch starts
    (the iterator's first ``next()``). What the loader's attributes said at that moment holds
    for the whole epoch, as torch's iterator keeps what its loader said when it was made."""

    plan: Plan
    dataset: Any
    stats: StatsRecorder
    progress: EpochProgress | None  # what state_dict() reads; one more batch taken per delivery
    monitor: Monitor | None
    budget: ErrorBudget  # failures of this epoch, raised or skipped (on_error=)
    # How a batch is made where it is made here (num_workers=0):
    collate_fn: Any
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    iterable: bool
    seed: int | None
    on_error: str
    # Where it goes:
    device: Any  # a torch.device, or None
    pin: bool
    # What the epoch's end and torch's warnings need:
    timeout: float | None
    batches: int | None  # the epoch's batches, where the sampler knows them
    len_called: int | None  # an IterableDataset's len() as reported before the epoch began
    num_workers: int
    persistent: bool
    # Fed by the engine (None in-process):
    resources: Resources | None = None
    engine: Engine | None = None
    ready: ReadyQueue | None = None
    transfer: Any = None
    superseded: bool = False  # a newer epoch of the same loader started: this one is over
    exhausted: bool = False  # every batch was delivered: the workers may stay for the next epoch
    stall_warning: float | None = None  # without timeout=: warn once when a batch takes this long
    stall_warned: bool = False  # ... which it did in this epoch

    def delivered(self, samples: int, waited: float) -> None:
        """A batch was handed over after ``waited`` seconds inside ``__next__``."""
        self.stats.delivered(samples, waited)
        if self.stats.stall is not None:
            self.stats.warn_stalled()  # a read blocks its loop: said here, in the training loop's thread
        if self.progress is not None:
            self.progress.taken += 1
        if self.monitor is not None:
            self.monitor.batch()

    def noted(self) -> None:
        """Apply what the batches just passed did to an IterableDataset's copies (their notes,
        in the order received: see aioload._plan.stateful)."""
        copies = self.progress.copies if self.progress is not None else None
        if copies is not None and self.ready is not None:
            copies.apply(self.ready.take_notes())

    def ended(self, waited: float) -> None:
        """``__next__`` found the end of the epoch after ``waited`` seconds."""
        self.stats.end_epoch(waited)
        if self.stats.stall is not None:
            self.stats.warn_stalled()
        if self.monitor is not None:
            self.monitor.end_epoch()


class EpochSource(Protocol):
    """What an epoch iterator asks of its loader."""

    def __len__(self) -> int: ...

    def _start_engine(self) -> EpochContext: ...

    def _start_in_process(self) -> EpochContext: ...


class EpochIterator:
    """One epoch, as seen by the training loop (``for`` or ``async for``).

    Making one starts nothing: the epoch (its plan, the workers, the engine) starts at the
    first ``next()``, because frameworks make an iterator to probe a loader and drop it, and
    that must start no process or thread, draw no seed and count no epoch.
    """

    _RANGE = WAITING  # the profiler range around each __next__

    def __init__(self, source: EpochSource):
        self._source = source
        self._ctx: EpochContext | None = None  # set by the first next()
        self._done = False
        self._yielded = 0
        self._finalizer: weakref.finalize | None = None

    # -- what a subclass says ---------------------------------------------------------------
    def _open(self, source: EpochSource) -> EpochContext:
        """Start the epoch: the context the loader hands over."""
        raise NotImplementedError

    def _next(self, ctx: EpochContext):
        """The next batch of the started epoch, or ``StopIteration``."""
        raise NotImplementedError

    async def __anext__(self):
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def __iter__(self) -> "EpochIterator":
        return self

    def __aiter__(self) -> "EpochIterator":
        return self

    def __len__(self) -> int:
        return len(self._source)

    @property
    def unstarted(self) -> bool:
        """Made, and its epoch not started yet (that happens at the first ``next()``)."""
        return self._ctx is None and not self._done

    def __next__(self):
        with profiled(self._RANGE):
            return self._next_checked()

    def _next_checked(self):
        if self._done:
            raise StopIteration
        return self._next(self._context())

    def _context(self) -> EpochContext:
        """The epoch's context, starting the epoch at the first call."""
        ctx = self._ctx
        if ctx is None:
            ctx = self._ctx = self._open(self._source)
            if ctx.resources is not None:  # an engine runs: stop it when this iterator goes
                self._finalizer = weakref.finalize(self, _finish_epoch, ctx)
        return ctx

    def _end(self, exhausted: bool = False) -> None:
        """No batch follows: ``exhausted`` when the epoch ran to its end."""
        self._done = True
        if self._ctx is not None:
            self._ctx.exhausted = exhausted
        if self._finalizer is not None:
            self._finalizer()

    def _epoch_over(self, ctx: EpochContext, started: float) -> None:
        """The end of the epoch was found after waiting since ``started``."""
        ctx.ended(time.perf_counter() - started)
        self._end(exhausted=True)

    def _stopped_error(self, ctx: EpochContext) -> LoaderClosedError:
        """The epoch was stopped from outside: by a newer epoch, or by ``close()``."""
        self._end()
        return LoaderClosedError(SUPERSEDED if ctx.superseded else CLOSED_DURING)

    def _handed_over(self, ctx: EpochContext, samples: int, waited: float) -> None:
        """The statistics and torch's length warning of one delivered batch."""
        self._yielded += 1
        ctx.delivered(samples, waited)
        warn_iterable_length(ctx.dataset, ctx.num_workers, self._yielded, ctx.len_called)

    def close(self) -> None:
        """Stop this epoch early (what ``break`` does once the iterator is dropped)."""
        self._end()


def _finish_epoch(ctx: EpochContext) -> None:
    """An engine-fed epoch's iterator is finished or dropped: its resources decide what stays."""
    if ctx.resources is not None and ctx.engine is not None:  # both are set, or neither
        ctx.resources.end_epoch(ctx.engine, exhausted=ctx.exhausted, persistent=ctx.persistent,
                                superseded=ctx.superseded)
