"""Loading in the caller's process: torch's ``num_workers=0`` iteration over a plain dataset,
and the decode and collate steps that run here when only the reads go to the engine."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from typing import TYPE_CHECKING

import anyio
import torch

from aioload import _device
from aioload._budget import SKIPPED, budget_for, run_in_process
from aioload._compat import LOADING, WAITING_ASYNC, _len_called, _warn_iterable_length, profiled
from aioload._seeding import sample_seed, seed_everything

if TYPE_CHECKING:
    from aioload._loader import DataLoader
    from aioload._spec import Plan, Ready

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

_END = object()


class _AllSkipped(Exception):
    """Every sample of a batch was skipped (``on_error="skip"``): the batch is not delivered."""


class _InProcessIterator:
    """``num_workers=0`` with a plain dataset: torch's single-process loading, in the caller's
    thread (no engine, no event loop)."""

    def __init__(self, loader: DataLoader):
        self._loader = loader
        self._plan: Plan | None = None  # set, with what follows, by the first next()
        self._budget = None
        self._batches = None
        self._data_iter = None
        self._data_ended = False  # as torch's fetcher: an iterator that ran out is not asked again
        self._yielded = 0
        self._len_called: int | None = None
        self._ended = False

    def _start(self) -> None:
        """The epoch starts at the first ``next()``: an iterator made and dropped (a framework
        probing the loader) draws no seed, consumes no sampler and counts no epoch."""
        loader = self._loader
        self._len_called = _len_called(loader)
        self._plan = loader._start_in_process()
        self._budget = budget_for(loader)
        loader._current_base = self._plan.base_seed
        self._batches = self._plan.batches
        self._data_iter = iter(loader.dataset) if loader._iterable else None

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _fetch(self):
        loader = self._loader
        t = loader._torch
        if loader._iterable:
            if t._auto_collation:
                if self._data_ended:
                    raise StopIteration
                samples = list(itertools.islice(self._data_iter, t.batch_size))
                self._data_ended = len(samples) < t.batch_size
                if not samples or (t.drop_last and len(samples) < t.batch_size):
                    raise StopIteration
                return t.collate_fn(samples)
            return t.collate_fn(next(self._data_iter))
        while True:
            seq, indices = next(self._batches)
            self._plan.delivered.add(seq)
            try:
                return self._fetch_map(indices)
            except _AllSkipped:
                continue

    def _fetch_map(self, indices):
        loader = self._loader
        t = loader._torch
        ds = loader.dataset
        with _seeded(loader):
            if t._auto_collation:
                if loader.seed is None and loader.on_error == "raise" and getattr(ds, "__getitems__", None):
                    return t.collate_fn(ds.__getitems__(indices))
            else:
                indices = [indices]
            describe = getattr(ds, "describe", None)
            samples = []
            for i in indices:
                _seed_sample(loader, i)
                sample = run_in_process(self._budget, describe, "__getitem__", [i], ds.__getitem__, i)
                if sample is not SKIPPED:
                    samples.append((i, sample))
        return _collate_in_process(loader, self._budget, samples)

    def __next__(self):
        with profiled(LOADING):
            return self._next()

    def _next(self):
        if self._ended:
            raise StopIteration
        if self._plan is None:
            self._start()
        started = time.perf_counter()
        try:
            batch = self._fetch()
        except StopIteration:
            self._ended = True
            self._plan.delivered.complete = True
            self._loader._epoch_ends(time.perf_counter() - started)
            raise
        loader = self._loader
        if loader._device is not None:
            batch = _device.apply(_device.pin_batch(batch) if loader._pin else batch,
                                  lambda t: t.to(loader._device, non_blocking=True))
        elif loader._pin:
            batch = _device.pin_batch(batch)
        self._yielded += 1
        samples = loader.batch_size or 1
        loader._delivered(samples, time.perf_counter() - started)
        _warn_iterable_length(loader, self._yielded, self._len_called)
        return batch

    def __aiter__(self):
        return self

    def _next_or_end(self):
        try:
            return self._next()
        except StopIteration:
            return _END

    async def __anext__(self):
        with profiled(WAITING_ASYNC):  # the range is the coroutine's: it waits for the thread
            batch = await anyio.to_thread.run_sync(self._next_or_end)
        if batch is _END:
            raise StopAsyncIteration
        return batch

    def close(self) -> None:
        self._ended = True


def _decode_in_process(loader: DataLoader, item: Ready, budget):
    """``num_workers=0`` with a split dataset: reads ran ahead on the engine, decode runs here."""
    ds = loader.dataset
    describe = getattr(ds, "describe", None)
    started, cpu = time.perf_counter(), time.thread_time()
    with _seeded(loader, item):
        samples = []
        for index, raw in item.raw:
            _seed_sample(loader, index)
            sample = run_in_process(budget, describe, "decode", [index], ds.decode, raw)
            if sample is not SKIPPED:
                samples.append((index, sample))
    loader._stats.decoded_batch(len(samples), time.perf_counter() - started, time.thread_time() - cpu)
    return _collate_in_process(loader, budget, samples)


def _collate_in_process(loader: DataLoader, budget, samples: list):
    """Collate ``(index, sample)`` pairs in this process, with the same error handling as the
    workers: a failure names the batch's indices and is raised or skipped."""
    if not samples:
        raise _AllSkipped
    t = loader._torch
    indices = [index for index, _ in samples]
    values = [sample for _, sample in samples]
    batch = run_in_process(budget, None, "collate_fn", indices, t.collate_fn,
                           values if t._auto_collation else values[0])
    if batch is SKIPPED:
        raise _AllSkipped
    return batch


@contextlib.contextmanager
def _seeded(loader: DataLoader, item=None):
    """With ``seed=``, per-sample seeding in this process must not disturb the caller's RNGs."""
    if loader.seed is None:
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


def _seed_sample(loader: DataLoader, index) -> None:
    if loader.seed is not None:
        seed_everything(sample_seed(loader._current_base, index))
