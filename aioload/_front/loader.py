"""The front end: ``aioload.DataLoader``, iterated with ``for`` or ``async for``.

The loader validates its arguments exactly as torch's DataLoader does (by building one, which
also gives it torch's sampler logic), owns the worker pool and the slot pool, and starts one
:class:`~aioload._engine.engine.Engine` per epoch. The iterator it returns (:mod:`aioload._front.iterator`)
takes finished batches from the ready queue; dropping it, ``break``, an exception or Ctrl-C
stops the engine. With ``num_workers=0`` and a plain dataset, loading runs in the caller's
thread (:mod:`aioload._front.inprocess`). Both iterators share one base (:mod:`aioload._front.epoch`) and
know the loader only through ``len()``, :meth:`DataLoader._start_engine` and
:meth:`DataLoader._start_in_process`, which hand each epoch its
:class:`~aioload._front.epoch.EpochContext`.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import warnings
import weakref
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
import torch
from torch.utils.data import IterableDataset
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate

from aioload._handoff import device as _device
from aioload._engine.budget import ErrorBudget, check_max_errors, epoch_samples, logger
from aioload._front.compat import len_called, warn_as_torch_iterator
from aioload._data.dataset import fetches_batches, is_split
from aioload._engine.engine import Engine
from aioload._front.epoch import EpochContext
from aioload._engine import executor as _executor
from aioload._base.errors import LoaderClosedError, a_kind
from aioload._engine import gpudecode as _gpudecode
from aioload._front.inprocess import InProcessIterator
from aioload._front.iterator import EngineIterator
from aioload._observe.monitor import Monitor, check_options
from aioload._workers.pool import WorkerPool, choose_context
from aioload._engine.ready import ReadyQueue
from aioload._front.resources import LIVE, Resources, finalize_loader, watch_exit
from aioload._plan.sampling import EpochProgress, Planner, shard_sampler
from aioload._plan.sampling import distributed_rank as _distributed_rank
from aioload._base.seeding import derive_seed
from aioload._plan import stateful as _stateful
from aioload._engine.spec import BatchBound, Mode, Plan, Reads, Shared, Spec
from aioload._observe.stats import LoaderStats, StatsRecorder, dataset_figures
from aioload._observe.tune import check_knob, is_auto, make_tuner
from aioload._data.reads import MAX_IO, START_IO
from aioload._plan.resume import NEW_WORKERS
from aioload._workers.worker import WorkerConfig

# torch's class, taken at import: a program may then put aioload's in its place
# (``torch.utils.data.DataLoader = aioload.DataLoader``) for code it does not own.
_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(_TorchDataLoader.__init__).parameters
# What torch's DataLoader.__setattr__ refuses once the loader is built (its samplers were made
# from these); every other attribute of torch's loader may be assigned, and so it may here.
_FROZEN = frozenset({"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"})

STALL_WARNING = 300.0
"""Seconds the training loop may wait for one batch, without ``timeout=``, before the loader
warns where it is held up (with the stuck workers' stacks): longer than any first batch of a
healthy run (workers starting, caches filling) that the test suite or the benchmarks know of."""



class _PoolSettings(NamedTuple):
    """The assignable attributes a worker pool is started with, and where its samples are
    read (decided from them and the dataset, once per pool: see ``DataLoader._settings``)."""

    num_workers: int
    collate_fn: Any
    worker_init_fn: Any
    multiprocessing_context: Any
    read_in_workers: bool = False
    fetch_in_workers: bool = False  # window mode's shards fetched by the workers (aioload._workers.fetches)


def _torch_attribute(name: str) -> property:
    """An attribute kept on the torch loader aioload builds, so an assignment is validated (and
    stored) exactly as torch's loader does it (``multiprocessing_context`` checks its value)."""
    return property(lambda self: getattr(self._torch, name), lambda self, value: setattr(self._torch, name, value))


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _rows_ahead(dataset) -> int:
    """The rows a dataset asks the workers' reads to run ahead of their decode
    (``dataset.rows_ahead``, e.g. Parquet's window mode over remote files); 0 where it does not."""
    ahead = getattr(dataset, "rows_ahead", 0)
    return ahead if isinstance(ahead, int) and not isinstance(ahead, bool) and ahead > 0 else 0


def default_queue_depth(prefetch_factor: int | None, num_workers: int) -> int:
    """``queue_depth=None``'s value: ``max(2, prefetch_factor × num_workers / 2)`` (2 with two workers)."""
    return max(2, (prefetch_factor or 2) * max(1, num_workers) // 2)


_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(Generic[_T_co]):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Generic in the dataset's sample type as torch's is (``DataLoader[tuple[Tensor, Tensor]]``).

    Every argument of torch's DataLoader has the same meaning and default, and the batches,
    errors, warnings and ``len()`` are torch's (``tests/test_conformance.py`` compares the two
    case by case; ``docs/migration.md`` lists the few deliberate differences). aioload adds,
    keyword-only:

    * ``io_concurrency`` -- reads in flight (``Dataset.read`` calls running at once). Storage
      with latency L serving one read at a time needs about ``throughput * L`` of them.
      ``"auto"`` starts at 64 and raises it while that helps: where the workers read, each
      worker's own limit doubles while its decoding waits on reads held at it, up to its share
      of 1024; on the loader's loop, the tuner resizes it (see ``docs/stats.md``).
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
      INFO) every this many seconds; ``progress=True`` shows a tqdm bar per epoch on a terminal
      (a plain line a minute elsewhere).
    * ``shard`` -- with a map-style dataset and no sampler given, each rank loads a disjoint
      shard of equal length (like ``DistributedSampler``) once ``torch.distributed`` is
      initialised: decided every epoch, so the loader may be built before
      ``init_process_group``; ``len()`` follows the current world size. ``False`` turns this
      off. ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly, and one rank's
      state resumes every rank (frameworks save rank 0's). See ``docs/reproducibility.md``.
    * ``executor`` -- any ``concurrent.futures.Executor`` (a ``ProcessPoolExecutor``, a
      ``ThreadPoolExecutor``, Dask's ``Client(address).get_executor()``) makes the batches instead
      of the built-in workers: one task per batch, the dataset sent to each of its processes once,
      tensors back as out-of-band buffers. ``num_workers`` is then the number of tasks in flight
      (0: the executor's own parallelism). ``read_on_executor=False`` reads on the trainer and
      sends the bytes with each task. See ``docs/distributed.md``.
    * ``read_in_workers`` -- where a split dataset's ``async def read`` runs when
      ``num_workers > 0``. ``None`` (default): in the worker processes, each on its own event
      loop with its share of ``io_concurrency`` reads in flight (with ``"auto"``, a limit of
      its own that grows while its decoding waits on reads held at it), so that the training
      process spends no CPU on reads (see ``docs/architecture.md``), unless the dataset's
      ``read_in_workers`` says no. ``False``: on the loader's event loop in the training
      process. ``True``: in the workers.
    * ``snapshot_every_n_steps`` -- torchdata's ``StatefulDataLoader`` argument, accepted so that
      code written for it runs unchanged (an int >= 1, or ``None``). It changes nothing:
      every batch is a snapshot, ``state_dict()`` is exact after any batch (see
      ``docs/migration.md``).
    * ``stall_warning`` -- without ``timeout=``, once a batch has been awaited this many
      seconds (default 300), warn once per epoch with an :class:`aioload.StalledWarning` naming
      the samples held up, the worker, its pid and its Python stack; the loader goes on
      waiting. ``None``: no warning. See ``docs/troubleshooting.md``.
    """

    def __init__(self, dataset: torch.utils.data.Dataset[_T_co],
                 batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory_device: str = "", in_order: bool = True,
                 io_concurrency: int | str = "auto", queue_depth: int | str | None = None, device=None,
                 seed: int | None = None, on_error: str = "raise", max_errors: int | float | None = None,
                 read_timeout: float | None = None,
                 log_every: float | None = None, progress: bool = False, shard: bool = True,
                 executor: concurrent.futures.Executor | None = None, read_on_executor: bool = True,
                 read_in_workers: bool | None = None, stall_warning: float | None = STALL_WARNING,
                 snapshot_every_n_steps: int | None = 1):
        extra: dict[str, Any] = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        if pin_memory_device:
            extra["pin_memory_device"] = pin_memory_device
        if seed is not None and generator is not None:
            raise ValueError("pass either seed or generator, not both: seed=S makes aioload seed a generator per epoch")
        self._seed_generator = torch.Generator() if seed is not None else None
        # Under torch.distributed, each rank loads its own shard, decided each epoch, so that the
        # loader may be built before init_process_group (see docs/reproducibility.md).
        self._shard = shard_sampler(shard, dataset, sampler, batch_sampler, shuffle, drop_last, seed,
                                    generator if seed is None else self._seed_generator)
        if self._shard is not None:
            sampler, shuffle = self._shard, None
        # A dataset that decodes on the GPU delivers encoded images, which do not stack.
        self._decode_on = _gpudecode.decode_device_of(dataset)
        if self._decode_on is not None and collate_fn is None:
            collate_fn = _gpudecode.collate_encoded
        # torch's own constructor validates every torch argument and builds the samplers.
        with warnings.catch_warnings():
            if executor is not None:  # num_workers counts batches in flight there, not processes here
                warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
            self._torch = _TorchDataLoader(
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
        _positive_int("snapshot_every_n_steps", snapshot_every_n_steps, allow_none=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        check_max_errors(max_errors, on_error)
        _check_read_timeout(read_timeout, dataset)
        _check_stall_warning(stall_warning)
        if on_error == "skip" and isinstance(dataset, IterableDataset):
            raise ValueError(
                "on_error='skip' needs a map-style dataset: an IterableDataset's iterator cannot "
                "go on after it raised; catch errors inside __iter__ instead"
            )
        if executor is not None:
            _executor.check_executor(executor, dataset, seed, worker_init_fn)
        elif num_workers == 0 and timeout:
            raise ValueError("timeout applies to worker processes: use it with num_workers > 0")
        self.dataset = dataset
        self.pin_memory = pin_memory
        self.io_concurrency = io_concurrency
        default_depth = default_queue_depth(prefetch_factor, num_workers)
        self.queue_depth = queue_depth if queue_depth is not None else default_depth
        self.device = device
        self.seed = seed
        self.on_error = on_error
        self.max_errors = max_errors
        self.read_timeout = read_timeout
        self.stall_warning = stall_warning
        self.in_order = in_order
        self._user_generator = generator
        self._next_epoch = 0
        self._planner = Planner(self._torch, seed, self._seed_generator, isinstance(dataset, IterableDataset))
        self._resume: dict | None = None  # a loaded state, applied by the next iteration
        self._progress: EpochProgress | None = None  # the epoch in progress, for state_dict()
        self._pending: weakref.ref | None = None  # the last iterator made, while it may not have started
        # The last epoch fed by the engine, while its iterator holds it (a weak reference: what the
        # epoch holds, its engine and queue, must not outlive its iterator).
        self._running: weakref.ref[EpochContext] | None = None
        self._stats = StatsRecorder()
        self._stats.dataset = dataset  # named by attribute where the workers copy it (copy-on-read)
        self._dataset_base = dataset_figures(dataset)  # a dataset's own counters count from here
        first = BatchBound(max(1, num_workers), prefetch_factor or 2, self._torch.batch_size or 1, whole=False,
                           reads=is_split(dataset))  # until the first epoch's spec gives the bound
        self._tuner = make_tuner(io_concurrency, self.queue_depth, self._torch.batch_size, num_workers,
                                 first.batches, default_depth)
        self._monitor = None
        if log_every is not None or progress:
            self._monitor = Monitor(_weak_stats(self), log_every, progress)
        self._res = Resources(Shared())
        res = self._res  # the verdict reads the workers' CPU counters (a closure over res, not self)
        self._stats.worker_pids = lambda: [p.pid for p in res.pool.procs] if res.pool is not None else []
        if self._decode_on is not None:
            _gpudecode.check_loader_device(self._decode_on, None if device is None else torch.device(device))
        self._pool_settings: _PoolSettings | None = None  # what the running pool was started with
        self._device = _device.resolve_device(device)
        self._pin = (pin_memory or self._device is not None or self._decode_on is not None) and _device.pin_available()
        self._iterated = False  # torch warns about pinning and worker counts per iterator it makes
        self._split = is_split(dataset)
        self._iterable = isinstance(dataset, IterableDataset)
        # one __getitems__ call per batch, as torch makes it (not with seed=: each sample is
        # seeded alone), decided once: the dataset and the seed cannot change
        self._batched_fetch = not self._split and seed is None and fetches_batches(dataset)
        self.executor = executor
        self.read_on_executor = read_on_executor
        if read_in_workers is not None and not isinstance(read_in_workers, bool):
            raise TypeError(f"read_in_workers must be True, False or None, got {read_in_workers!r}")
        self.read_in_workers = read_in_workers
        self.snapshot_every_n_steps = snapshot_every_n_steps  # torchdata's; every batch is a snapshot here
        if executor is not None:
            self._res.executor = _executor.ExecutorStage(executor, dataset, self._torch.collate_fn, self._split,
                                                         read_here=read_on_executor, worker_init_fn=worker_init_fn)
        LIVE.add(self._res)
        self._finalizer = weakref.finalize(self, finalize_loader, self._res)
        self._initialized = True

    # -- torch's attributes -----------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        # torch refuses these once built (the samplers were made from them); so does aioload.
        if name in _FROZEN and self.__dict__.get("_initialized"):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(name, value)
        if name == "pin_memory" and self.__dict__.get("_initialized"):
            self._pin = (value or self._device is not None) and _device.pin_available()

    batch_size = property(lambda self: self._torch.batch_size)
    drop_last = property(lambda self: self._torch.drop_last)
    sampler = property(lambda self: self._shard.active() if self._shard is not None else self._torch.sampler)
    batch_sampler = property(lambda self: self._torch.batch_sampler)
    persistent_workers = property(lambda self: self._torch.persistent_workers)
    # Assignable, as on torch's loader. The worker settings apply to the next worker pool: see
    # _settings() and docs/migration.md.
    num_workers = _torch_attribute("num_workers")
    collate_fn = _torch_attribute("collate_fn")
    timeout = _torch_attribute("timeout")
    worker_init_fn = _torch_attribute("worker_init_fn")
    multiprocessing_context = _torch_attribute("multiprocessing_context")
    prefetch_factor = _torch_attribute("prefetch_factor")
    pin_memory_device = property(lambda self: getattr(self._torch, "pin_memory_device", ""),
                                 lambda self, value: setattr(self._torch, "pin_memory_device", value))

    @property
    def generator(self):
        return self._user_generator

    @generator.setter
    def generator(self, value) -> None:
        if self.seed is not None:
            raise ValueError("pass either seed or generator, not both: seed=S makes aioload seed a generator per epoch")
        self._user_generator = self._torch.generator = value

    def __len__(self) -> int:
        return len(self._torch)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the epoch in progress and the worker processes. Idempotent."""
        self._res.close()
        self._stats.settle()  # a memory measurement under way ends with the loader
        if self._monitor is not None:
            self._monitor.end_epoch()
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._res.closed

    def __enter__(self) -> "DataLoader[_T_co]":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> "DataLoader[_T_co]":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await anyio.to_thread.run_sync(self.close)

    # -- epochs -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs. It is also passed to ``sampler.set_epoch`` and, at
        the epoch's start, to an ``IterableDataset``'s ``set_epoch`` where it has one (a Hugging
        Face streaming dataset's, say): the dataset itself, and each worker's copy that is not
        at that epoch already, as Accelerate's loader and the Hugging Face ``Trainer`` do.
        Epochs count up by themselves without it (see docs/reproducibility.md)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next_epoch = epoch
        self._progress = None
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # another epoch than the loaded state's: start it afresh

    def state_dict(self) -> dict:
        """Where this loader is: the epoch, the batches delivered so far, and the generator
        states that replay the order. Plain data (``json`` and ``torch.save`` take it); take it
        between batches, as often as you like (it never fails and costs the same at every
        batch). A loader built alike (``num_workers``, ``io_concurrency``, ``in_order`` and the
        rank may differ) that loads it yields exactly the batches not yet delivered; where the
        position inside an epoch cannot be saved (an ``IterableDataset``), the state is the
        epoch's start. See docs/reproducibility.md."""
        if self._resume is not None:
            return self._planner.resume_state(self._resume)
        pending = self._pending() if self._pending is not None else None
        if pending is not None and pending.unstarted:
            # iter() was called and its epoch not started (it starts at the first next()): the
            # state of that epoch's start, with the generators it will draw from
            return self._planner.start_state(self._next_epoch, self._next_streams())
        return self._planner.state_dict(self._next_epoch, self._progress, self._next_streams())

    def _keeps_streams(self) -> bool:
        """Whether the workers' random streams go on from epoch to epoch (persistent workers
        without ``seed=``, as torch's): a state of an epoch's start then says what they are."""
        return bool(self.persistent_workers) and self.seed is None and self.num_workers > 0 and self.executor is None

    def _next_streams(self):
        """The next epoch's workers' random streams, for a state of its start (see
        aioload._plan.resume): new workers where none are running, else those the running ones
        reported at the end of the last epoch (``None``: not known, or not kept)."""
        if not self._keeps_streams():
            return None
        pool = self._res.pool
        if pool is None or not pool.alive():
            return NEW_WORKERS
        ends = self._planner.end_streams
        return ends.records if ends is not None and ends.known else None

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s output: the next iteration continues its epoch
        (or starts the next one, if it was saved between epochs). The whole state is checked
        here: a malformed one, or one saved with another configuration or world size, raises
        a ``ValueError`` naming the field; one that stands for its epoch's start warns."""
        self._resume = self._planner.load(state)
        self._next_epoch = self._resume["epoch"]
        self._progress = None
        self._pending = None

    def state_from_torchdata(self, state: dict) -> dict:
        """The aioload state that resumes what torchdata's ``StatefulDataLoader`` saved for
        this loader's ``IterableDataset`` (each worker's ``dataset_state`` and iterator state,
        taken over as they are), for :meth:`load_state_dict`. It resumes this loader's next
        epoch; torchdata saves no epoch number nor generator state. See docs/migration.md."""
        ranks = _distributed_rank()
        return _stateful.from_torchdata(state, self._planner.start_state(self._next_epoch, pin=False), self._iterable,
                                        self.num_workers, 1 if ranks is None else ranks[1])

    def set_weights(self, weights) -> None:
        """Change the weights of the :class:`aioload.Mix` this loader draws from, from the next
        batch the training loop has not received on (or from the next epoch's start, between
        epochs). The change is part of :meth:`state_dict`, so a resumed run draws exactly what
        this one does; call it at the same batch on every rank. Batches already made with the
        old weights are made again (a few batches' work)."""
        mix = self._planner._mix()
        if mix is None:
            raise TypeError(
                "set_weights changes the weights of an aioload.Mix drawn by the loader's own sampler; this "
                f"loader's dataset is {a_kind(type(self.dataset).__name__)}"
                + (" with a sampler of its own" if callable(getattr(self.dataset, "mixed_order", None)) else "")
            )
        checked = mix.dataset.check_weights(weights)
        running = self._running() if self._running is not None else None
        if running is not None and (running.exhausted or running.engine is None or self._res.engine is not running.engine):
            running = None
        if self._planner.set_weights(checked, self._progress, self._resume) and running is not None:
            self._remake(running)

    def _remake(self, ctx: EpochContext) -> None:
        """Make the rest of the running epoch again from where the consumer is, as a resumed
        epoch (its plan changed: a mix's weights). The worker pool stays."""
        if self._planner.tally is not None and self._progress is not None:
            self._planner.tally.settle(self._progress.delivered)
        state = self.state_dict()
        self._res.stop_engine()
        self._resume = self._planner.load(state)
        self._next_epoch = self._resume["epoch"]
        settings = self._settings()
        plan = self._plan()
        engine, ready, transfer = self._engine_for(plan, settings)
        ctx.plan, ctx.progress, ctx.budget = plan, self._progress, engine.budget
        ctx.engine, ctx.ready, ctx.transfer = engine, ready, transfer

    def _epoch_position(self) -> tuple[int, int | None]:
        """``(batches already delivered, batches in all)`` of the epoch the next iteration runs
        on this rank: a loaded state's epoch as it resumes on the world there is now (for
        integrations that count an epoch's batches themselves, such as Accelerate's)."""
        return self._planner.position(self._resume)

    def stats(self) -> LoaderStats:
        """A snapshot of the pipeline's counters (see :class:`aioload.LoaderStats`)."""
        if self._res.shared.slots is not None:
            self._stats.shm_bytes = self._res.shared.slots.bytes_in_use
        self._stats.worker_restarts = self._res.restarts
        engine = self._res.engine
        io, depth = self._limits()
        auto = is_auto(self.io_concurrency)
        ceiling = MAX_IO if auto else io
        settings = self._pool_settings
        if settings is not None and settings.read_in_workers and self._res.pool is not None:
            # each worker has a limit of its own: together, as their last replies gave them
            start, most = self._read_limits(settings.num_workers)
            io = self._stats.worker_read_limit() or start * settings.num_workers
            ceiling = most * settings.num_workers
        gauges = dict(queue_occupancy=len(engine.ready) if engine is not None else 0, io_concurrency=io,
                      io_auto=auto, io_ceiling=ceiling, queue_depth=depth, num_workers=self.num_workers,
                      worker_start=self._res.pool.start_method if self._res.pool is not None else "")
        if self._res.executor is not None:
            gauges.update(self._res.executor.figures(), num_workers=self._executor_spec().num_workers)
        tally = self._settled_tally()
        if tally is not None:
            gauges["per_source"] = tally.figures()
        gauges.update(dataset_figures(self.dataset, self._dataset_base))
        return self._stats.snapshot(**gauges)

    def _limits(self) -> tuple[int, int]:
        """The current ``(io_concurrency, queue_depth)``: as given, or as tuned so far."""
        if self._tuner is not None:
            return self._tuner.controller.io, self._tuner.controller.depth
        return int(self.io_concurrency), int(self.queue_depth)  # not "auto": there would be a tuner

    def _settled_tally(self):
        """A mix's tally of samples per source, brought up to the batches delivered so far
        (``None`` without a mix)."""
        tally = self._planner.tally
        if tally is not None and self._progress is not None:
            tally.settle(self._progress.delivered)
        return tally

    def _epoch_begins(self, epoch: int) -> None:
        tally = self._settled_tally()
        if tally is not None:
            tally.new_epoch()
        self._stats.begin_epoch()
        if self._monitor is not None:
            try:
                total = len(self)
            except TypeError:
                total = None
            self._monitor.begin_epoch(epoch, total)

    def _plan(self) -> Plan:
        """The next epoch's numbered index batches and seeds (see :mod:`aioload._plan.sampling`)."""
        epoch, resume = self._next_epoch, self._resume
        self._next_epoch += 1
        self._resume = None
        # With seed=, every sample's augmentation is seeded from (seed, epoch, index), whatever
        # the worker count. Without it, workers are seeded per epoch from torch's base seed,
        # exactly as torch does, and no per-sample cost is paid.
        per_sample = not self._iterable and self.seed is not None
        lazy = self.num_workers == 0 and not self._split and self.executor is None  # InProcessIterator pulls
        self._planner.in_order = self.in_order
        plan, self._progress = self._planner.plan(epoch, resume, per_sample, lazy=lazy, streams=self._keeps_streams())
        return plan

    def _settings(self) -> _PoolSettings:
        """The worker settings this epoch runs with. As in torch, every epoch takes the loader's
        current values (a pool started with others is replaced), except that persistent workers
        already running keep the values they were started with (torch reuses its iterator)."""
        t = self._torch
        now = _PoolSettings(t.num_workers, t.collate_fn, t.worker_init_fn, t.multiprocessing_context,
                            self._reads_in_workers(t.num_workers), self._fetches_in_workers(t.num_workers))
        pool = self._res.pool
        if pool is not None and self._pool_settings is not None and now != self._pool_settings:
            if self.persistent_workers and now.num_workers > 0 and pool.alive():
                return self._pool_settings
            self._res.discard_pool()
        return now

    def _reads_in_workers(self, num_workers: int) -> bool:
        """Whether the workers await ``dataset.read`` themselves (:mod:`aioload._workers.reads`):
        decided here, for each pool, and handed to the pool and to every epoch's spec."""
        if not self._split or self._iterable or self.executor is not None or num_workers == 0:
            return False
        if self.read_in_workers is not None:
            return self.read_in_workers
        return bool(getattr(self.dataset, "read_in_workers", True))

    def _fetches_in_workers(self, num_workers: int) -> bool:
        """Whether the workers fetch the dataset's window-mode shards (the dataset's
        ``fetch_in_workers``; :mod:`aioload._workers.fetches`)."""
        if not self._split or self._iterable or self.executor is not None or num_workers == 0:
            return False
        return bool(getattr(self.dataset, "fetch_in_workers", False))

    def _budget(self) -> ErrorBudget:
        """A fresh epoch's error budget."""
        return ErrorBudget(self.on_error, self.max_errors, epoch_samples(self._torch), self._stats.skip)

    def _spec(self, settings: _PoolSettings) -> Spec:
        """What this epoch's engine is given: every fact about how its batches are made,
        decided here once from the loader's settings and ``settings`` (its pool's)."""
        t = self._torch
        if self.executor is not None:
            return self._executor_spec()
        if settings.num_workers == 0:
            mode = Mode.READ
        elif self._iterable:
            mode = Mode.ITER
        elif t._auto_collation and settings.collate_fn is default_collate:
            mode = Mode.ROWS
        else:
            mode = Mode.WHOLE
        if not self._split:
            reads = Reads.NONE
        else:
            reads = Reads.WORKERS if settings.read_in_workers else Reads.ENGINE
        workers = max(1, settings.num_workers)
        io, depth = self._limits()
        # torch's dispatch wherever a user can tell: without seed= (per-sample seeds), which
        # worker loads a batch decides its random draws, so batch i goes whole to worker i mod N
        # and each worker loads its batches in order (see aioload._engine.spec.Turn).
        # in_order=False lets torch give a batch to any worker with room: the least-loaded one,
        # split into chunks.
        round_robin = (settings.num_workers > 0 and self.in_order and mode in (Mode.ROWS, Mode.WHOLE)
                       and self.seed is None)
        batched = settings.num_workers > 0 and self._batched_fetch
        bound = BatchBound(workers, prefetch=t.prefetch_factor or 2, batch_size=t.batch_size or 1,
                           whole=round_robin or batched or mode in (Mode.WHOLE, Mode.ITER),
                           reads=reads is Reads.ENGINE, rows_ahead=_rows_ahead(self.dataset))
        if self._tuner is not None:
            self._tuner.controller.follow(bound.batches, tune_io=reads is Reads.ENGINE)
        return Spec(
            dataset=self.dataset, split=self._split, mode=mode, reads=reads, batch_size=t.batch_size,
            num_workers=workers, io_concurrency=io, bound=bound, queue_depth=depth,
            in_order=self.in_order, on_error=self.on_error, round_robin=round_robin,
            pin=self._pin, prefetch_tasks=(t.prefetch_factor or 2) * workers,
            describe=getattr(self.dataset, "describe", None), tuner=self._tuner,
            read_timeout=self.read_timeout, max_errors=self.max_errors, epoch_samples=epoch_samples(t),
            auto_collation=t._auto_collation, batched_fetch=batched,
        )

    def _executor_spec(self) -> Spec:
        """With ``executor=``: ``num_workers`` (or the executor's own parallelism) batches
        being made, ``queue_depth`` ready; the trainer reads only where told to."""
        t = self._torch
        stage = self._res.executor
        in_flight = self.num_workers or _executor.default_in_flight(self.executor)
        io, depth = self._limits()
        if not self._split:
            reads = Reads.NONE
        else:
            reads = Reads.WORKERS if self.read_on_executor else Reads.ENGINE
        bound = BatchBound(in_flight, prefetch=1, batch_size=t.batch_size or 1, whole=False,
                           reads=reads is Reads.ENGINE)
        return Spec(
            dataset=self.dataset, split=self._split, mode=Mode.EXECUTOR, reads=reads, batch_size=t.batch_size,
            num_workers=in_flight, io_concurrency=io, bound=bound, queue_depth=depth,
            in_order=self.in_order, on_error=self.on_error, pin=self._pin, prefetch_tasks=in_flight,
            describe=getattr(self.dataset, "describe", None), tuner=None, read_timeout=self.read_timeout,
            max_errors=self.max_errors, epoch_samples=epoch_samples(t), auto_collation=t._auto_collation,
            executor=stage,
        )

    def _read_limits(self, num_workers: int) -> tuple[int, int]:
        """Reads in flight per worker, where the workers read: ``(at first, at most)``. A fixed
        ``io_concurrency`` is split across the workers; ``"auto"`` starts each at its share of
        ``START_IO`` and lets it grow to its share of ``MAX_IO`` (see aioload._data.reads.next_limit)."""
        if is_auto(self.io_concurrency):
            return -(-START_IO // num_workers), -(-MAX_IO // num_workers)
        share = -(-int(self.io_concurrency) // num_workers)
        return share, share

    def _pool(self, base_seed: int, settings: _PoolSettings) -> WorkerPool:
        """The worker pool; a new one starts with the epoch's base seed, as torch's workers do
        (drawing another would move the generator off the order a resumed run replays)."""
        res = self._res
        if res.pool is not None and not res.pool.alive():
            res.discard_pool()
        if res.pool is None and res.lost is not None:
            logger.warning("starting a fresh pool of %d workers; the last one was lost: %s",
                           settings.num_workers, res.lost)
            res.lost = None
            res.restarts += 1
        if res.pool is None:
            t = self._torch
            read_limit, read_ceiling = self._read_limits(settings.num_workers)
            cfg = WorkerConfig(
                dataset=self.dataset, num_workers=settings.num_workers, split=self._split,
                iterable=self._iterable, auto_collation=t._auto_collation, collate_fn=settings.collate_fn,
                batch_size=t.batch_size, drop_last=t.drop_last, worker_init_fn=settings.worker_init_fn,
                base_seed=base_seed if self.seed is None else derive_seed(self.seed, 2**31),
                exact_seeds=self.seed is not None,
                keep_rng=self.persistent_workers and self.seed is None,
                batched_fetch=self._batched_fetch,
                stateful=not self._iterable and _stateful.is_stateful(self.dataset),
                read_in_workers=settings.read_in_workers, read_limit=read_limit, read_ceiling=read_ceiling,
                read_timeout=self.read_timeout, fetch_shards=settings.fetch_in_workers,
            )
            watch_exit()  # stopped before a multiprocessing child joins its children (NOTE [exit hooks])
            res.pool = WorkerPool(cfg, settings.num_workers, choose_context(settings.multiprocessing_context))
            res.workers = settings.num_workers
            self._pool_settings = settings
        return res.pool

    def __iter__(self) -> "EngineIterator | InProcessIterator":
        """An iterator over the next epoch. Making it starts nothing: the epoch (its plan, the
        workers, the engine) starts at its first ``next()``, so an iterator made to probe the
        loader and dropped costs nothing and leaves the epoch count as it was."""
        if self._res.closed:
            raise LoaderClosedError("this DataLoader was closed; create a new one to iterate again")
        # torch warns each time it makes an iterator (once in all with persistent workers,
        # which reuse theirs); with executor=, num_workers counts batches, not processes.
        if not (self._iterated and self.persistent_workers):
            self._iterated = True
            warn_as_torch_iterator(self._torch, self.num_workers > 0 and self.executor is None, self.pin_memory)
        if self.num_workers == 0 and not self._split and self.executor is None:
            iterator: EngineIterator | InProcessIterator = InProcessIterator(self)
        else:
            iterator = EngineIterator(self)
        self._pending = weakref.ref(iterator)  # until its first next(), state_dict() is its epoch's start
        return iterator

    def _begin_epoch(self) -> _PoolSettings:
        """An iterator starts: the epoch in progress, if any, ends (one epoch at a time)."""
        if self._res.closed:
            raise LoaderClosedError("this DataLoader was closed; create a new one to iterate again")
        running = self._running() if self._running is not None else None
        if running is not None:
            running.superseded = True
        self._res.stop_engine()
        self._epoch_begins(self._next_epoch)
        return self._settings()

    def _context(self, plan: Plan, budget, called: int | None, batches: int | None, **engine_parts) -> EpochContext:
        """What the epoch's iterator works with, as the loader's attributes say now."""
        t = self._torch
        return EpochContext(
            plan=plan, dataset=self.dataset, stats=self._stats, progress=self._progress, monitor=self._monitor,
            budget=budget, collate_fn=t.collate_fn, auto_collation=t._auto_collation, batch_size=t.batch_size,
            drop_last=t.drop_last, iterable=self._iterable, seed=self.seed, on_error=self.on_error,
            device=self._device, pin=self._pin, timeout=self.timeout or None, batches=batches,
            len_called=called, num_workers=self.num_workers, persistent=self.persistent_workers,
            stall_warning=self.stall_warning, **engine_parts,
        )

    def _start_in_process(self) -> EpochContext:
        """The first ``next()`` of an in-process iterator: the epoch's plan."""
        called = len_called(self._torch, self._iterable)  # before the monitor asks len()
        self._begin_epoch()
        plan = self._plan()
        return self._context(plan, self._budget(), called, batches=None)

    def _start_engine(self) -> EpochContext:
        """The first ``next()`` of an iterator fed by the engine: the epoch's plan, the worker
        pool (kept from the last epoch or started now) and the engine's thread."""
        called = len_called(self._torch, self._iterable)
        batches = None if self._iterable else _len_or_none(self)
        settings = self._begin_epoch()
        if self._res.executor is not None:  # the loader's collate_fn and worker_init_fn now, as for a new pool
            stage = self._res.executor
            stage.configure(settings.collate_fn, settings.worker_init_fn,
                            keep=self.persistent_workers and stage.batches > 0)
        plan = self._plan()
        if plan.new_workers and self._res.pool is not None:
            # the saved run's epoch started new workers; these ones have gone on drawing
            self._res.discard_pool()
            settings = self._settings()
        engine, ready, transfer = self._engine_for(plan, settings)
        ctx = self._context(plan, engine.budget, called, batches, resources=self._res,
                            engine=engine, ready=ready, transfer=transfer)
        self._running = weakref.ref(ctx)
        return ctx

    def _engine_for(self, plan: Plan, settings: _PoolSettings):
        """The engine of one epoch's plan, started: ``(engine, ready queue, transfer)``."""
        pool = self._pool(plan.base_seed, settings) if settings.num_workers > 0 and self.executor is None else None
        spec = self._spec(settings)
        ready = ReadyQueue(self.in_order, plan.delivered)
        transfer: _device.Transfer | _gpudecode.DecodeTransfer | None = None
        if self._decode_on is not None:
            transfer = _gpudecode.DecodeTransfer(self._decode_on, self.dataset, plan.base_seed)
        elif self._device is not None:
            transfer = _device.Transfer(self._device)
        engine = Engine(spec, plan, pool, self._res.shared, ready, self._stats, transfer)
        if isinstance(transfer, _gpudecode.DecodeTransfer):
            transfer.budget = engine.budget
        engine.start()
        self._res.engine = engine
        return engine, ready, transfer

    def __aiter__(self) -> "EngineIterator | InProcessIterator":
        return self.__iter__()

    def __repr__(self) -> str:
        return (f"aioload.DataLoader(batch_size={self.batch_size}, num_workers={self.num_workers}, "
                f"io_concurrency={self.io_concurrency}, queue_depth={self.queue_depth}, device={self.device!r})")


def _weak_stats(loader: DataLoader):
    """``loader.stats`` without keeping the loader alive (the monitor lives on the loader)."""
    ref = weakref.ref(loader)

    def stats():
        alive = ref()
        return alive.stats() if alive is not None else None

    return stats


def _len_or_none(loader: DataLoader) -> int | None:
    """The epoch's batches, or ``None`` where the sampler has no ``len()``."""
    try:
        return len(loader)
    except TypeError:
        return None


def _check_seconds(name: str, value, none: str) -> None:
    """``value`` is a number of seconds above 0, or ``None`` (which ``none`` explains)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds {none}, got {value}")


def _check_stall_warning(stall_warning) -> None:
    _check_seconds("stall_warning", stall_warning, "(None turns the warning off)")


def _check_read_timeout(read_timeout, dataset) -> None:
    _check_seconds("read_timeout", read_timeout, "or None")
    if read_timeout is None:
        return
    if not is_split(dataset):
        raise ValueError(
            "read_timeout bounds Dataset.read, and this dataset has no 'async def read' (it is "
            "loaded with __getitem__ in the workers); use timeout= instead"
        )
