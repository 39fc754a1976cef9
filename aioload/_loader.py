"""The front end: ``aioload.DataLoader``, iterated with ``for`` or ``async for``.

The loader validates its arguments exactly as torch's DataLoader does (by building one, which
also gives it torch's sampler logic), owns the worker pool and the slot pool, and starts one
:class:`~aioload._engine.Engine` per epoch. The iterator it returns takes finished batches from
the ready queue; dropping it, ``break``, an exception or Ctrl-C stops the engine.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import random
import threading
import time
import warnings
import weakref


import anyio
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from aioload import _device
from aioload._dataset import is_split
from aioload._engine import Engine, Failure, Plan, Ready, Shared, Spec, _Cancelled
from aioload._errors import DataLoaderTimeoutError, LoaderClosedError
from aioload._pool import WorkerPool, choose_context
from aioload._ready import EndOfEpoch, ReadyQueue
from aioload._seeding import derive_seed, draw_base_seed, seed_everything
from aioload._stats import LoaderStats, StatsRecorder
from aioload._worker import WorkerConfig

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

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()
            if not engine.clean:
                self.discard_pool()

    def discard_pool(self) -> None:
        pool, self.pool = self.pool, None
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
    if res.pool is not None and not _EXITING:
        warnings.warn(
            f"an aioload.DataLoader with {res.pool.num_workers} worker processes was garbage "
            "collected without close(); use 'with aioload.DataLoader(...)' or call close()",
            ResourceWarning,
            stacklevel=2,
        )
    res.close()


_EXITING = False
_END = object()


def _close_all_at_exit() -> None:
    """Runs before the interpreter joins threads: stop every engine, then every pool."""
    global _EXITING
    _EXITING = True
    for res in list(_LIVE):
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

    Every argument of torch's DataLoader has the same meaning and default. aioload adds,
    keyword-only:

    * ``io_concurrency`` -- reads in flight (``Dataset.read`` calls running at once). Storage
      with latency L serving one read at a time needs about ``throughput * L`` of them.
    * ``queue_depth`` -- finished batches buffered ahead of the consumer; each costs one batch
      of shared memory (and of device memory with ``device=``). Two to four absorb jitter.
    * ``device`` -- deliver batches on this device: copies are ``non_blocking`` on a side
      stream from page-locked shared memory, overlapping the training step.
    * ``seed`` -- makes the order and every random augmentation a function of
      ``(seed, epoch, index)`` only. Without it, seeds come from torch's global RNG (or
      ``generator``) as in torch.
    * ``on_error`` -- ``"raise"`` (default) or ``"skip"`` failed samples; ``max_errors`` bounds
      the skips.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory_device: str = "", in_order: bool = True,
                 io_concurrency: int = 64, queue_depth: int | None = None, device=None,
                 seed: int | None = None, on_error: str = "raise", max_errors: int | float | None = None):
        extra = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        if pin_memory_device:
            extra["pin_memory_device"] = pin_memory_device
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both: seed=S makes aioload seed a generator per epoch")
        self._seed_generator = torch.Generator() if seed is not None else None
        # torch's own constructor validates every torch argument and builds the samplers.
        self._torch = torch.utils.data.DataLoader(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, False,
            drop_last, timeout, worker_init_fn, multiprocessing_context,
            generator if seed is None else self._seed_generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, **extra,
        )
        _positive_int("io_concurrency", io_concurrency)
        _positive_int("queue_depth", queue_depth, allow_none=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if num_workers == 0 and timeout:
            raise ValueError("timeout applies to worker processes: use it with num_workers > 0")
        self.dataset = dataset
        self.pin_memory = pin_memory
        self.io_concurrency = io_concurrency
        self.queue_depth = queue_depth if queue_depth is not None else max(2, (prefetch_factor or 2) * max(1, num_workers) // 2)
        self.device = device
        self.seed = seed
        self.on_error = on_error
        self.max_errors = max_errors
        self.in_order = in_order
        self._user_generator = generator
        self._next_epoch = 0
        self._stats = StatsRecorder()
        self._res = _Resources()
        self._device = _device.resolve_device(device)
        self._pin = (pin_memory or self._device is not None) and _device.pin_available()
        if pin_memory and not _device.pin_available():
            warnings.warn(_device.PIN_WARNING, stacklevel=2)
        self._split = is_split(dataset)
        self._iterable = isinstance(dataset, IterableDataset)
        _LIVE.add(self._res)
        self._finalizer = weakref.finalize(self, _finalize_loader, self._res)

    # -- torch's attributes -----------------------------------------------------------------
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

    def stats(self) -> LoaderStats:
        """A snapshot of the pipeline's counters (see :class:`aioload.LoaderStats`)."""
        if self._res.shared.slots is not None:
            self._stats.shm_bytes = self._res.shared.slots.bytes_in_use
        self._stats.worker_restarts = self._res.restarts
        return self._stats.snapshot()

    def _plan(self) -> Plan:
        epoch = self._next_epoch
        self._next_epoch += 1
        for target in (self._torch.sampler, getattr(self._torch.batch_sampler, "sampler", None)):
            if hasattr(target, "set_epoch") and target is not None:
                target.set_epoch(epoch)
                break
        if self.seed is not None:
            self._seed_generator.manual_seed(derive_seed(self.seed, epoch))
        if self._iterable:
            base = draw_base_seed(self._torch.generator) if self.seed is None else derive_seed(self.seed, epoch, 1)
            return Plan(batches=iter(()), base_seed=base, per_sample_seeds=False)
        sampler_iter = iter(self._torch._index_sampler)
        base = draw_base_seed(self._torch.generator) if self.seed is None else derive_seed(self.seed, epoch, 1)
        # Pull the first batch here: a sampler that draws from the global RNG does so in the
        # caller's thread, in the order torch's DataLoader draws.
        first = list(itertools.islice(sampler_iter, 1))
        per_sample = self.num_workers > 0 or self.seed is not None
        return Plan(batches=itertools.chain(first, sampler_iter), base_seed=base, per_sample_seeds=per_sample)

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
        inflight = max(2, workers, -(-self.io_concurrency // batch))
        return Spec(
            dataset=self.dataset, split=self._split, mode=mode, batch_size=t.batch_size,
            num_workers=workers, io_concurrency=self.io_concurrency,
            permits=inflight + self.queue_depth, in_order=self.in_order, on_error=self.on_error,
            pin=self._pin, prefetch_tasks=(t.prefetch_factor or 2) * workers,
            describe=getattr(self.dataset, "describe", None),
        )

    def _pool(self) -> WorkerPool:
        res = self._res
        if res.pool is not None and not res.pool.alive():
            res.discard_pool()
            res.restarts += 1
        if res.pool is None:
            t = self._torch
            cfg = WorkerConfig(
                dataset=self.dataset, num_workers=self.num_workers, split=self._split,
                iterable=self._iterable, auto_collation=t._auto_collation, collate_fn=t.collate_fn,
                batch_size=t.batch_size, drop_last=t.drop_last, worker_init_fn=t.worker_init_fn,
                base_seed=draw_base_seed(t.generator) if self.seed is None else derive_seed(self.seed, 2**31),
            )
            res.pool = WorkerPool(cfg, self.num_workers, choose_context(t.multiprocessing_context))
        return res.pool

    def __iter__(self) -> "_Iterator":
        if self._res.closed:
            raise LoaderClosedError("this DataLoader was closed; create a new one to iterate again")
        self._res.stop_engine()
        if self.num_workers == 0 and not self._split:
            return _InProcessIterator(self, self._plan())
        plan = self._plan()
        self._current_base = plan.base_seed
        pool = self._pool() if self.num_workers > 0 else None
        spec = self._spec()
        ready = ReadyQueue(self.in_order)
        transfer = _device.Transfer(self._device) if self._device is not None else None
        engine = Engine(spec, plan, pool, self._res.shared, ready, self._stats, transfer,
                        slot_target=spec.permits + 1)
        engine.start()
        self._res.engine = engine
        return _Iterator(self, engine, ready, transfer)

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
        self._finalizer = weakref.finalize(self, engine.stop)

    def __iter__(self) -> "_Iterator":
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _end(self) -> None:
        self._done = True
        self._finalizer()

    def _take(self):
        """Block until the next item; returns ``(item, seconds waited)``."""
        if self._done:
            raise StopIteration
        started = time.perf_counter()
        try:
            item = self._ready.get(timeout=self._timeout)
        except EndOfEpoch:
            self._end()
            raise StopIteration from None
        except TimeoutError:
            raise DataLoaderTimeoutError(
                f"DataLoader timed out after {self._timeout} seconds: no batch arrived. "
                "A read or decode may be stuck; raise timeout= if batches are just slow."
            ) from None
        except _Cancelled:
            self._end()
            raise LoaderClosedError("the DataLoader was closed during iteration") from None
        except BaseException:
            self._end()
            raise
        self._engine.give_permit()
        return item, time.perf_counter() - started

    def _finish(self, item, waited: float):
        if isinstance(item, Failure):
            raise item.exc
        loader = self._loader
        if item.raw is not None:
            batch = _decode_in_process(loader, item)
        else:
            batch = item.batch
        if item.event is not None:
            batch = self._transfer.hand_over(batch, item.event)
        elif loader._device is not None:
            batch = _device.apply(batch, lambda t: t.to(loader._device, non_blocking=True))
        elif loader._pin:
            batch = _device.pin_batch(batch)
        self._yielded += 1
        loader._stats.delivered(item.samples, waited)
        _warn_iterable_length(loader, self._yielded)
        return batch

    def __next__(self):
        item, waited = self._take()
        return self._finish(item, waited)

    def __aiter__(self) -> "_Iterator":
        return self

    def _take_or_end(self):
        try:
            return self._take()
        except StopIteration:
            return _END, 0.0

    async def __anext__(self):
        item, waited = await anyio.to_thread.run_sync(self._take_or_end, abandon_on_cancel=True)
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Ready) and item.raw is not None:
            return await anyio.to_thread.run_sync(self._finish, item, waited)
        return self._finish(item, waited)

    def close(self) -> None:
        """Stop this epoch early (what ``break`` does once the iterator is dropped)."""
        self._end()


def _decode_in_process(loader: DataLoader, item: Ready):
    """``num_workers=0`` with a split dataset: reads ran ahead on the engine, decode runs here."""
    ds = loader.dataset
    t = loader._torch
    with _seeded(loader, item):
        samples = []
        for index, raw in item.raw:
            _seed_sample(loader, index)
            samples.append(ds.decode(raw))
    if t._auto_collation:
        return t.collate_fn(samples)
    return t.collate_fn(samples[0])


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
    if loader.seed is not None and isinstance(index, int):
        seed_everything(derive_seed(loader._current_base, index))


def _warn_iterable_length(loader: DataLoader, yielded: int) -> None:
    t = loader._torch
    called = getattr(t, "_IterableDataset_len_called", None)
    if loader._iterable and called is not None and yielded > called:
        warnings.warn(
            f"Length of IterableDataset {loader.dataset} was reported to be {called} "
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
        loader._current_base = plan.base_seed
        self._batches = plan.batches
        self._data_iter = iter(loader.dataset) if loader._iterable else None
        self._yielded = 0
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
                samples = list(itertools.islice(self._data_iter, t.batch_size))
                if not samples or (t.drop_last and len(samples) < t.batch_size):
                    raise StopIteration
                return t.collate_fn(samples)
            return t.collate_fn(next(self._data_iter))
        indices = next(self._batches)
        ds = loader.dataset
        with _seeded(loader):
            if t._auto_collation:
                if loader.seed is None and getattr(ds, "__getitems__", None):
                    samples = ds.__getitems__(indices)
                else:
                    samples = []
                    for i in indices:
                        _seed_sample(loader, i)
                        samples.append(ds[i])
                return t.collate_fn(samples)
            _seed_sample(loader, indices)
            return t.collate_fn(ds[indices])

    def __next__(self):
        if self._ended:
            raise StopIteration
        started = time.perf_counter()
        try:
            batch = self._fetch()
        except StopIteration:
            self._ended = True
            raise
        loader = self._loader
        if loader._device is not None:
            batch = _device.apply(_device.pin_batch(batch) if loader._pin else batch,
                                  lambda t: t.to(loader._device, non_blocking=True))
        elif loader._pin:
            batch = _device.pin_batch(batch)
        self._yielded += 1
        samples = loader.batch_size or 1
        loader._stats.delivered(samples, time.perf_counter() - started)
        _warn_iterable_length(loader, self._yielded)
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


