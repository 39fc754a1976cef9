"""Loading in the caller's process: torch's ``num_workers=0`` iteration over a plain dataset,
and the decode and collate steps that run here when only the reads go to the engine."""

from __future__ import annotations

import contextlib
import random
import time
from typing import TYPE_CHECKING

import anyio
import torch

from aioload._handoff import device as _device
from aioload._engine.budget import SKIPPED, AllSkipped, run_in_process
from aioload._front.compat import LOADING, WAITING_ASYNC, profiled
from aioload._front.epoch import EpochContext, EpochIterator, EpochSource
from aioload._base.seeding import sample_seed, seed_everything
from aioload._workers.state import CopyState, dataset_note

if TYPE_CHECKING:
    from aioload._engine.budget import ErrorBudget
    from aioload._engine.spec import Ready

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

_END = object()


class InProcessIterator(EpochIterator):
    """``num_workers=0`` with a plain dataset: torch's single-process loading, in the caller's
    thread (no engine, no event loop). A failing ``__getitem__`` raises in ``next()`` and the
    epoch goes on, as torch's does."""

    _RANGE = LOADING

    def __init__(self, source: EpochSource):
        super().__init__(source)
        self._copy: CopyState | None = None  # an IterableDataset: the dataset itself, as in torch

    def _open(self, source: EpochSource) -> EpochContext:
        ctx = source._start_in_process()
        if ctx.iterable:  # a resumed epoch gives the dataset its saved state first (aioload._plan.stateful)
            copies = ctx.plan.copies
            self._copy = CopyState(0, ctx.dataset, copies[0] if copies else None, ctx.plan.epoch)
        return ctx

    def _fetch(self, ctx: EpochContext):
        if ctx.iterable:
            # as torch's fetcher: an iterator that ran out is not asked again
            copy, copies = self._copy, ctx.progress.copies
            items = copy.batch(ctx.batch_size if ctx.auto_collation else None, ctx.drop_last)
            copies.note(0, copy.note(0 if items is None else len(items)))
            if items is None:
                raise StopIteration
            return ctx.collate_fn(items if ctx.auto_collation else items[0])
        while True:
            seq, indices = next(ctx.plan.batches)
            ctx.plan.delivered.add(seq)
            try:
                batch = _fetch_map(ctx, indices)
            except AllSkipped:
                continue
            copies = ctx.progress.copies
            if copies is not None:  # a Stateful dataset: its state after this batch
                copies.note(0, dataset_note(0, ctx.dataset))
            return batch

    def _next(self, ctx: EpochContext):
        started = time.perf_counter()
        try:
            batch = self._fetch(ctx)
        except StopIteration:
            ctx.plan.delivered.complete = True
            self._epoch_over(ctx, started)
            raise
        if ctx.device is not None:
            batch = _device.apply(_device.pin_batch(batch) if ctx.pin else batch,
                                  lambda t: t.to(ctx.device, non_blocking=True))
        elif ctx.pin:
            batch = _device.pin_batch(batch)
        self._handed_over(ctx, ctx.batch_size or 1, time.perf_counter() - started)
        return batch

    def _next_or_end(self):
        try:
            return self._next_checked()
        except StopIteration:
            return _END

    async def __anext__(self):
        with profiled(WAITING_ASYNC):  # the range is the coroutine's: it waits for the thread
            batch = await anyio.to_thread.run_sync(self._next_or_end)
        if batch is _END:
            raise StopAsyncIteration
        return batch


def _fetch_map(ctx: EpochContext, indices):
    """One batch of a map-style dataset, by ``__getitem__`` (or ``__getitems__``) here."""
    ds = ctx.dataset
    with _seeded(ctx.seed):
        if ctx.auto_collation:
            if ctx.seed is None and ctx.on_error == "raise" and getattr(ds, "__getitems__", None):
                return ctx.collate_fn(ds.__getitems__(indices))
        else:
            indices = [indices]
        describe = getattr(ds, "describe", None)
        samples = []
        for i in indices:
            _seed_sample(ctx, i)
            sample = run_in_process(ctx.budget, describe, "__getitem__", [i], ds.__getitem__, i)
            if sample is not SKIPPED:
                samples.append((i, sample))
    return _collate_in_process(ctx, samples)


def decode_in_process(ctx: EpochContext, item: Ready):
    """``num_workers=0`` with a split dataset: reads ran ahead on the engine, decode runs here."""
    ds = ctx.dataset
    describe = getattr(ds, "describe", None)
    started, cpu = time.perf_counter(), time.thread_time()
    with _seeded(ctx.seed):
        samples = []
        for index, raw in item.raw:
            _seed_sample(ctx, index)
            sample = run_in_process(ctx.budget, describe, "decode", [index], ds.decode, raw)
            if sample is not SKIPPED:
                samples.append((index, sample))
    ctx.stats.decoded_batch(len(samples), time.perf_counter() - started, time.thread_time() - cpu)
    return _collate_in_process(ctx, samples)


def _collate_in_process(ctx: EpochContext, samples: list):
    """Collate ``(index, sample)`` pairs in this process, with the same error handling as the
    workers: a failure names the batch's indices and is raised or skipped."""
    if not samples:
        raise AllSkipped
    budget: ErrorBudget = ctx.budget
    indices = [index for index, _ in samples]
    values = [sample for _, sample in samples]
    batch = run_in_process(budget, None, "collate_fn", indices, ctx.collate_fn,
                           values if ctx.auto_collation else values[0])
    if batch is SKIPPED:
        raise AllSkipped
    return batch


@contextlib.contextmanager
def _seeded(seed: int | None):
    """With ``seed=``, per-sample seeding in this process must not disturb the caller's RNGs."""
    if seed is None:
        yield
        return
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state() if np is not None else None)
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if np is not None:
            np.random.set_state(states[2])


def _seed_sample(ctx: EpochContext, index) -> None:
    if ctx.seed is not None:
        seed_everything(sample_seed(ctx.plan.base_seed, index))
