"""The front end: ``aioload.DataLoader``, iterated with ``for`` or ``async for``.

The loader validates its arguments exactly as torch's DataLoader does (by building one, which
also gives it torch's sampler logic), owns the worker pool and the slot pool, and starts one
:class:`~aioload._engine.Engine` per epoch. The iterator it returns takes finished batches from
the ready queue; dropping it, ``break``, an exception or Ctrl-C stops the engine.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import random
import re
import threading
import time
import warnings
import weakref


import anyio
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from aioload import _device
from aioload._budget import SKIPPED, budget_for, check_max_errors, epoch_samples, logger, run_in_process
from aioload._dataset import is_split
from aioload._engine import Engine, Failure, Plan, Ready, Shared, Spec, _Cancelled
from aioload._errors import DataLoaderTimeoutError, LoaderClosedError
from aioload._monitor import Monitor, check_options
from aioload._pool import WorkerPool, choose_context
from aioload._ready import EndOfEpoch, ReadyQueue
from aioload._sampling import Planner, shard_sampler
from aioload._seeding import derive_seed, sample_seed, seed_everything
from aioload._stats import LoaderStats, StatsRecorder
from aioload._tune import check_knob, is_auto, make_tuner
from aioload._worker import WorkerConfig, _batched_fetch

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters
_LIVE: "weakref.WeakSet[_Resources]" = weakref.WeakSet()


class _Resources:
    """Everything a loader must release; kept apart from the loader so a finalizer can reach it."""

    def __init__(self):
        self.pool: WorkerPool | None = None
        self.engine: Engine | None = None
        self.shared = Shared()
        self.closed = False
        self.restarts = 0
        self.pid = os.getpid()  # a forked child (any worker process) inherits a copy: not its to close
        self.lost: str | None = None  # why the last pool was lost (a crash), until it is replaced
        self.workers = 0  # worker processes per pool, once one has been started
        self.epoch_state: dict | None = None

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()
            if not engine.clean:
                self.discard_pool()

    def discard_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None and not pool.closed and not pool.alive():
            self.lost = str(pool.broken) if pool.broken is not None else "a worker process died"
        slots, self.shared.slots = self.shared.slots, None
        if slots is not None:
            slots.close()
        if pool is not None:
            pool.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop_engine()
        self.discard_pool()


def _finalize_loader(res: _Resources) -> None:
    if res.closed:
        return
    if res.workers and not _EXITING:  # it started processes, even if none runs right now
        warnings.warn(
            f"an aioload.DataLoader with {res.workers} worker processes was garbage "
            "collected without close(); use 'with aioload.DataLoader(...)' or call close()",
            ResourceWarning,
            stacklevel=2,
        )
    res.close()


_EXITING = False
_FROZEN = frozenset({"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"})


class _NotYet(Exception):
    """Nothing is ready yet (the async consumer then waits for a wake-up)."""


def _async_waker():
    """An event for the running async library and a thread-safe function that sets it."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        import trio

        event = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake() -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass

        return event, wake
    import asyncio

    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:
            pass  # the consumer's loop is closed

    return event, wake
_END = object()


def _close_all_at_exit() -> None:
    """Runs before the interpreter joins threads: stop every engine, then every pool."""
    global _EXITING
    _EXITING = True
    for res in list(_LIVE):
        if res.pid == os.getpid():
            res.close()


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_all_at_exit)
else:  # pragma: no cover
    import atexit

    atexit.register(_close_all_at_exit)


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


class DataLoader:
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Every argument of torch's DataLoader has the same meaning and default, and the batches,
    errors, warnings and ``len()`` are torch's (``tests/test_conformance.py`` compares the two
    case by case; ``docs/migration.md`` lists the few deliberate differences). aioload adds,
    keyword-only:

    * ``io_concurrency`` -- reads in flight (``Dataset.read`` calls running at once). Storage
      with latency L serving one read at a time needs about ``throughput * L`` of them.
      ``"auto"`` starts at 64 and raises it while that helps (see ``docs/stats.md``).
    * ``queue_depth`` -- finished batches buffered ahead of the consumer; each costs one batch
      of shared memory (and of device memory with ``device=``). Two to four absorb jitter.
      ``"auto"`` starts at the default and grows while that helps.
    * ``device`` -- deliver batches on this device: copies are ``non_blocking`` on a side
      stream from page-locked shared memory, overlapping the training step.
    * ``seed`` -- makes the order and every random augmentation a function of
      ``(seed, epoch, index)`` only. Without it, seeds come from torch's global RNG (or
      ``generator``) as in torch.
    * ``on_error`` -- ``"raise"`` (default) or ``"skip"`` failed samples; ``max_errors`` bounds
      the skips of an epoch (a count, or a float fraction of the epoch's samples). Skipped
      samples are logged (logger ``"aioload"``) and listed in ``stats().skipped``; a batch
      that held one is delivered short. See ``docs/troubleshooting.md``.
    * ``read_timeout`` -- seconds one ``Dataset.read`` may take before it fails with
      :class:`aioload.DataLoaderTimeoutError` (skipped like any failure with ``on_error="skip"``).
    * ``log_every`` -- log a line of statistics with a verdict (logger ``"aioload"``, level
      INFO) every this many seconds; ``progress=True`` shows a tqdm bar per epoch.
    * ``shard`` -- with ``torch.distributed`` initialised and no sampler given, each rank
      loads a disjoint shard of equal length (like ``DistributedSampler``); ``False`` turns
      this off. ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly. See
      ``docs/reproducibility.md``.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory_device: str = "", in_order: bool = True,
                 io_concurrency: int | str = 64, queue_depth: int | str | None = None, device=None,
                 seed: int | None = None, on_error: str = "raise", max_errors: int | float | None = None,
                 read_timeout: float | None = None,
                 log_every: float | None = None, progress: bool = False, shard: bool = True):
        extra = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        if pin_memory_device:
            extra["pin_memory_device"] = pin_memory_device
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both: seed=S makes aioload seed a generator per epoch")
        self._seed_generator = torch.Generator() if seed is not None else None
        # Under torch.distributed, each rank loads its own shard (see docs/reproducibility.md).
        self._shard = shard_sampler(shard, dataset, sampler, batch_sampler, shuffle, drop_last, seed)
        if self._shard is not None:
            sampler, shuffle = self._shard, None
        # torch's own constructor validates every torch argument and builds the samplers.
        self._torch = torch.utils.data.DataLoader(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, False,
            drop_last, timeout, worker_init_fn, multiprocessing_context,
            generator if seed is None else self._seed_generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, **extra,
        )
        check_knob("io_concurrency", io_concurrency)
        check_knob("queue_depth", queue_depth)
        if not is_auto(io_concurrency):
            _positive_int("io_concurrency", io_concurrency)
        if not is_auto(queue_depth):
            _positive_int("queue_depth", queue_depth, allow_none=True)
        check_options(log_every, progress)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        check_max_errors(max_errors, on_error)
        _check_read_timeout(read_timeout, dataset)
        if on_error == "skip" and isinstance(dataset, IterableDataset):
            raise ValueError(
                "on_error='skip' needs a map-style dataset: an IterableDataset's iterator cannot "
                "go on after it raised; catch errors inside __iter__ instead"
            )
        if num_workers == 0 and timeout:
            raise ValueError("timeout applies to worker processes: use it with num_workers > 0")
        self.dataset = dataset
        self.pin_memory = pin_memory
        self.io_concurrency = io_concurrency
        default_depth = max(2, (prefetch_factor or 2) * max(1, num_workers) // 2)
        self.queue_depth = queue_depth if queue_depth is not None else default_depth
        self.device = device
        self.seed = seed
        self.on_error = on_error
        self.max_errors = max_errors
        self.read_timeout = read_timeout
        self.in_order = in_order
        self._user_generator = generator
        self._next_epoch = 0
        self._planner = Planner(self._torch, seed, self._seed_generator, isinstance(dataset, IterableDataset))
        self._resume: dict | None = None  # a loaded state, applied by the next iteration
        self._progress = None  # the epoch in progress, for state_dict()
        self._stats = StatsRecorder()
        self._tuner = make_tuner(io_concurrency, self.queue_depth, self._torch.batch_size, num_workers, default_depth)
        self._monitor = None
        if log_every is not None or progress:
            self._monitor = Monitor(_weak_stats(self), log_every, progress)
        self._res = _Resources()
        self._device = _device.resolve_device(device)
        self._pin = (pin_memory or self._device is not None) and _device.pin_available()
        self._iterated = False  # torch warns about pinning and worker counts per iterator it makes
        self._split = is_split(dataset)
        self._iterable = isinstance(dataset, IterableDataset)
        _LIVE.add(self._res)
        self._finalizer = weakref.finalize(self, _finalize_loader, self._res)
        self._initialized = True

    # -- torch's attributes -----------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        # torch refuses these once built (the samplers were made from them); so does aioload.
        if name in _FROZEN and self.__dict__.get("_initialized"):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(name, value)

    batch_size = property(lambda self: self._torch.batch_size)
    drop_last = property(lambda self: self._torch.drop_last)
    sampler = property(lambda self: self._torch.sampler)
    batch_sampler = property(lambda self: self._torch.batch_sampler)
    num_workers = property(lambda self: self._torch.num_workers)
    collate_fn = property(lambda self: self._torch.collate_fn)
    timeout = property(lambda self: self._torch.timeout)
    worker_init_fn = property(lambda self: self._torch.worker_init_fn)
    multiprocessing_context = property(lambda self: self._torch.multiprocessing_context)
    generator = property(lambda self: self._user_generator)
    prefetch_factor = property(lambda self: self._torch.prefetch_factor)
    persistent_workers = property(lambda self: self._torch.persistent_workers)
    pin_memory_device = property(lambda self: getattr(self._torch, "pin_memory_device", ""))

    def __len__(self) -> int:
        return len(self._torch)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the epoch in progress and the worker processes. Idempotent."""
        self._res.close()
        if self._monitor is not None:
            self._monitor.end_epoch()
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._res.closed

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> "DataLoader":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await anyio.to_thread.run_sync(self.close)

    # -- epochs -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs (it is also passed to ``sampler.set_epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next_epoch = epoch
        self._progress = None
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # another epoch than the loaded state's: start it afresh

    def state_dict(self) -> dict:
        """Where this loader is: the epoch, the batches delivered so far, and the generator
        states that replay the order. Plain data (``json`` and ``torch.save`` take it); take it
        between batches. A loader built alike (``num_workers``, ``io_concurrency`` and
        ``in_order`` may differ) that loads it yields exactly the batches not yet delivered.
        See docs/reproducibility.md."""
        if self._resume is not None:
            return self._planner.resume_state(self._resume)
        return self._planner.state_dict(self._next_epoch, self._progress)

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s output: the next iteration continues its epoch
        (or starts the next one, if it was saved between epochs)."""
        self._resume = self._planner.load(state)
        self._next_epoch = self._resume["epoch"]
        self._progress = None

    def stats(self) -> LoaderStats:
        """A snapshot of the pipeline's counters (see :class:`aioload.LoaderStats`)."""
        if self._res.shared.slots is not None:
            self._stats.shm_bytes = self._res.shared.slots.bytes_in_use
        self._stats.worker_restarts = self._res.restarts
        engine = self._res.engine
        io, depth = self._limits()
        return self._stats.snapshot(queue_occupancy=len(engine.ready) if engine is not None else 0,
                                    io_concurrency=io, queue_depth=depth, num_workers=self.num_workers)

    def _limits(self) -> tuple[int, int]:
        """The current ``(io_concurrency, queue_depth)``: as given, or as tuned so far."""
        if self._tuner is not None:
            return self._tuner.controller.io, self._tuner.controller.depth
        return self.io_concurrency, self.queue_depth

    def _epoch_begins(self, epoch: int) -> None:
        self._stats.begin_epoch()
        if self._monitor is not None:
            try:
                total = len(self)
            except TypeError:
                total = None
            self._monitor.begin_epoch(epoch, total)

    def _epoch_ends(self, waited: float) -> None:
        self._stats.end_epoch(waited)
        if self._monitor is not None:
            self._monitor.end_epoch()

    def _delivered(self, samples: int, waited: float) -> None:
        self._stats.delivered(samples, waited)
        if self._monitor is not None:
            self._monitor.batch()

    def _plan(self) -> Plan:
        """The next epoch's numbered index batches and seeds (see :mod:`aioload._sampling`)."""
        epoch, resume = self._next_epoch, self._resume
        self._next_epoch += 1
        self._resume = None
        # With seed=, every sample's augmentation is seeded from (seed, epoch, index), whatever
        # the worker count. Without it, workers are seeded per epoch from torch's base seed,
        # exactly as torch does, and no per-sample cost is paid.
        per_sample = not self._iterable and self.seed is not None
        lazy = self.num_workers == 0 and not self._split  # _InProcessIterator pulls in the caller's thread
        plan, self._progress = self._planner.plan(epoch, resume, per_sample, lazy=lazy)
        return plan

    def _spec(self) -> Spec:
        t = self._torch
        if self.num_workers == 0:
            mode = "read"
        elif self._iterable:
            mode = "iter"
        elif t._auto_collation and t.collate_fn is default_collate:
            mode = "rows"
        else:
            mode = "whole"
        workers = max(1, self.num_workers)
        batch = t.batch_size or 1
        io, depth = self._limits()
        inflight = max(2, workers, -(-io // batch))
        return Spec(
            dataset=self.dataset, split=self._split, mode=mode, batch_size=t.batch_size,
            num_workers=workers, io_concurrency=io,
            permits=inflight + depth, in_order=self.in_order, on_error=self.on_error,
            pin=self._pin, prefetch_tasks=(t.prefetch_factor or 2) * workers,
            describe=getattr(self.dataset, "describe", None), tuner=self._tuner,
            read_timeout=self.read_timeout, max_errors=self.max_errors, epoch_samples=epoch_samples(t),
            auto_collation=t._auto_collation,
            batched_fetch=self.num_workers > 0 and not self._split and self.seed is None and _batched_fetch(self.dataset),
        )

    def _pool(self, base_seed: int) -> WorkerPool:
        """The worker pool; a new one starts with the epoch's base seed, as torch's workers do
        (drawing another would move the generator off the order a resumed run replays)."""
        res = self._res
        if res.pool is not None and not res.pool.alive():
            res.discard_pool()
        if res.pool is None and res.lost is not None:
            logger.warning("starting a fresh pool of %d workers; the last one was lost: %s",
                           self.num_workers, res.lost)
            res.lost = None
            res.restarts += 1
        if res.pool is None:
            t = self._torch
            cfg = WorkerConfig(
                dataset=self.dataset, num_workers=self.num_workers, split=self._split,
                iterable=self._iterable, auto_collation=t._auto_collation, collate_fn=t.collate_fn,
                batch_size=t.batch_size, drop_last=t.drop_last, worker_init_fn=t.worker_init_fn,
                base_seed=base_seed if self.seed is None else derive_seed(self.seed, 2**31),
                exact_seeds=self.seed is not None,
                keep_rng=self.persistent_workers and self.seed is None,
            )
            res.pool = WorkerPool(cfg, self.num_workers, choose_context(t.multiprocessing_context))
            res.workers = self.num_workers
        return res.pool

    def __iter__(self) -> "_Iterator":
        if self._res.closed:
            raise LoaderClosedError("this DataLoader was closed; create a new one to iterate again")
        if self._res.epoch_state is not None:
            self._res.epoch_state["superseded"] = True
        self._res.stop_engine()
        _warn_as_torch_iterator(self)
        self._epoch_begins(self._next_epoch)
        if self.num_workers == 0 and not self._split:
            return _InProcessIterator(self, self._plan())
        plan = self._plan()
        self._current_base = plan.base_seed
        pool = self._pool(plan.base_seed) if self.num_workers > 0 else None
        spec = self._spec()
        ready = ReadyQueue(self.in_order, plan.delivered)
        transfer = _device.Transfer(self._device) if self._device is not None else None
        engine = Engine(spec, plan, pool, self._res.shared, ready, self._stats, transfer,
                        slot_target=spec.permits + 1)
        engine.start()
        self._res.engine = engine
        iterator = _Iterator(self, engine, ready, transfer)
        self._res.epoch_state = iterator._state
        return iterator

    def __aiter__(self) -> "_Iterator":
        return self.__iter__()

    def __repr__(self) -> str:
        return (f"aioload.DataLoader(batch_size={self.batch_size}, num_workers={self.num_workers}, "
                f"io_concurrency={self.io_concurrency}, queue_depth={self.queue_depth}, device={self.device!r})")


class _Iterator:
    """One epoch, as seen by the training loop (``for`` or ``async for``)."""

    def __init__(self, loader: DataLoader, engine: Engine, ready: ReadyQueue, transfer):
        self._loader = loader
        self._engine = engine
        self._ready = ready
        self._transfer = transfer
        self._timeout = loader.timeout or None
        self._done = False
        self._yielded = 0
        self._len_called = _len_called(loader)
        self._state = {"exhausted": False}
        self._finalizer = weakref.finalize(
            self, _abandon_epoch, engine, loader._res, self._state, loader.persistent_workers
        )

    def __iter__(self) -> "_Iterator":
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _end(self, exhausted: bool = False) -> None:
        self._done = True
        self._state["exhausted"] = exhausted
        self._finalizer()

    def _take(self, get=None, started: float | None = None):
        """Block until the next item (or, with ``get``, take it without blocking); returns
        ``(item, seconds waited)``."""
        if self._done:
            raise StopIteration
        if started is None:
            started = time.perf_counter()
        try:
            item, owed = get() if get is not None else self._ready.get(timeout=self._timeout)
        except _NotYet:
            raise
        except EndOfEpoch:
            self._loader._epoch_ends(time.perf_counter() - started)
            self._end(exhausted=True)
            raise StopIteration from None
        except TimeoutError:
            raise _timed_out(self._engine, self._timeout) from None
        except _Cancelled:
            self._end()
            if self._state.get("superseded"):
                raise LoaderClosedError(
                    "this epoch ended because iter() was called on the same DataLoader again: an "
                    "aioload.DataLoader runs one epoch at a time; use two loaders to walk two "
                    "epochs side by side"
                ) from None
            raise LoaderClosedError("the DataLoader was closed during iteration") from None
        except BaseException:
            self._end()
            raise
        if owed:
            self._engine.give_permit()
        return item, time.perf_counter() - started

    def _finish(self, item, waited: float):
        if isinstance(item, Failure):
            raise item.exc
        loader = self._loader
        if item.raw is not None:
            batch = _decode_in_process(loader, item, self._engine.budget)
        else:
            batch = item.batch
        if item.event is not None:
            batch = self._transfer.hand_over(batch, item.event)
        elif loader._device is not None:
            batch = _device.apply(batch, lambda t: t.to(loader._device, non_blocking=True))
        elif loader._pin:
            batch = _device.pin_batch(batch)
        self._yielded += 1
        loader._delivered(item.samples, waited)
        _warn_iterable_length(loader, self._yielded, self._len_called)
        return batch

    def __next__(self):
        while True:
            item, waited = self._take()
            try:
                return self._finish(item, waited)
            except _AllSkipped:
                continue

    def __aiter__(self) -> "_Iterator":
        return self

    def _ready_now(self):
        found, item, owed = self._ready.get_nowait()
        if not found:
            raise _NotYet
        return item, owed

    async def _wait_async(self, started: float) -> None:
        """Sleep until the engine puts something in the ready queue, without a thread: the
        engine wakes this coroutine's own event loop (asyncio, uvloop or trio)."""
        event, wake = _async_waker()
        if not self._ready.when_ready(wake):
            return
        if self._timeout is None:
            await event.wait()
            return
        left = self._timeout - (time.perf_counter() - started)
        with anyio.move_on_after(max(0.0, left)) as scope:
            await event.wait()
        if scope.cancelled_caught:
            raise _timed_out(self._engine, self._timeout)

    async def _take_async(self):
        started = time.perf_counter()
        while True:
            try:
                return self._take(self._ready_now, started)
            except StopIteration:
                return _END, 0.0
            except _NotYet:
                await self._wait_async(started)

    async def __anext__(self):
        item, waited = await self._take_async()
        if item is _END:
            raise StopAsyncIteration
        try:
            if isinstance(item, Ready) and item.raw is not None:
                return await anyio.to_thread.run_sync(self._finish, item, waited)
            return self._finish(item, waited)
        except _AllSkipped:
            return await self.__anext__()

    def close(self) -> None:
        """Stop this epoch early (what ``break`` does once the iterator is dropped)."""
        self._end()


def _abandon_epoch(engine: Engine, res: _Resources, state: dict, persistent: bool) -> None:
    """An epoch's iterator is finished or dropped. Workers are kept for the next epoch when it
    ran to its end (or with ``persistent_workers=True``); an epoch left early (``break``, an
    exception, Ctrl-C) also stops them, so nothing keeps running behind an abandoned loop."""
    if not state["exhausted"] and not persistent and not state.get("superseded"):
        engine.drain_timeout = 0  # the workers go anyway: do not wait for their tasks
    engine.stop()
    if state.get("superseded"):
        return  # a newer epoch owns the pool now; stop_engine() already judged it
    if res.engine is engine:
        res.engine = None
    if not engine.clean or (not state["exhausted"] and not persistent):
        res.discard_pool()


def _weak_stats(loader: DataLoader):
    """``loader.stats`` without keeping the loader alive (the monitor lives on the loader)."""
    ref = weakref.ref(loader)

    def stats():
        alive = ref()
        return alive.stats() if alive is not None else None

    return stats


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


class _AllSkipped(Exception):
    """Every sample of a batch was skipped (``on_error="skip"``): the batch is not delivered."""


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


def _timed_out(engine: Engine, timeout: float) -> DataLoaderTimeoutError:
    """The ``timeout=`` error, naming the samples the awaited batch is stuck on and where."""
    stuck = engine.outstanding()
    if stuck is None:
        stuck, detail = [], ("the engine's event loop does not answer: a blocking call inside "
                             "'async def read' holds it; make the read asynchronous (await it)")
    elif stuck:
        engine.drain_timeout = 0  # do not wait for stuck workers when the epoch is abandoned
        detail = engine.describe_stuck(stuck)
    else:
        detail = "no sample of the next batch is being read or decoded"
    return DataLoaderTimeoutError(
        f"DataLoader timed out after {timeout} seconds waiting for a batch: {detail}. "
        "Set read_timeout= to bound each read, or raise timeout= if batches are just slow.",
        stuck=stuck,
    )


def _check_read_timeout(read_timeout, dataset) -> None:
    if read_timeout is None:
        return
    if isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float)):
        raise TypeError(f"read_timeout must be a number of seconds or None, got {read_timeout!r}")
    if not read_timeout > 0:
        raise ValueError(f"read_timeout must be > 0 seconds or None, got {read_timeout}")
    if not is_split(dataset):
        raise ValueError(
            "read_timeout bounds Dataset.read, and this dataset has no 'async def read' (it is "
            "loaded with __getitem__ in the workers); use timeout= instead"
        )


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


def _len_called(loader: DataLoader) -> int | None:
    """What ``len(loader)`` reported for an IterableDataset before this epoch began (torch
    compares each epoch against the length known when its iterator was made)."""
    return getattr(loader._torch, "_IterableDataset_len_called", None) if loader._iterable else None


@functools.cache
def _torch_source(method: str) -> str:
    """The source of a method of torch's DataLoader iterator, where some warnings' wording
    differs between torch releases ("" when the source is not installed)."""
    try:
        return inspect.getsource(getattr(torch.utils.data.dataloader._BaseDataLoaderIter, method))
    except (AttributeError, OSError, TypeError):
        return ""


def _length_gap() -> str:
    """torch's length warning joins the length and "(when accessing" with a space in some
    releases and without one in others: use the installed torch's text."""
    joined = re.search(r'\}\(when accessing|\}"\s*f?"\(when accessing', _torch_source("__next__"))
    return "" if joined else " "


def _warn_as_torch_iterator(loader: DataLoader) -> None:
    """The warnings torch's DataLoader gives each time it makes an iterator (once in all with
    persistent workers, which reuse theirs): too many workers for the CPUs, and pinning that
    cannot happen."""
    if loader._iterated and loader.persistent_workers:
        return
    loader._iterated = True
    if loader.num_workers > 0:
        loader._torch.check_worker_number_rationality()
    if not loader.pin_memory:
        return
    device = loader.pin_memory_device
    if device and "pin_memory_device is deprecated" in _torch_source("__init__"):
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{device}'.",
            stacklevel=3,
        )
    if not _device.pin_available():
        warnings.warn(_device.PIN_WARNING, stacklevel=3)


def _warn_iterable_length(loader: DataLoader, yielded: int, called: int | None) -> None:
    if called is not None and yielded > called:
        warnings.warn(
            f"Length of IterableDataset {loader.dataset} was reported to be {called}{_length_gap()}"
            f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
            + ("For multiprocessing data-loading, this could be caused by not properly configuring the "
               "IterableDataset replica at each worker. Please see "
               "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
               if loader.num_workers > 0 else ""),
            stacklevel=3,
        )


class _InProcessIterator:
    """``num_workers=0`` with a plain dataset: torch's single-process loading, in the caller's
    thread (no engine, no event loop)."""

    def __init__(self, loader: DataLoader, plan: Plan):
        self._loader = loader
        self._plan = plan
        self._budget = budget_for(loader)
        loader._current_base = plan.base_seed
        self._batches = plan.batches
        self._data_iter = iter(loader.dataset) if loader._iterable else None
        self._data_ended = False  # as torch's fetcher: an iterator that ran out is not asked again
        self._yielded = 0
        self._len_called = _len_called(loader)
        self._ended = False

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
        if self._ended:
            raise StopIteration
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
            return self.__next__()
        except StopIteration:
            return _END

    async def __anext__(self):
        batch = await anyio.to_thread.run_sync(self._next_or_end)
        if batch is _END:
            raise StopAsyncIteration
        return batch

    def close(self) -> None:
        self._ended = True


