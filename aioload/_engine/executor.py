"""The decode stage on any ``concurrent.futures.Executor``: ``DataLoader(..., executor=EX)``.

One task per batch, never per sample. A task carries the batch's indices (and, for datasets
read on the trainer, their raw items); the executor's process reads what is remote itself,
decodes, collates, and sends back the batch, whose tensors travel as numpy arrays (pickle
protocol 5 buffers, which Dask and Ray carry out of band). The loader then treats the batch as
any other: pinned, copied to ``device=``, counted, ordered, resumable.

The dataset and ``collate_fn`` reach each executor process once: a task names the loader by a
token, and a process that does not know the token answers :class:`NeedDataset`; the task is
sent again with the pickled dataset, which that process keeps (a few loaders at most). A
thread pool shares the trainer's objects and pickles nothing.

What runs where:

* trainer, engine thread: the sampler, the permits (bounded work in flight), the order, and
  reads only for a dataset marked to read on the trainer (``executor_reads="trainer"``);
* executor process: ``read`` (for every split dataset by default: a URL is fetched where it
  is decoded, so bytes never travel trainer -> cluster -> trainer), ``decode`` or
  ``__getitem__``, per-sample seeding, ``collate_fn``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import os
import pickle
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple

import torch
from torch.utils.data._utils.collate import default_collate

from aioload._dataset import NOT_READY
from aioload._errors import pack_exception
from aioload._workers.messages import TaskError
from aioload._seeding import sample_seed, seed_everything
from aioload._handoff.tree import leaves, map_leaves, map_tensors

RETRIES = 2
"""How many times a batch whose executor process died is sent again before the loader raises."""

KEEP_DATASETS = 4
"""Datasets an executor process keeps (one per loader that used it; least recently used dropped)."""


NEED_DATASET = "aioload: this process has not been sent the loader's dataset yet"
"""What a task answers in a process that does not know its loader (a value, not an exception:
an executor logs failed tasks)."""


# -- in the executor's process ------------------------------------------------------------------
_known: collections.OrderedDict[str, tuple] = collections.OrderedDict()
_forgotten: collections.deque = collections.deque(maxlen=256)  # closed loaders: never kept again
_known_lock = threading.Lock()


def _dataset_for(token: str, blob: bytes | None, local: tuple | None):
    with _known_lock:
        found = _known.get(token)
        if found is not None:
            _known.move_to_end(token)
            return found
        if token in _forgotten:  # a task of a closed loader, still running when it closed
            return None
        if local is not None:
            found = local
        elif blob is not None:
            found = pickle.loads(blob)
        else:
            return None
        _known[token] = found
        while len(_known) > KEEP_DATASETS:
            _known.popitem(last=False)
        return found


def forget(token: str) -> bool:
    """Drop a loader's dataset from this process; whether it was there."""
    with _known_lock:
        if token not in _forgotten:
            _forgotten.append(token)
        return _known.pop(token, None) is not None


def known_tokens() -> list[str]:
    """The loaders whose datasets this process holds (for tests and diagnostics)."""
    with _known_lock:
        return list(_known)


class Job:
    """One batch's work, as sent to the executor (small: indices, raw items, seeds)."""

    __slots__ = ("token", "items", "read_here", "base_seed", "per_sample", "skip", "to_numpy")

    def __init__(self, token: str, items: list, read_here: bool, base_seed: int, per_sample: bool, skip: bool,
                 to_numpy: bool):
        self.token, self.items, self.read_here = token, items, read_here
        self.base_seed, self.per_sample, self.skip, self.to_numpy = base_seed, per_sample, skip, to_numpy

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state):
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


class JobResult(NamedTuple):
    """What a :class:`Job` sends back from the executor's process."""

    batch: Any  # the collated batch, tensors as numpy arrays (see _Array); None when it failed
    errors: list  # TaskError, as the built-in workers report them
    samples: int  # the samples the batch holds
    seconds: float  # wall time of the task
    cpu_s: float  # CPU seconds of the thread that ran it


def run_job(job: Job, blob: bytes | None = None, local: tuple | None = None, nonce: str = ""):
    """Load one batch in an executor process: a :class:`JobResult` (``NEED_DATASET`` when
    this process lacks the loader's dataset). With ``on_error="raise"`` the first failure
    ends the task."""
    known = _dataset_for(job.token, blob, local)
    if known is None:
        return NEED_DATASET
    dataset, collate, split = known
    started, cpu_started = time.perf_counter(), time.thread_time()
    items = job.items
    errors: list = []
    raws: list = [raw for _, raw in items]
    if split and job.read_here:
        raws = _read_all(dataset, [index for index, _ in items], errors, job.skip)
    samples = []
    for pos, ((index, _), raw) in enumerate(zip(items, raws)):
        if raw is _FAILED:
            continue
        if job.per_sample:
            seed_everything(sample_seed(job.base_seed, index))
        try:
            samples.append(dataset.decode(raw) if split else dataset[index])
        except Exception as exc:  # noqa: BLE001 - reported with the sample's index
            errors.append(TaskError(pos, index, "decode" if split else "__getitem__", pack_exception(exc)))
            if not job.skip:
                break
    batch = None
    if samples and not (errors and not job.skip):
        try:
            batch = collate(samples)
        except Exception as exc:  # noqa: BLE001 - the batch's error
            errors.append(TaskError(0, [index for index, _ in items], "collate_fn", pack_exception(exc)))
    if batch is not None and job.to_numpy:
        batch = _outward(batch)
    return JobResult(batch, errors, len(samples), time.perf_counter() - started, time.thread_time() - cpu_started)


_FAILED = object()


def _read_all(dataset, indices: list, errors: list, skip: bool) -> list:
    """Every index's raw item, read here: what ``read_nowait`` has at hand, the rest awaited
    together on one event loop (many reads in flight, as on the trainer's)."""
    raws: list = []
    for index in indices:
        try:
            raws.append(dataset.read_nowait(index))
        except Exception as exc:  # noqa: BLE001
            raws.append(exc)
    waiting = [pos for pos, raw in enumerate(raws) if raw is NOT_READY]
    if waiting:
        async def read():
            return await asyncio.gather(*(dataset.read(indices[pos]) for pos in waiting), return_exceptions=True)

        for pos, raw in zip(waiting, asyncio.run(read())):
            raws[pos] = raw
    for pos, raw in enumerate(raws):
        if isinstance(raw, BaseException):
            if not isinstance(raw, Exception):
                raise raw
            errors.append(TaskError(pos, indices[pos], "read", pack_exception(raw)))
            raws[pos] = _FAILED
            if not skip:
                return [_FAILED] * len(raws)
    return raws


class _Array:
    """A tensor on its way back: a numpy array (out-of-band buffers with pickle protocol 5)."""

    __slots__ = ("array", "dtype")

    def __init__(self, tensor: torch.Tensor):
        t = tensor.detach().contiguous()
        self.dtype = t.dtype
        # numpy has no bfloat16: such a tensor travels as its bytes
        self.array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

    def tensor(self) -> torch.Tensor:
        t = torch.from_numpy(self.array if self.array.flags.writeable else self.array.copy())
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def __getstate__(self):
        return self.array, self.dtype

    def __setstate__(self, state):
        self.array, self.dtype = state


def _outward(value):
    return map_tensors(_Array, value)


def inward(value):
    """A batch as it came back: its arrays made tensors again (no copy), containers kept."""
    return map_leaves(_tensor_of, value)


def _tensor_of(leaf):
    return leaf.tensor() if isinstance(leaf, _Array) else leaf


def batch_bytes(value) -> int:
    """The bytes of a batch's tensors (what crossed the network)."""
    return sum(t.numel() * t.element_size() for t in leaves(value) if isinstance(t, torch.Tensor))


# -- on the trainer -----------------------------------------------------------------------------
def check_executor(executor, dataset, seed) -> None:
    if not isinstance(executor, concurrent.futures.Executor):
        raise TypeError(f"executor must be a concurrent.futures.Executor (a ProcessPoolExecutor, a "
                        f"ThreadPoolExecutor, Dask's client.get_executor(), ...), got {type(executor).__name__}")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError("executor= loads batches of a map-style dataset by their indices; an IterableDataset "
                         "has none: use the built-in workers (executor=None)")
    if seed is not None and isinstance(executor, concurrent.futures.ThreadPoolExecutor):
        raise ValueError("seed= seeds each sample's random draws through torch's, random's and numpy's global "
                         "generators, which threads share with each other and with the training loop: seeded "
                         "batches need processes (a ProcessPoolExecutor, a cluster's executor, or the built-in "
                         "workers); with a ThreadPoolExecutor leave seed=None")


def default_in_flight(executor) -> int:
    """Tasks in flight when ``num_workers=0``: the executor's own parallelism where it says."""
    client = getattr(executor, "_client", None)
    if client is not None:
        try:
            return max(1, sum(client.nthreads().values()))
        except Exception:  # noqa: BLE001 - a cluster that cannot be asked yet
            return 4
    return max(1, int(getattr(executor, "_max_workers", 0) or os.cpu_count() or 1))


def where_is(executor) -> str:
    """The executor in words, with the scheduler's address for a Dask cluster."""
    client = getattr(executor, "_client", None)
    if client is not None:
        address = getattr(getattr(client, "scheduler", None), "address", None)
        return f"the Dask cluster at {address}" if address else "the Dask cluster"
    return type(executor).__name__


class ExecutorStage:
    """The decode stage of a loader with ``executor=``; lives as long as the loader."""

    def __init__(self, executor, dataset, collate_fn, split: bool, read_here: bool):
        self.executor = executor
        self.where = where_is(executor)  # said now: a cluster that is gone cannot say its address
        self.token = uuid.uuid4().hex
        self.split = split
        self.read_here = read_here
        self.threads = isinstance(executor, concurrent.futures.ThreadPoolExecutor)
        self._local = (dataset, collate_fn or default_collate, split) if self.threads else None
        self._blob: bytes | None = None
        self._dataset, self._collate = dataset, collate_fn or default_collate
        self.outstanding: dict[concurrent.futures.Future, list] = {}
        self.round_trips: collections.deque = collections.deque(maxlen=1000)
        self.bytes_received = 0
        self.batches = 0

    def blob(self) -> bytes:
        if self._blob is None:
            self._blob = pickle.dumps((self._dataset, self._collate, self.split), protocol=pickle.HIGHEST_PROTOCOL)
        return self._blob

    def epoch(self, reads, stats, budget, deliver: Callable, *, base_seed: int, pin: bool) -> "ExecutorEpoch":
        """This stage's part in one epoch (see :class:`ExecutorEpoch`)."""
        return ExecutorEpoch(self, reads, stats, budget, deliver, base_seed=base_seed, pin=pin)

    def figures(self) -> dict:
        """This stage's part of ``loader.stats()``."""
        trips = sorted(self.round_trips)

        def pct(q: float) -> float:
            return trips[min(len(trips) - 1, max(0, int(q * len(trips) + 0.999) - 1))] * 1e3 if trips else 0.0

        return dict(executor=self.where, executor_tasks=self.batches, executor_bytes=self.bytes_received,
                    task_p50_ms=pct(0.5), task_p99_ms=pct(0.99))

    async def run(self, job: Job, indices: list):
        """Send ``job``; its result, sending it again with the dataset where a process lacks
        it, and again (a bounded number of times) where a process died under it."""
        blob, deaths = None, 0
        while True:
            started = time.perf_counter()
            try:
                result = await self._submit(job, blob, indices)
            except Exception as exc:
                if not _died(exc):
                    raise
                deaths += 1
                if deaths > RETRIES or isinstance(exc, concurrent.futures.BrokenExecutor):
                    raise ExecutorWorkerLost(self.executor, indices, deaths, exc, self.where) from exc
                continue
            if isinstance(result, str) and result == NEED_DATASET:
                blob = self.blob()
                continue
            self.round_trips.append(time.perf_counter() - started)
            return result

    async def _submit(self, job: Job, blob, indices: list):
        kwargs: dict[str, Any] = {"nonce": uuid.uuid4().hex}  # never two equal tasks (Dask dedups them)
        if self.threads:
            kwargs["local"] = self._local
        elif blob is not None:
            kwargs["blob"] = blob
        try:
            future = self.executor.submit(run_job, job, **kwargs)
        except RuntimeError as exc:  # shut down, or a cluster that is gone
            raise ExecutorWorkerLost(f"{self.where} refused the task for dataset indices {indices}: "
                                     f"{exc}") from exc
        self.outstanding[future] = indices
        # Not asyncio.wrap_future: the two futures it chains refer to each other, so a finished
        # task's result (a key a Dask cluster keeps while its future lives) waited for the
        # garbage collector. Here nothing outlives this call.
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        future.add_done_callback(functools.partial(_wake, loop, done))
        try:
            await done
            return future.result()
        except asyncio.CancelledError:  # the epoch is stopping
            future.cancel()
            raise
        except concurrent.futures.CancelledError:  # the executor gave up on it (a lost scheduler)
            raise ExecutorWorkerLost(f"{self.where} cancelled the task for dataset indices {indices} (is its "
                                     "scheduler still running?)") from None
        finally:
            self.outstanding.pop(future, None)

    def cancel_all(self) -> None:
        for future in list(self.outstanding):
            future.cancel()

    def close(self) -> None:
        """Cancel what is still queued and drop the dataset where it can be reached."""
        self.cancel_all()
        if self.threads:
            forget(self.token)
            return
        client = getattr(self.executor, "_client", None)
        if client is not None:
            try:
                client.run(forget, self.token)
            except Exception:  # noqa: BLE001 - a cluster already gone holds nothing of ours
                pass
        elif isinstance(self.executor, concurrent.futures.ProcessPoolExecutor):
            # A process pool cannot be asked to run something in each of its processes: one
            # task per process, not waited for, reaches most of them; the rest keep the dataset
            # until KEEP_DATASETS later loaders push it out.
            for _ in range(int(getattr(self.executor, "_max_workers", 1) or 1)):
                try:
                    self.executor.submit(forget, self.token)
                except RuntimeError:  # the pool is shut down: its processes are gone
                    break


class ExecutorEpoch:
    """One epoch's decode stage with ``executor=``: a task per batch to the loader's
    :class:`ExecutorStage`. Given: ``reads`` (the epoch's :class:`~aioload._engine.reads.ReadStage`:
    a batch's indices, the reads done on the trainer, and where each sample is for the stuck
    report), ``stats``, the error ``budget``, ``deliver`` (a finished batch to the
    :class:`~aioload._engine.spec.Ready` the queue gets), the epoch's ``base_seed``, and ``pin``:
    page-lock each batch (a device copy follows)."""

    def __init__(self, stage: ExecutorStage, reads, stats, budget, deliver: Callable, *, base_seed: int,
                 pin: bool):
        self.stage = stage
        self.reads = reads
        self.stats = stats
        self.budget = budget
        self.deliver = deliver
        self.base_seed = base_seed
        self.pin = pin

    async def make(self, seq: int, indices):
        """Batch ``seq``, made by the executor and delivered like any other."""
        from aioload._handoff.device import pin_batch
        from aioload._engine.ready import SKIP

        stage, reads = self.stage, self.reads
        batch_indices = reads.batch_indices(indices)
        if stage.split and not stage.read_here:
            items = await reads.items(batch_indices)  # the trainer reads; the bytes go along
        else:
            items = [(index, None) for index in batch_indices]
        if not items:
            return SKIP
        # A process seeds each sample's draws from (epoch seed, index), as the built-in workers do
        # with seed=; threads share the trainer's generators, which must not be reseeded.
        job = Job(stage.token, items, stage.split and stage.read_here, self.base_seed, not stage.threads,
                  self.budget.skip, not stage.threads)
        where = reads.inflight.samples
        where.update((index, stage.where) for index, _ in items)
        try:
            result = await stage.run(job, batch_indices)
        finally:
            for index, _ in items:
                where.pop(index, None)
        self.stats.decoded_batch(result.samples, result.seconds, result.cpu_s)
        if result.errors:
            self._failed(sorted(result.errors, key=lambda e: e.pos))
        if result.batch is None:
            return SKIP
        batch = inward(result.batch)
        stage.bytes_received += batch_bytes(batch)
        stage.batches += 1
        if self.pin:
            batch = pin_batch(batch)  # a side-stream copy from page-locked memory overlaps
        return self.deliver(batch, result.samples)

    def _failed(self, errors: list[TaskError]) -> None:
        """Raise the batch's first failure (``on_error="raise"``), or record each one skipped."""
        from aioload._errors import unpack_exception

        for error in errors:
            index, stage = error.index, error.stage
            if isinstance(index, list):
                place = f"while running {stage} for the batch of dataset indices {index}"
            else:
                place = f"while running {stage} for dataset index {index}{self.reads.where(index)}"
            exc = unpack_exception(error.packed, f"{place} on {self.stage.where}")
            self.budget.failed(index if isinstance(index, list) else [index], exc)


def _wake(loop: asyncio.AbstractEventLoop, done: asyncio.Future, _future) -> None:
    """A task finished (in the executor's thread): wake its waiter on the engine's loop."""
    try:
        loop.call_soon_threadsafe(_settle, done)
    except RuntimeError:
        pass  # the epoch's loop is gone: nobody waits any more


def _settle(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)


def _died(exc: BaseException) -> bool:
    """Whether ``exc`` says the process running the task died (not that the task failed)."""
    if isinstance(exc, concurrent.futures.BrokenExecutor):
        return True
    return type(exc).__name__ in ("KilledWorker", "WorkerLostError", "CommClosedError")


class ExecutorWorkerLost(RuntimeError):
    """The executor's process running a batch died, and sending it again did not help."""

    def __init__(self, executor, indices=None, attempts: int = 0, cause: BaseException | None = None,
                 where: str = ""):
        if not isinstance(executor, str):
            tried = f"tried {attempts} time{'s' if attempts != 1 else ''}"
            message = (f"a process of {where or where_is(executor)} died while loading dataset indices {indices} "
                       f"({tried}; {type(cause).__name__}: {cause}); check the executor's workers (memory, "
                       "crashes) and their logs")
        else:
            message = executor
        super().__init__(message)
