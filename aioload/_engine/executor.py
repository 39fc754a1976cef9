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
import contextlib
import functools
import os
import pickle
import struct
import sys
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple

import torch
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data._utils.collate import default_collate

from aioload._errors import BlockingReadWarning, SKIP_HINT, pack_exception, unpack_exception
from aioload._reads import BatchReads, FailedRead, StallMeter, stall_message
from aioload._workers.messages import TaskError
from aioload._seeding import sample_seed, seed_everything, seed_worker
from aioload._handoff.tree import leaves, map_leaves, map_tensors

RETRIES = 2
"""How many times a batch whose executor process died is sent again before the loader raises."""

KEEP_DATASETS = 4
"""Datasets an executor process keeps (one per loader that used it; least recently used dropped)."""

FORGET_TIMEOUT = 5.0
"""How long ``close()`` waits for every process of a ``ProcessPoolExecutor`` to drop the
loader's dataset (a process busy with other work for longer keeps it, see :func:`forget_in_pool`)."""

FORGET_HOLD = 0.05
"""Seconds a removal task keeps its process busy, so that the others go to other processes."""

NEED_DATASET = "aioload: this process has not been sent the loader's dataset yet"
"""What a task answers in a process that does not know its loader, with the process's pid (a
value, not an exception: an executor logs failed tasks)."""


# -- in the executor's process ------------------------------------------------------------------
class _Generators:
    """The process-wide generators (torch's default one, ``random``'s, numpy's): a task that
    seeds them per sample (``seed=``) has them to itself, ``exclusive``, from its first seed to
    its batch's collation; other tasks draw from them ``shared``, never beside a seeded one.
    With one thread per process (a process pool, ``dask worker --nthreads 1``) it never waits;
    a Dask worker with several threads runs its seeded tasks one at a time."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()


_GENERATORS = _Generators()


class _ThreadRandom:
    """Python's ``random`` module, one generator per thread during seeded tasks.

    A Dask worker draws from ``random``'s global generator itself, on its event loop, beside
    the tasks: ``dask.sizeof`` estimates the size of every message it sends (heartbeats, task
    results) with ``random.sample``. No lock keeps that out of a seeded sample's draws. So in
    a process with threads of its own, the module's functions (``random.random``,
    ``random.choice``, ... those of its global instance) are replaced once by functions that
    use this thread's generator while it runs a seeded task, and the global one otherwise:
    Dask's draws never touch a sample's. Code that imported a function by name earlier
    (``from random import random``) keeps the global generator, seeded per sample as before."""

    NAMES = ("seed", "random", "uniform", "triangular", "randint", "choice", "randrange", "sample", "shuffle",
             "choices", "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate",
             "gauss", "betavariate", "paretovariate", "weibullvariate", "getstate", "setstate", "getrandbits",
             "randbytes", "binomialvariate")

    def __init__(self):
        self.local = threading.local()
        self.installed = False

    def install(self) -> None:
        import random

        if self.installed:
            return
        self.installed = True
        inst = random._inst
        for name in self.NAMES:
            if getattr(getattr(random, name, None), "__self__", None) is inst:
                setattr(random, name, self._dispatcher(name, inst))

    def _dispatcher(self, name: str, inst):
        local = self.local

        def dispatch(*args, **kwargs):
            rng = getattr(local, "rng", None)
            return getattr(inst if rng is None else rng, name)(*args, **kwargs)

        dispatch.__name__ = dispatch.__qualname__ = name
        dispatch.__doc__ = getattr(inst, name).__doc__
        return dispatch

    @contextlib.contextmanager
    def own(self):
        """This thread draws from a generator of its own inside the block."""
        import random

        local = self.local
        mine = getattr(local, "mine", None)
        if mine is None:
            mine = local.mine = random.Random()
        local.rng = mine
        try:
            yield
        finally:
            local.rng = None


_RANDOM = _ThreadRandom()


def _seed_sample(seed: int) -> None:
    """Seed one sample's draws, as a built-in worker does (and the global ``random`` too, for
    code that holds its functions since before :class:`_ThreadRandom` replaced them)."""
    seed_everything(seed)
    if _RANDOM.installed:
        import random

        random._inst.seed(seed)


def _fresh_after_fork() -> None:
    global _GENERATORS, _known_lock
    _GENERATORS = _Generators()  # a thread of the parent may have held it at the fork
    _known_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_after_fork)


class _Known(NamedTuple):
    """A loader's dataset as this process keeps it."""

    dataset: Any
    collate: Callable
    split: bool
    info: Any  # torch's WorkerInfo for this process (None in a thread pool: the trainer's own process)
    meter: StallMeter  # this process's reads of it, timed (see aioload._reads)


class _InitFailed(Exception):
    def __init__(self, packed: bytes):
        super().__init__("worker_init_fn failed")
        self.packed = packed


_known: collections.OrderedDict[str, _Known] = collections.OrderedDict()
_forgotten: collections.deque = collections.deque(maxlen=256)  # closed loaders: never kept again
_known_lock = threading.Lock()
_init_failures: dict[str, bytes] = {}  # token -> what its worker_init_fn raised here
_trainers: set[int] = set()  # the pids of processes that made loaders (tasks must not reseed them)


def install(token: str, blob: bytes, init: tuple | None) -> _Known | None:
    """Unpickle a loader's dataset into this process (``None`` if that loader was closed):
    torch's ``WorkerInfo`` for this process is made from ``init`` (``(worker id, number of
    processes, base seed)``), the generators are seeded as torch seeds a worker, and the
    loader's ``worker_init_fn`` runs, once. Raises :class:`_InitFailed` if it fails."""
    with _known_lock:
        if token in _forgotten:
            return None
        found = _known.get(token)
        if found is not None:
            return found
    dataset, collate, split, init_fn = pickle.loads(blob)
    info = None
    if init is not None:
        wid, processes, base_seed = init
        info = torch_worker.WorkerInfo(id=wid, num_workers=max(processes, wid + 1), seed=base_seed + wid,
                                       dataset=dataset)
        with _GENERATORS.exclusive():
            torch_worker._worker_info = info
            seed_worker(base_seed, wid)
            if init_fn is not None:
                try:
                    init_fn(wid)
                except Exception as exc:  # noqa: BLE001 - the epoch's error, on the trainer
                    raise _InitFailed(pack_exception(exc)) from None
    return _keep(token, _Known(dataset, collate, split, info, StallMeter()))


def _keep(token: str, known: _Known) -> _Known | None:
    with _known_lock:
        if token in _forgotten:
            return None
        found = _known.setdefault(token, known)  # another thread may have installed it meanwhile
        _known.move_to_end(token)
        while len(_known) > KEEP_DATASETS:
            _known.popitem(last=False)
        return found


def _dataset_for(token: str, blob: bytes | None, local: tuple | None, init: tuple | None) -> _Known | None:
    with _known_lock:
        found = _known.get(token)
        if found is not None:
            _known.move_to_end(token)
            return found
        if token in _forgotten:  # a task of a closed loader, still running when it closed
            return None
    if local is not None:
        return _keep(token, _Known(*local, None, StallMeter()))
    if blob is not None:
        return install(token, blob, init)
    return None


def remember_init_failure(token: str, packed: bytes) -> None:
    """``worker_init_fn`` failed installing ``token``'s dataset (a Dask plugin's set-up): every
    task of that loader here reports it."""
    with _known_lock:
        _init_failures[token] = packed


def forget(token: str) -> bool:
    """Drop a loader's dataset from this process; whether it was there."""
    with _known_lock:
        if token not in _forgotten:
            _forgotten.append(token)
        _init_failures.pop(token, None)
        return _known.pop(token, None) is not None


def forget_and_hold(token: str, hold: float) -> int:
    """:func:`forget`, then keep this process busy ``hold`` seconds; its pid."""
    forget(token)
    time.sleep(hold)
    return os.getpid()


def known_tokens() -> list[str]:
    """The loaders whose datasets this process holds (for tests and diagnostics)."""
    with _known_lock:
        return list(_known)


class Job:
    """One batch's work, as sent to the executor (small: indices, raw items, seeds, limits)."""

    __slots__ = ("token", "items", "read_here", "base_seed", "per_sample", "skip", "to_numpy", "auto_collation",
                 "read_timeout", "io_limit", "where")

    def __init__(self, token: str, items: list, read_here: bool, base_seed: int, per_sample: bool, skip: bool,
                 to_numpy: bool, auto_collation: bool = True, read_timeout: float | None = None, io_limit: int = 64,
                 where: str = "the executor"):
        self.token, self.items, self.read_here = token, items, read_here
        self.base_seed, self.per_sample, self.skip, self.to_numpy = base_seed, per_sample, skip, to_numpy
        self.auto_collation, self.read_timeout, self.io_limit, self.where = auto_collation, read_timeout, io_limit, where

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state):
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


class JobResult:
    """What a :class:`Job` sends back from the executor's process.

    Not a tuple: Dask sizes every result it keeps, and ``dask.sizeof`` estimates a list or a
    tuple of more than 10 items by ``random.sample`` -- from Python's global generator, on the
    worker's event loop, while a seeded task of the same process may be drawing from it. An
    object with its own ``__sizeof__`` is sized without a draw, and by its real bytes."""

    __slots__ = ("batch", "errors", "samples", "seconds", "cpu_s", "reads")

    def __init__(self, batch: Any, errors: list, samples: int, seconds: float, cpu_s: float,
                 reads: tuple | None = None):
        self.batch = batch  # the collated batch, tensors as numpy arrays (see _Array); None when it failed
        self.errors = errors  # TaskError, as the built-in workers report them
        self.samples = samples  # the samples the batch holds
        self.seconds = seconds  # wall time of the task
        self.cpu_s = cpu_s  # CPU seconds of the thread that ran it
        # Reads done by the task: (latencies in seconds, bytes, an aioload._reads.Stall the first
        # time this process's reads of the dataset were found blocking their loop, else None).
        self.reads = reads

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state):
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)

    def __sizeof__(self) -> int:
        arrays = [leaf.array.nbytes for leaf in leaves(self.batch) if isinstance(leaf, _Array)]
        return object.__sizeof__(self) + sum(arrays)


_SHARED_HEADER = struct.Struct("<32sqq")  # token, processes that took it so far, the pickle's bytes


class SharedDataset:
    """A loader's pickled dataset in anonymous shared memory (a memfd) of the training process,
    for the processes of a local ``ProcessPoolExecutor``: each opens it by its
    ``/proc/<pid>/fd/<n>`` path and reads it once, when its first task of the loader arrives --
    no message carries it, no process waits for another's copy, and nothing is left behind (the
    memory goes with the descriptor, or with the process). A header holds the token (a path
    read after the loader closed, its descriptor number reused, is not taken for it) and counts
    the processes that took it, which numbers them for ``get_worker_info().id``."""

    def __init__(self, token: str, blob: bytes):
        self.fd = os.memfd_create("aioload-dataset", os.MFD_CLOEXEC)
        try:
            os.write(self.fd, _SHARED_HEADER.pack(token.encode("ascii"), 0, len(blob)))
            view = memoryview(blob)
            while view:
                view = view[os.write(self.fd, view):]
        except BaseException:
            os.close(self.fd)
            raise
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @staticmethod
    def take(path: str, token: str) -> tuple[bytes, int] | None:
        """In an executor process: the pickle and this process's number, or ``None`` (gone)."""
        import fcntl

        try:
            with open(path, "r+b", buffering=0) as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                head = f.read(_SHARED_HEADER.size)
                if len(head) != _SHARED_HEADER.size:
                    return None
                found, taken, size = _SHARED_HEADER.unpack(head)
                if found != token.encode("ascii"):
                    return None
                os.pwrite(f.fileno(), _SHARED_HEADER.pack(found, taken + 1, size), 0)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                blob = os.pread(f.fileno(), size, _SHARED_HEADER.size)
        except OSError:
            return None
        return (blob, taken) if len(blob) == size else None


def run_job(job: Job, blob: bytes | None = None, local: tuple | None = None, nonce: str = "",
            init: tuple | None = None, shared: tuple | None = None):
    """Load one batch in an executor process: a :class:`JobResult` (``(NEED_DATASET, pid)``
    when this process lacks the loader's dataset and cannot take it from ``shared``, a
    :class:`SharedDataset`'s ``(path, processes)``). With ``on_error="raise"`` the first failure
    ends the task."""
    started, cpu_started = time.perf_counter(), time.thread_time()
    if job.per_sample and os.getpid() in _trainers:
        return _failure(job, "seed", ValueError(
            f"seed= seeds each sample's draws through the process's global generators, and {job.where} runs "
            "its tasks inside the training process (a Dask LocalCluster(processes=False)?), whose generators "
            "belong to the training loop: run its workers as processes of their own, or leave seed=None"))
    try:
        known = _dataset_for(job.token, blob, local, init)
        if known is None and shared is not None and job.token not in _init_failures:
            taken = SharedDataset.take(shared[0], job.token)
            if taken is not None:
                known = install(job.token, taken[0], (taken[1], shared[1], job.base_seed))
    except _InitFailed as failed:
        remember_init_failure(job.token, failed.packed)
        known = None
    failed_init = _init_failures.get(job.token)
    if failed_init is not None:
        return JobResult(None, [TaskError(0, None, "worker_init_fn", failed_init)], 0, 0.0, 0.0)
    if known is None:
        return NEED_DATASET, os.getpid()
    dataset, collate, split, info, meter = known
    items = job.items
    errors: list = []
    raws: list = [raw for _, raw in items]
    reads = None
    if split and job.read_here:
        raws, reads = _read_all(job, dataset, meter, [index for index, _ in items], errors)
    own_random = contextlib.nullcontext()
    if job.per_sample and threading.active_count() > 1:  # a Dask worker: its event loop draws too
        _RANDOM.install()
        own_random = _RANDOM.own()
    with _GENERATORS.exclusive() if job.per_sample else _GENERATORS.shared(), own_random:
        if info is not None:
            torch_worker._worker_info = info  # get_worker_info() in the dataset's code
        samples, batch = _load(job, dataset, collate, split, items, raws, errors)
    if batch is not None and job.to_numpy:
        batch = _outward(batch)
        unpicklable = _pickle_error(batch)
        if unpicklable is not None:
            errors.append(TaskError(0, [index for index, _ in items], "pickle", pack_exception(
                _cannot_return(job, [index for index, _ in items], unpicklable))))
            batch = None
    return JobResult(batch, errors, len(samples), time.perf_counter() - started, time.thread_time() - cpu_started,
                     reads)


def _load(job: Job, dataset, collate, split: bool, items: list, raws: list, errors: list) -> tuple[list, Any]:
    """The batch's samples decoded (each seeded first with ``seed=``), and collated as torch
    collates them; failures into ``errors``."""
    samples = []
    for pos, ((index, _), raw) in enumerate(zip(items, raws)):
        if raw is _FAILED:
            continue
        if job.per_sample:
            _seed_sample(sample_seed(job.base_seed, index))
        try:
            samples.append(dataset.decode(raw) if split else dataset[index])
        except Exception as exc:  # noqa: BLE001 - reported with the sample's index
            errors.append(TaskError(pos, index, "decode" if split else "__getitem__", pack_exception(exc)))
            if not job.skip:
                break
    batch = None
    if samples and not (errors and not job.skip):
        try:
            # batch_size=None: the sampler's one item is one sample, converted as torch does
            batch = collate(samples) if job.auto_collation else collate(samples[0])
        except Exception as exc:  # noqa: BLE001 - the batch's error
            errors.append(TaskError(0, [index for index, _ in items], "collate_fn", pack_exception(exc)))
    return samples, batch


def _failure(job: Job, stage: str, exc: Exception) -> JobResult:
    return JobResult(None, [TaskError(0, None, stage, pack_exception(exc))], 0, 0.0, 0.0)


_FAILED = object()


def _read_all(job: Job, dataset, meter: StallMeter, indices: list, errors: list) -> tuple[list, tuple]:
    """Every index's raw item, read here through the read core (``read_nowait`` first, at most
    ``job.io_limit`` reads in flight on one event loop, each within ``read_timeout``); a
    failed read is an error of stage ``read`` (and, with ``on_error="raise"``, fails the task)."""

    async def read() -> tuple:
        core = BatchReads(dataset, bound=asyncio.Semaphore(max(1, job.io_limit)), read_timeout=job.read_timeout,
                          place=f" on {job.where}", meter=meter)
        return await core.read(indices)

    raws, latencies, nbytes = asyncio.run(read())
    out = list(raws)
    for pos, raw in enumerate(raws):
        if isinstance(raw, FailedRead):
            errors.append(TaskError(pos, indices[pos], "read", pack_exception(raw.error)))
            out[pos] = _FAILED
            if not job.skip:
                out = [_FAILED] * len(raws)
                break
    return out, (latencies, nbytes, meter.take())


def _pickle_error(batch) -> Exception | None:
    """Why ``batch`` cannot be pickled back to the trainer (``None``: it can). Its arrays'
    buffers are left out of the trial (protocol 5, out of band): only the structure is pickled.
    A Dask worker pickles what plain pickle refuses with cloudpickle, and so does the trial."""
    try:
        pickle.dumps(batch, protocol=5, buffer_callback=_out_of_band)
        return None
    except Exception as exc:  # noqa: BLE001 - whatever pickling raised is the answer
        error = exc
    cloudpickle = sys.modules.get("cloudpickle") if _on_dask() else None
    if cloudpickle is not None:
        try:
            cloudpickle.dumps(batch, protocol=5, buffer_callback=_out_of_band)
            return None
        except Exception as exc:  # noqa: BLE001
            error = exc
    return error


def _on_dask() -> bool:
    """Whether this task runs on a Dask worker (which pickles results with cloudpickle too)."""
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return False
    try:
        distributed.get_worker()
    except ValueError:
        return False
    return True


def _out_of_band(buffer) -> bool:
    return False


def _cannot_return(job: Job, indices: list, error: Exception) -> TypeError:
    exc = TypeError(
        f"the batch of dataset indices {indices} cannot be pickled to travel back from {job.where} to the "
        f"training process ({type(error).__name__}: {error}); decode() (or __getitem__) and collate_fn must "
        "return tensors, arrays, numbers, strings, or lists, tuples and dicts of them, and no objects of "
        "classes defined inside a function, locks, files or clients")
    exc.__cause__ = error
    return exc


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
        _trainers.add(os.getpid())
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
            try:
                if plugin is not None:
                    self.client.unregister_worker_plugin(plugin)  # its teardown forgets, on every worker
                self.client.run(forget, token)
            except Exception:  # noqa: BLE001 - a cluster already gone holds nothing of ours
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

        stage, reads = self.stage, self.reads
        spec = reads.spec
        batch_indices = reads.batch_indices(indices)
        if stage.split and not stage.read_here:
            items = await reads.items(batch_indices)  # the trainer reads; the bytes go along
        else:
            items = [(index, None) for index in batch_indices]
        if not items:
            return SKIP
        await stage.prepare(self.base_seed)
        # A process seeds each sample's draws from (epoch seed, index), as the built-in workers do
        # with seed=; threads share the trainer's generators, which must not be reseeded.
        job = Job(stage.token, items, stage.split and stage.read_here, self.base_seed, not stage.threads,
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
