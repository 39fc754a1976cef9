"""What runs in an executor's process for ``executor=``: one batch's task, and what the process
keeps between tasks.

:func:`run_job` loads one batch: the loader's dataset (kept per loader, by token: installed
once from a Dask plugin, the trainer's shared memory or a task that carries it, see
:func:`install`), its reads through the read core (:mod:`aioload._data.reads`), each sample seeded
and decoded, the batch collated and its tensors turned into numpy arrays to travel back
(:class:`_Array`) after a trial pickle. With ``seed=`` a task holds the process-wide generators
alone (:class:`_Generators`) and, in a process with threads of its own, draws from a ``random``
generator of its thread's (:class:`_ThreadRandom`). The trainer's side is
:mod:`aioload._engine.executor`; this module imports nothing of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pickle
import struct
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.utils.data._utils.worker as torch_worker

from aioload._base.errors import pack_exception
from aioload._data.reads import BatchReads, FailedRead, StallMeter
from aioload._workers.messages import TaskError
from aioload._base.seeding import sample_seed, seed_everything, seed_worker
from aioload._handoff.tree import leaves, map_leaves, map_tensors

KEEP_DATASETS = 4
"""Datasets an executor process keeps (one per loader that used it; least recently used dropped)."""

FORGET_HOLD = 0.05
"""Seconds a removal task keeps its process busy, so that the others go to other processes."""

NEED_DATASET = "aioload: this process has not been sent the loader's dataset yet"
"""What a task answers in a process that does not know its loader, with the process's pid (a
value, not an exception: an executor logs failed tasks)."""


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
    meter: StallMeter  # this process's reads of it, timed (see aioload._data.reads)


class _InitFailed(Exception):
    def __init__(self, packed: bytes):
        super().__init__("worker_init_fn failed")
        self.packed = packed


_known: collections.OrderedDict[str, _Known] = collections.OrderedDict()
_forgotten: collections.deque = collections.deque(maxlen=256)  # closed loaders: never kept again
_known_lock = threading.Lock()
_init_failures: dict[str, bytes] = {}  # token -> what its worker_init_fn raised here
TRAINERS: set[int] = set()  # the pids of processes that made loaders (tasks must not reseed them)


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
            _let_go(_known.popitem(last=False)[1])
        return found


def _let_go(known: _Known) -> None:
    """Nothing of this process keeps ``known``'s dataset once it is dropped: torch's
    ``WorkerInfo`` of the last task that ran here (``get_worker_info()``) names the dataset of
    its loader, and would hold it until another loader's task came (for ever, after the last)."""
    info = torch_worker._worker_info
    if info is not None and known.info is not None and info is known.info:
        torch_worker._worker_info = None


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
        known = _known.pop(token, None)
        if known is None:
            return False
        _let_go(known)
    return True


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
        # Reads done by the task: (latencies in seconds, bytes, an aioload._data.reads.Stall the first
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
                _drop_inherited(path, os.fstat(f.fileno()))
        except OSError:
            return None
        return (blob, taken) if len(blob) == size else None


def _drop_inherited(path: str, memory: os.stat_result) -> None:
    """A process forked from the trainer after it made the shared copy holds its descriptor
    too, which would keep the memory after the loader closes: close that copy once it is read."""
    number = int(path.rsplit("/", 1)[1])
    try:
        held = os.fstat(number)
    except OSError:
        return  # not inherited
    if (held.st_ino, held.st_dev) == (memory.st_ino, memory.st_dev):
        os.close(number)


def run_job(job: Job, blob: bytes | None = None, local: tuple | None = None, nonce: str = "",
            init: tuple | None = None, shared: tuple | None = None):
    """Load one batch in an executor process: a :class:`JobResult` (``(NEED_DATASET, pid)``
    when this process lacks the loader's dataset and cannot take it from ``shared``, a
    :class:`SharedDataset`'s ``(path, processes)``). With ``on_error="raise"`` the first failure
    ends the task."""
    started, cpu_started = time.perf_counter(), time.thread_time()
    if job.per_sample and os.getpid() in TRAINERS:
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
    if info is not None:
        torch_worker._worker_info = info  # get_worker_info() in the dataset's read, decode, __getitem__
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
            torch_worker._worker_info = info  # again: another loader's task may have set its own meanwhile
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
