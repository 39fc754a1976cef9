"""The decode stage on any ``concurrent.futures.Executor``: ``DataLoader(..., executor=EX)``.

One task per batch, never per sample. A task carries the batch's indices (and, for datasets
read on the trainer, their raw items); the executor's process reads what is remote itself,
decodes, collates, and sends back the batch, whose tensors travel as numpy arrays (pickle
protocol 5 buffers, which Dask and Ray carry out of band). The loader then treats the batch as
any other: pinned, copied to ``device=``, counted, ordered, resumable.

The dataset and ``collate_fn`` reach each executor process once (see :class:`ExecutorStage`),
which keeps them (a few loaders at most). A thread pool shares the trainer's objects and
pickles nothing. What runs in the executor's process is :mod:`aioload._engine.executor_process`.

What runs where:

* trainer, engine thread: the sampler, the permits (bounded work in flight), the order, and
  reads only for a dataset marked to read on the trainer (``read_on_executor=False``);
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
import time
import uuid
from typing import Any, Callable

import torch
from torch.utils.data._utils.collate import default_collate

from aioload._base.errors import BlockingReadWarning, SKIP_HINT, unpack_exception
from aioload._data.reads import stall_message
from aioload._workers.messages import TaskError
from aioload._engine.executor_process import (FORGET_HOLD, NEED_DATASET, Job, SharedDataset, TRAINERS, batch_bytes,
                                              forget, forget_and_hold, inward, run_job)
from aioload._engine.executor_process import KEEP_DATASETS, known_tokens  # noqa: F401 - named here in docs and tests

RETRIES = 2
"""How many times a batch whose executor process died is sent again before the loader raises."""

FORGET_TIMEOUT = 5.0
"""How long ``close()`` waits for every process of a ``ProcessPoolExecutor`` to drop the
loader's dataset (a process busy with other work for longer keeps it, see :func:`forget_in_pool`)."""


def check_executor(executor, dataset, seed, worker_init_fn=None) -> None:
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
    check_worker_init_fn(executor, worker_init_fn)


def check_worker_init_fn(executor, worker_init_fn) -> None:
    if worker_init_fn is not None and isinstance(executor, concurrent.futures.ThreadPoolExecutor):
        raise ValueError("worker_init_fn sets up a worker process, and a ThreadPoolExecutor runs its tasks in "
                         "the training process itself, which has no worker to set up: run that set-up before "
                         "making the loader, or use a ProcessPoolExecutor (it runs once in each of its processes)")


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


def _processes(executor) -> int:
    """How many processes the executor runs its tasks in (for ``WorkerInfo.num_workers``)."""
    client = getattr(executor, "_client", None)
    if client is not None:
        try:
            return max(1, len(client.nthreads()))
        except Exception:  # noqa: BLE001
            return 1
    return max(1, int(getattr(executor, "_max_workers", 0) or 1))


def forget_in_pool(pool: concurrent.futures.ProcessPoolExecutor, token: str, timeout: float = FORGET_TIMEOUT) -> set:
    """Drop ``token``'s dataset in every process of ``pool``; the pids that did.

    A process pool cannot be told to run something in each of its processes: a task goes to
    whichever process is free. So each removal task keeps its process busy a moment
    (:data:`FORGET_HOLD`), which sends the others to other processes, and removal tasks go
    again, one per process not reached yet, until every process the pool has (``_processes``)
    answered, or ``timeout`` seconds passed (a process busy with another loader's long task)."""
    deadline = time.monotonic() + timeout
    reached: set[int] = set()
    while True:
        missing = set(getattr(pool, "_processes", None) or ()) - reached
        left = deadline - time.monotonic()
        if not missing or left <= 0:
            return reached
        try:
            futures = [pool.submit(forget_and_hold, token, FORGET_HOLD) for _ in missing]
        except RuntimeError:  # shut down: its processes are gone, and the dataset with them
            return reached
        done, _ = concurrent.futures.wait(futures, timeout=left)
        for future in done:
            if not future.cancelled() and future.exception() is None:
                reached.add(future.result())


def _needs_dataset(result) -> bool:
    return isinstance(result, tuple) and len(result) == 2 and result[0] == NEED_DATASET


class ExecutorStage:
    """The decode stage of a loader with ``executor=``; lives as long as the loader.

    How the dataset reaches each process once: a thread pool shares the trainer's objects
    (nothing is pickled); a Dask cluster gets it as a worker plugin (:mod:`aioload._engine.daskplugin`),
    installed in every worker once, also in workers that join later; a local
    ``ProcessPoolExecutor``'s processes each read it once from shared memory (:class:`SharedDataset`).
    Any other executor (or a process that cannot open that memory) is sent a task with the
    loader's token alone, and a process that does not know it answers ``NEED_DATASET``: the
    task goes again with the pickled dataset -- one such send at a time, so that the tasks in
    flight do not each carry a copy."""

    def __init__(self, executor, dataset, collate_fn, split: bool, read_here: bool, worker_init_fn=None):
        self.executor = executor
        self.where = where_is(executor)  # said now: a cluster that is gone cannot say its address
        self.split = split
        self.read_here = read_here
        self.threads = isinstance(executor, concurrent.futures.ThreadPoolExecutor)
        self.client = getattr(executor, "_client", None)  # a Dask cluster's executor
        self._dataset = dataset
        self.outstanding: dict[concurrent.futures.Future, list] = {}
        self.round_trips: collections.deque = collections.deque(maxlen=1000)
        self.bytes_received = 0
        self.batches = 0
        self.dataset_sends = 0  # times the pickled dataset was sent (a plugin counts once)
        self.dataset_bytes = 0  # its bytes, each time
        TRAINERS.add(os.getpid())
        self._set(collate_fn, worker_init_fn)

    def _set(self, collate_fn, worker_init_fn) -> None:
        """A fresh token for the dataset with this ``collate_fn`` and ``worker_init_fn``."""
        self.token = uuid.uuid4().hex
        self.settings = (collate_fn, worker_init_fn)
        collate = collate_fn or default_collate
        self._local = (self._dataset, collate, self.split) if self.threads else None
        self._pickled = (self._dataset, collate, self.split, worker_init_fn)
        self._blob: bytes | None = None
        self._plugin: str | None = None  # the Dask plugin's name, once registered
        self._shared: SharedDataset | None = None  # a local process pool's copy (see prepare)
        self._sends_done = 0  # dataset sends finished (see _with_dataset)
        self._next_id = 0  # the WorkerInfo.id of the next process sent the dataset

    def configure(self, collate_fn, worker_init_fn, *, keep: bool) -> None:
        """The loader's ``collate_fn`` and ``worker_init_fn`` for the next epoch. Changed, they
        reach the executor's processes as a dataset of a new token (the old one is dropped
        there), unless ``keep``: persistent workers keep what they started with, as torch's do."""
        if (collate_fn, worker_init_fn) == self.settings or keep:
            return
        check_worker_init_fn(self.executor, worker_init_fn)
        old, plugin, shared = self.token, self._plugin, self._shared
        self._set(collate_fn, worker_init_fn)
        self._forget_remote(old, plugin)
        if shared is not None:
            shared.close()

    def blob(self) -> bytes:
        if self._blob is None:
            self._blob = pickle.dumps(self._pickled, protocol=pickle.HIGHEST_PROTOCOL)
        return self._blob

    def epoch(self, reads, stats, budget, deliver: Callable, *, base_seed: int, pin: bool) -> "ExecutorEpoch":
        """This stage's part in one epoch (see :class:`ExecutorEpoch`); on the epoch's loop."""
        self._sending = asyncio.Lock()  # one send of the dataset at a time (see _with_dataset)
        self._registering = asyncio.Lock()
        return ExecutorEpoch(self, reads, stats, budget, deliver, base_seed=base_seed, pin=pin)

    def figures(self) -> dict:
        """This stage's part of ``loader.stats()``."""
        trips = sorted(self.round_trips)

        def pct(q: float) -> float:
            return trips[min(len(trips) - 1, max(0, int(q * len(trips) + 0.999) - 1))] * 1e3 if trips else 0.0

        return dict(executor=self.where, executor_tasks=self.batches, executor_bytes=self.bytes_received,
                    task_p50_ms=pct(0.5), task_p99_ms=pct(0.99))

    async def prepare(self, base_seed: int) -> None:
        """Before a task is sent: on a Dask cluster, the dataset as a worker plugin; for a
        ``ProcessPoolExecutor`` (on Linux), the dataset in shared memory, taken by each of its
        processes once (:class:`SharedDataset`)."""
        if self._shared is None and isinstance(self.executor, concurrent.futures.ProcessPoolExecutor) \
                and hasattr(os, "memfd_create"):
            blob = self.blob()
            self._shared = SharedDataset(self.token, blob)
            self._blob = None  # the shared copy serves; a process that cannot open it gets a fresh pickle
            self.dataset_sends += 1
            self.dataset_bytes += len(blob)
        if self.client is None or self._plugin is not None:
            return
        async with self._registering:
            if self._plugin is None:
                await asyncio.to_thread(self._register, base_seed)

    def _register(self, base_seed: int) -> None:
        from aioload._engine.daskplugin import DatasetPlugin

        name = f"aioload-dataset-{self.token}"
        blob = self.blob()
        self.client.register_plugin(DatasetPlugin(self.token, blob, base_seed), name=name)
        self.dataset_sends += 1
        self.dataset_bytes += len(blob)
        self._plugin = name

    async def run(self, job: Job, indices: list):
        """Send ``job``; its result, sending it again with the dataset where a process lacks
        it, and again (a bounded number of times) where a process died under it."""
        deaths = 0
        seen: int | None = None  # dataset sends done when a process said it lacks the dataset
        while True:
            started = time.perf_counter()
            try:
                if seen is None:
                    result = await self._submit(job, indices)
                else:
                    result = await self._with_dataset(job, indices, seen)
            except Exception as exc:
                if not _died(exc):
                    raise
                deaths += 1
                if deaths > RETRIES or isinstance(exc, concurrent.futures.BrokenExecutor):
                    raise ExecutorWorkerLost(self.executor, indices, deaths, exc, self.where) from exc
                continue
            if _needs_dataset(result):
                seen = self._sends_done
                continue
            self.round_trips.append(time.perf_counter() - started)
            return result

    async def _with_dataset(self, job: Job, indices: list, seen: int):
        """``job`` sent to a process that lacked the dataset, with the dataset. One such send
        at a time: the tasks in flight all hear ``NEED_DATASET`` at first, and sending each of
        them with a copy sent the dataset once per task (16 times to a 2-process pool). A task
        whose turn comes after another send has finished goes once more without it (a process
        that has it may take it); each send is counted in ``dataset_sends``."""
        async with self._sending:
            if self._sends_done > seen:
                result = await self._submit(job, indices)
                if not _needs_dataset(result):
                    return result
            blob = self.blob()
            init = (self._next_id, _processes(self.executor), job.base_seed)
            self._next_id += 1
            self.dataset_sends += 1
            self.dataset_bytes += len(blob)
            try:
                result = await self._submit(job, indices, blob=blob, init=init)
            finally:
                self._sends_done += 1
        if _needs_dataset(result):
            raise ExecutorWorkerLost(f"a process of {self.where} would not keep the loader's dataset (sent with the "
                                     f"task for dataset indices {indices}): was the loader closed meanwhile?")
        return result

    async def _submit(self, job: Job, indices: list, blob: bytes | None = None, init: tuple | None = None):
        kwargs: dict[str, Any] = {"nonce": uuid.uuid4().hex}  # never two equal tasks (Dask dedups them)
        if self.threads:
            kwargs["local"] = self._local
        elif blob is not None:
            kwargs["blob"], kwargs["init"] = blob, init
        elif self._shared is not None:
            kwargs["shared"] = (self._shared.path, _processes(self.executor))
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

    def _forget_remote(self, token: str, plugin: str | None) -> None:
        """Drop ``token``'s dataset (and its Dask ``plugin``) wherever it can be reached."""
        if self.threads:
            forget(token)
            return
        if self.client is not None:
            if plugin is not None:
                try:
                    self.client.unregister_worker_plugin(plugin)  # its teardown forgets, on every worker
                except Exception:  # noqa: BLE001 - a cluster already gone holds nothing of ours
                    pass
            try:
                self.client.run(forget, token)  # also where a task carried it (a worker the plugin missed)
            except Exception:  # noqa: BLE001
                pass
        elif isinstance(self.executor, concurrent.futures.ProcessPoolExecutor):
            forget_in_pool(self.executor, token)

    def close(self) -> None:
        """Cancel what is still queued and drop the dataset where it can be reached."""
        self.cancel_all()
        self._forget_remote(self.token, self._plugin)
        self._plugin = None
        if self._shared is not None:
            self._shared.close()


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

        from aioload._engine.spec import Reads

        stage, reads = self.stage, self.reads
        spec = reads.spec
        batch_indices = spec.batch_indices(indices)
        if spec.reads is Reads.ENGINE:
            items = await reads.items(batch_indices)  # the trainer reads; the bytes go along
        else:
            items = [(index, None) for index in batch_indices]
        if not items:
            return SKIP
        await stage.prepare(self.base_seed)
        # A process seeds each sample's draws from (epoch seed, index), as the built-in workers do
        # with seed=; threads share the trainer's generators, which must not be reseeded.
        job = Job(stage.token, items, spec.reads is Reads.WORKERS, self.base_seed, not stage.threads,
                  self.budget.skip, not stage.threads, auto_collation=spec.auto_collation,
                  read_timeout=spec.read_timeout, io_limit=spec.io_concurrency, where=stage.where)
        where = reads.inflight.samples
        where.update((index, stage.where) for index, _ in items)
        try:
            result = await stage.run(job, batch_indices)
        except (ExecutorWorkerLost, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the task failed over there (its result did not come back)
            exc.add_note(f"while loading the batch of dataset indices {batch_indices} on {stage.where}")
            self.budget.failed(batch_indices, exc)
            return SKIP
        finally:
            for index, _ in items:
                where.pop(index, None)
        self.stats.decoded_batch(result.samples, result.seconds, result.cpu_s)
        if result.reads is not None:
            self._count_reads(*result.reads)
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

    def _count_reads(self, latencies: list, nbytes: int, stall) -> None:
        """The task's reads into the loader's statistics, as a worker's are."""
        self.stats.worker_reads(latencies, nbytes)
        if stall is not None:
            self.stats.read_stalled(BlockingReadWarning(stall_message(stall, self.reads.spec.dataset,
                                                                      f"on {self.stage.where}")))

    def _failed(self, errors: list[TaskError]) -> None:
        """Raise the batch's first failure (``on_error="raise"``), or record each one skipped;
        a failure that is no sample's (``worker_init_fn``) is raised whatever ``on_error``."""
        for error in errors:
            index, stage = error.index, error.stage
            where = self.stage.where
            if index is None:  # worker_init_fn failed, or the task would reseed the trainer's generators
                raise unpack_exception(error.packed, f"raised by {stage} in a process of {where}"
                                       if stage == "worker_init_fn" else None)
            if stage in ("read", "pickle"):
                place = None  # the error's own note (or message) says so
            elif isinstance(index, list):
                place = f"while running {stage} for the batch of dataset indices {index} on {where}"
            else:
                hint = "" if self.budget.skip or stage not in ("decode", "__getitem__") else SKIP_HINT
                place = f"while running {stage} for dataset index {index}{self.reads.where(index)} on {where}{hint}"
            exc = unpack_exception(error.packed, place)
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
