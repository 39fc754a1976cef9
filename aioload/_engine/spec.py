"""The values the loader, the engine and the consumer share: what an epoch is given
(:class:`Spec`, :class:`Plan`, :class:`Shared`) and what it hands back (:class:`Ready`,
:class:`Failure`, or :class:`_Cancelled` once stopped)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from aioload._handoff.layout import Layout
from aioload._handoff.slots import SlotPool


@dataclass
class Spec:
    """What the engine needs from the loader for one epoch: made by the loader when the epoch
    starts (``DataLoader._spec``), from its settings and its pool as they are then."""

    dataset: Any
    split: bool
    mode: str  # "rows", "whole", "iter", "read" (num_workers=0: the consumer decodes) or "executor"
    batch_size: int | None
    num_workers: int
    io_concurrency: int
    permits: int  # batches in flight plus queue_depth
    permits_quick: int  # ``permits`` once batches are known to be quick (see aioload._workers.pool.batches_in_flight)
    in_order: bool
    on_error: str
    pin: bool
    prefetch_tasks: int
    describe: Callable[[Any], str] | None = None
    tuner: Any = None  # an aioload._observe.tune.Tuner when a limit is "auto"
    read_timeout: float | None = None  # seconds one dataset.read may take
    max_errors: int | float | None = None  # on_error="skip": the bound on skips per epoch
    epoch_samples: int | None = None  # the base of a fractional max_errors
    auto_collation: bool = True  # False with batch_size=None: each index (even a list) is one sample
    batched_fetch: bool = False  # the dataset's __getitems__ gets each batch whole, as in torch
    executor: Any = None  # an aioload._engine.executor.ExecutorStage with executor=
    # A split dataset whose workers read: the read stage sends them bare indices (as for a
    # dataset without a read stage) and calls neither read nor read_nowait here.
    read_in_workers: bool = False


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


class Failure:
    """A batch that could not be made; the consumer raises ``exc`` in its place."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


@dataclass
class Ready:
    batch: Any
    samples: int
    event: Any = None
    raw: list | None = None  # num_workers=0 with a split dataset: (index, raw) pairs


@dataclass
class Shared:
    """State that outlives an epoch: the learned layout and its slot pool."""

    layout: Layout | None = None
    no_leaves: bool = False
    slots: SlotPool | None = None
    per_sample_s: float | None = None
    holds: set = field(default_factory=set)
    chunked: bool | None = None  # rows collated by chunk in the workers (see aioload._handoff.chunks)
    quick: bool = False  # a batch goes to one worker whole and decodes within WHOLE_BATCH_SECONDS


def resize_permits(permits, shared: Shared | None, limit: int) -> None:
    """Allow ``limit`` batches between the sampler and the consumer (``permits``, a Limiter)
    and keep as many free slots, plus one for the batch being filled."""
    permits.set_limit(limit)
    slots = getattr(shared, "slots", None)
    if slots is not None:
        slots.target = limit + 1


class _Cancelled(Exception):
    """The epoch was stopped by the consumer (break, close, garbage collection)."""
