"""The worker pool: processes that decode, their sockets, and the dispatch of tasks to them.

The pool outlives epochs (workers are kept for the loader's lifetime); a :class:`PoolSession`
drives it from one epoch's event loop. Each worker has two Unix sockets: one carries tasks and
replies (length-prefixed pickles), the other carries shared-memory file descriptors: each
slot's, once, and those of the shared bytes a task's items view, just before that task
(:mod:`aioload._handoff.shared`).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import multiprocessing as mp
import multiprocessing.reduction
import os
import pickle
import select
import socket
import sys
import time
import warnings
import weakref

from aioload._workers import wire as _wire
from aioload._base.errors import WorkerCrashedError, crash_message, describe_exit, unpack_exception
from aioload._base.errors import UnpicklableError
from aioload._workers.messages import (CancelReads, Done, Fetched, FetchShard, InitError, ReportStreams, Shutdown,
                                      Stopped, Streams, Task, WorkerReady)
from aioload._handoff import shared as _shared
from aioload._handoff.shm import Segment, recv_fd, send_fd
from aioload._workers.template import ForkedWorker, Template, unavailable
from aioload._workers.worker import FORKED, PROGRESS_ID, SLOT_HEADER, WorkerConfig, worker_main

PER_WORKER_TASKS = 2
"""Tasks queued on one worker by default (torch's ``prefetch_factor``, which sets it): one
being decoded, one waiting, so that a worker never idles and, where the worker reads, the
reads of the next task overlap the decoding of this one."""


def choose_context(multiprocessing_context) -> mp.context.BaseContext:
    """The start method: the user's, else the platform's default, as torch's DataLoader does.

    A start method of aioload's own choosing would break programs that run with torch: spawn
    and forkserver workers import the main module again and need a picklable dataset,
    ``collate_fn`` and ``worker_init_fn`` (no lambdas, no classes defined in a function)."""
    if multiprocessing_context is None:
        return mp.get_context()
    if isinstance(multiprocessing_context, str):
        return mp.get_context(multiprocessing_context)
    return multiprocessing_context


_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
"""Every pool of this process: a worker forked for one pool closes the others' sockets too."""

FORK_START_S = 20.0
"""How long a forked worker may take to begin running (its :data:`~aioload._workers.worker.FORKED`
byte) before it is taken for stuck in the fork; a fork's child begins within milliseconds."""
FORK_TRIES = 3
"""Forks of one worker before the pool gives up on one that stays stuck in the fork."""


class WorkerPool:
    """``num_workers`` processes, each holding the dataset: forked from the training process
    (``fork``) or from a template that unpickled it once (``spawn``, ``forkserver``; see
    :mod:`aioload._workers.template`), they share its pages; else each has a copy of its own."""

    def __init__(self, cfg: WorkerConfig, num_workers: int, context):
        self.num_workers = num_workers
        self.context = context
        self.procs: list = []  # multiprocessing's processes, or ForkedWorker
        self.socks: list[socket.socket] = []
        self.ctrls: list[socket.socket] = []
        self.ready = [False] * num_workers
        self.broken: BaseException | None = None
        self.closed = False
        self.owner = os.getpid()  # a forked child holds a copy of this object: it must not stop our workers
        self.fetching = cfg.fetch_shards  # window mode's shards are fetched by the workers
        self.fetch_ids = itertools.count()  # over the pool's life: a late answer names no later fetch
        # the storages fetches were made with, kept for the pool's life: a worker keeps each one
        # under its id, which no other storage may take while the workers live
        self.fetch_storages: dict[int, object] = {}
        # Per worker: the task id and dataset index it is on (see _Worker.mark), in a memfd
        # that each worker receives first on its control socket (nothing in /dev/shm).
        self.progress_memory = Segment.create(16 * num_workers, "aioload-progress")
        self.progress = memoryview(self.progress_memory.map).cast("q")
        for cell in range(2 * num_workers):
            self.progress[cell] = -1
        method = context.get_start_method()
        self.forking = method == "fork"
        self.template: Template | None = None
        try:
            self.start_method = self._start_template(cfg, context, method)
            for wid in range(num_workers):
                proc, parent, cparent = self._start_worker(cfg, wid)
                self.procs.append(proc)
                self.socks.append(parent)
                self.ctrls.append(cparent)
            if self.forking:
                self._check_forked(cfg)
        except BaseException:
            self.close()
            raise
        _LIVE_POOLS.add(self)

    def _start_worker(self, cfg: WorkerConfig, wid: int):
        """Start worker ``wid``: ``(process, its task socket, its control socket)``."""
        parent, child = socket.socketpair()
        cparent, cchild = socket.socketpair()
        if self.template is not None:
            self.template.fork(wid, child, cchild)
            proc: mp.process.BaseProcess | ForkedWorker = ForkedWorker(self.template, wid)
        else:
            # A forked worker closes every parent end it inherits, its own, its siblings'
            # and other loaders' pools', so that every worker's socket reports end-of-stream
            # as soon as the loader's process is gone, even if it was killed.
            others = [sock for pool in list(_LIVE_POOLS) if not pool.closed for sock in pool.sockets()]
            inherited = tuple(others + self.socks + self.ctrls + [parent, cparent]) if self.forking else ()
            proc = self.context.Process(
                target=worker_main,
                args=(wid, cfg, child, cchild, inherited, os.getpid(), self.forking),
                name=f"aioload-worker-{wid}",
            )
            try:
                proc.start()  # spawn and forkserver pickle cfg here, fork does not
            except BaseException as exc:
                for sock in (parent, child, cparent, cchild):
                    sock.close()
                if isinstance(exc, (pickle.PicklingError, AttributeError, TypeError)):
                    raise _unsendable(cfg, self.context, exc) or exc
                raise
        child.close()
        cchild.close()
        try:
            send_fd(cparent, self.progress_memory.fd, SLOT_HEADER.pack(PROGRESS_ID, self.progress_memory.size))
        except OSError:
            pass  # its template died first: its task socket reports that
        if not self.forking:
            parent.setblocking(False)
        return proc, parent, cparent

    def _check_forked(self, cfg: WorkerConfig) -> None:
        """Wait until every forked worker has begun to run (its first byte, :data:`FORKED`,
        sent before anything else it does), at most :data:`FORK_START_S` a try. A worker that
        has not is stuck in the fork itself: a lock another thread of this process held at the
        fork stays held in the child, and CPython before 3.11.8 (gh-112275) takes one after
        every fork (a thread of another library creating its Python thread state at that
        moment: DDP's gloo threads did). It is killed and forked again, :data:`FORK_TRIES`
        times at most; a worker that died instead is left to be reported as a crash."""
        waiting = set(range(len(self.procs)))
        for attempt in range(1, FORK_TRIES + 1):
            deadline = time.monotonic() + FORK_START_S
            while waiting and (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([self.socks[wid] for wid in waiting], [], [], left)
                for sock in ready:
                    sock.recv(len(FORKED))  # the byte, or b"" from a worker that died: a crash, reported later
                    waiting.discard(self.socks.index(sock))
            for wid in sorted(waiting):
                proc = self.procs[wid]
                proc.kill()
                proc.join(5)
                self.socks[wid].close()
                self.ctrls[wid].close()
                if attempt == FORK_TRIES:
                    raise RuntimeError(
                        f"aioload worker {wid} was forked {FORK_TRIES} times and each time its process stayed "
                        f"stuck in the fork for {FORK_START_S:g} s, before running any code: a lock that another "
                        "thread of this process held at the fork stays held in the child (CPython before 3.11.8 "
                        "takes one after every fork, gh-112275). Upgrade Python, or start the workers without "
                        "fork: multiprocessing_context='forkserver'")
                warnings.warn(f"aioload worker {wid} stayed stuck in the fork for {FORK_START_S:g} s before running "
                              "any code (a lock another thread held at the fork; CPython before 3.11.8 takes one, "
                              "gh-112275): it was killed and forked again", RuntimeWarning, stacklevel=2)
                self.procs[wid], self.socks[wid], self.ctrls[wid] = self._start_worker(cfg, wid)
            if not waiting:
                break
        for sock in self.socks:
            sock.setblocking(False)

    def _start_template(self, cfg: WorkerConfig, context, method: str) -> str:
        """Start the template the workers are forked from (:mod:`aioload._workers.template`)
        where the start method is not ``fork`` and nothing rules it out; how the workers start,
        in words (``LoaderStats.worker_start``)."""
        if method == "fork":
            return "fork: each worker is forked from the training process"
        why = unavailable(method)
        if not why:
            try:
                payload = multiprocessing.reduction.ForkingPickler.dumps(cfg, pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise _unsendable(cfg, context, exc) or exc
            self.template = Template(payload, context)
            del payload
            why = self.template.verdict() or ""  # None: it died, and each worker reports that
            if why:
                self.template.close()
                self.template = None
        if not why:
            return f"{method}: one process unpickled the dataset once, and each worker is forked from it"
        return f"{method}: each worker unpickles its own copy of the dataset ({why})"

    def sockets(self) -> list[socket.socket]:
        """The training process's ends of this pool's sockets, its template's included."""
        return self.socks + self.ctrls + ([self.template.sock] if self.template is not None else [])

    def alive(self) -> bool:
        """Usable for another epoch: not closed, not broken, and no worker has died (a worker
        killed between epochs, by the out-of-memory killer say, is found here)."""
        return not self.closed and self.broken is None and all(p.exitcode is None for p in self.procs)

    def current(self, wid: int) -> tuple[int, int]:
        """``(task id, dataset index)`` worker ``wid`` last started; index ``-1`` when unknown,
        ``COLLATING`` while its ``collate_fn`` runs."""
        if self.closed:
            return -1, -1
        return self.progress[2 * wid], self.progress[2 * wid + 1]

    def register(self, slot_id: int, segment: Segment) -> None:
        """Hand a new slot's memory to every worker (they map it when first used)."""
        header = SLOT_HEADER.pack(slot_id, segment.size)
        for ctrl in self.ctrls:
            try:
                send_fd(ctrl, segment.fd, header)
            except OSError:
                pass  # a dead worker is reported by its task socket

    def close(self, timeout: float = 2.0) -> None:
        """Stop every worker: ask, then terminate, then kill. Idempotent and bounded."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner:
            return  # a copy inherited by a forked process (another loader's worker): not ours to stop
        stop = _wire.encode(Shutdown())
        for sock in self.socks:
            try:
                sock.setblocking(True)
                sock.settimeout(0.5)
                sock.sendall(stop)
            except OSError:
                pass
        _join_all(self.procs, timeout)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        _join_all(self.procs, 1.0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        _join_all(self.procs, 1.0)
        for proc in self.procs:
            proc.close() if proc.exitcode is not None else None
        if self.template is not None:
            self.template.close()  # its workers are gone: it reported how each ended
        for sock in self.socks + self.ctrls:
            sock.close()
        # A closed pool keeps nothing alive. The error that broke it is also the consumer's
        # exception, whose traceback holds the training loop's frames and the batches in them;
        # slots still out reach this pool (slot pool -> register), so keeping the error here
        # would keep those batches' shared memory for good.
        self.broken = None
        self.fetch_storages.clear()
        self.progress.release()
        self.progress_memory.close()


_SENT = (("collate_fn", "a function defined at the top level of a module (not a lambda, nor a function "
                         "defined inside another)"),
         ("worker_init_fn", "a function defined at the top level of a module (not a lambda, nor a function "
                            "defined inside another)"),
         ("dataset", "an instance of a class defined at the top level of a module, holding no open file, lock, "
                     "client or lambda (open those in the worker, on first use)"))


def _unsendable(cfg: WorkerConfig, context, exc: Exception) -> UnpicklableError | None:
    """The error naming what of ``cfg`` a ``spawn`` or ``forkserver`` worker cannot be sent,
    and the fix; ``None`` where all of it pickles (``exc`` is then not about it)."""
    method = context.get_start_method()
    for name, fix in _SENT:
        try:
            pickle.dumps(getattr(cfg, name))
        except Exception as failed:  # noqa: BLE001 - any failure to pickle names the culprit
            error = UnpicklableError(
                f"{name} {getattr(cfg, name)!r} cannot be pickled, and the {method!r} start method sends it to "
                f"every worker ({type(failed).__name__}: {failed}): make it {fix}, or use "
                f"multiprocessing_context='fork' where the platform has it")
            error.__cause__ = exc
            return error
    return None


def _not_started(context) -> str:
    """Why a worker may have died before it started, for the crash error."""
    method = context.get_start_method()
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if method == "fork" or main is None:
        return "; its own error, if it printed one, is above"
    return (f". With the {method!r} start method each worker first runs the main module ({main}) again, "
            "its top-level code included: where that code iterates a DataLoader, the worker tries to start "
            "workers of its own and fails (its error is printed above). Put the program's code under "
            "'if __name__ == \"__main__\":', as torch's DataLoader also requires with this start method")


def _join_all(procs, timeout: float) -> None:
    """Join every process, ``timeout`` seconds for all of them together."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


class _Request:
    __slots__ = ("priority", "seq", "task", "indices", "future", "worker")

    def __init__(self, priority, seq, task: Task, indices, future):
        self.priority, self.seq, self.task = priority, seq, task  # task.drops filled in when sent
        self.indices, self.future, self.worker = indices, future, None

    def __lt__(self, other):
        return (self.priority, self.seq) < (other.priority, other.seq)


class PoolSession:
    """One epoch's use of the pool, inside the engine's event loop. ``per_worker``: tasks
    queued on each worker once every worker has started (``prefetch_factor``);
    ``cancel_reads``: the workers read their samples, and an epoch that ends early tells them
    to cancel the reads in flight (:class:`~aioload._workers.messages.CancelReads`)."""

    def __init__(self, pool: WorkerPool, per_worker: int = PER_WORKER_TASKS, cancel_reads: bool = False):
        self.pool = pool
        self.per_worker = max(1, per_worker)
        self.cancel_reads = cancel_reads
        self._ids = itertools.count()
        self._pending: list[_Request] = []
        self._has_pinned = False  # an IterableDataset pins tasks to workers
        self._inflight: list[dict[int, _Request]] = [dict() for _ in range(pool.num_workers)]
        self._drops: list[list[int]] = [[] for _ in range(pool.num_workers)]
        # Per worker: bytes the socket would not take at once, sent in order by one task.
        self._backlog: list[collections.deque] = [collections.deque() for _ in range(pool.num_workers)]
        self._flushing: list[asyncio.Task | None] = [None] * pool.num_workers
        self._idle = asyncio.Event()
        self._idle.set()
        self._reported = asyncio.Event()  # a worker said it is ready, or the pool broke
        self._broken_reading: asyncio.Future | None = None  # serve()'s: a reply callback failed
        self._crash_reports: set[asyncio.Task] = set()
        self._fetches: dict[int, tuple[int, asyncio.Future]] = {}  # fetch id -> (worker, future)
        self._fetched = asyncio.Event()  # no fetch in flight
        self._fetched.set()
        self._streams: list | None = None  # report_streams(): each worker's reply, as it comes
        self._streams_in = asyncio.Event()

    def drop_slot(self, slot_id: int) -> None:
        for drops in self._drops:
            drops.append(slot_id)

    async def broadcast(self, message) -> None:
        data = _wire.encode(message)
        for wid in range(self.pool.num_workers):
            self._post(wid, data)

    def send(self, wid: int, message) -> None:
        """``message`` to worker ``wid`` alone, after what was posted to it before."""
        self._post(wid, _wire.encode(message))

    def _post(self, wid: int, data: bytes) -> None:
        """Send ``data`` to worker ``wid`` now if its socket takes it whole, else queue it
        behind what is waiting; messages reach each worker in the order posted. A dead
        worker's socket fails quietly: its reader sees the end of stream and reports it."""
        backlog = self._backlog[wid]
        if not backlog:
            try:
                sent = self.pool.socks[wid].send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return
            if sent == len(data):
                return
            data = data[sent:]
        backlog.append(data)
        if self._flushing[wid] is None:
            self._flushing[wid] = asyncio.get_running_loop().create_task(self._flush(wid))

    async def _flush(self, wid: int) -> None:
        backlog = self._backlog[wid]
        loop = asyncio.get_running_loop()
        try:
            while backlog:
                await loop.sock_sendall(self.pool.socks[wid], backlog[0])
                backlog.popleft()
        except OSError:
            backlog.clear()
        finally:
            self._flushing[wid] = None

    def fetch(self, url: str, storage) -> asyncio.Future:
        """Have a worker fetch the whole object at ``url`` with ``storage`` (the one with the
        fewest fetches in flight): the future gets its bytes as
        :class:`~aioload._handoff.shared.SharedBytes` (:mod:`aioload._workers.fetches`).
        Cancelling the future lets the bytes go when they arrive."""
        if self.pool.broken is not None:
            raise self.pool.broken
        busy = collections.Counter(wid for wid, _ in self._fetches.values())
        wid = min(range(self.pool.num_workers), key=lambda w: busy[w])
        fetch_id = next(self.pool.fetch_ids)
        future = asyncio.get_running_loop().create_future()
        self._fetches[fetch_id] = (wid, future)
        self._fetched.clear()
        self.pool.fetch_storages.setdefault(id(storage), storage)
        self.send(wid, FetchShard(fetch_id, url, storage, (self.pool.owner, id(storage))))
        return future

    def _answered(self, wid: int, msg: Fetched) -> None:
        """A fetch's end: its memfd (sent just before the message) taken from the control
        socket, whether or not anyone still waits for it."""
        shared = None
        if msg.size >= 0:
            header, fd = recv_fd(self.pool.ctrls[wid], SLOT_HEADER.size)
            shared = _shared.adopt(fd, msg.size)
            if SLOT_HEADER.unpack(header) != (msg.fetch_id, msg.size):  # pragma: no cover - a bug
                raise RuntimeError(f"worker {wid} sent the memory of fetch {SLOT_HEADER.unpack(header)} "
                                   f"with the answer to fetch {msg.fetch_id}")
        wid_future = self._fetches.pop(msg.fetch_id, None)
        if not self._fetches:
            self._fetched.set()
        if wid_future is None or wid_future[1].done():
            return  # a late answer (the epoch gave up on it, or it was cancelled): its memfd goes
        future = wid_future[1]
        if shared is not None:
            future.set_result(shared)
        else:
            exc = unpack_exception(msg.packed, None)
            del exc.__notes__[-1]  # the worker's traceback of a failed request; each read adds its sample
            future.set_exception(exc)

    async def submit(self, work, slot, indices, priority, worker=None) -> Done | Stopped:
        """Queue one task (``work``, a :mod:`~aioload._workers.messages` work value, into
        ``slot``); returns the worker's reply. Lower ``priority`` is served first;
        ``worker`` pins the task to one worker (an IterableDataset's batches come from the
        worker whose copy produced them; round-robin dispatch gives batch i to worker i mod N)."""
        return await self.enqueue(work, slot, indices, priority, worker)

    def enqueue(self, work, slot, indices, priority, worker=None) -> asyncio.Future:
        """:meth:`submit` without the wait: the task is queued when this returns, and the
        future gets the reply (:class:`~aioload._workers.messages.Done`, or ``Stopped`` for an
        ``iter`` task whose worker ran out). Tasks pinned to one worker reach it in ``priority`` order
        among those queued; cancelling the future withdraws a task not yet sent."""
        if self.pool.broken is not None:
            raise self.pool.broken
        future = asyncio.get_running_loop().create_future()
        task_id = next(self._ids)
        request = _Request(priority, task_id, Task(task_id, slot, work), indices, future)
        request.worker = worker
        if worker is not None:
            self._has_pinned = True
        heapq.heappush(self._pending, request)
        self._dispatch()
        return future

    def _room(self, wid: int) -> bool:
        # While some workers are still starting, one task each: the first batch is then split
        # across every worker instead of queueing on whichever answered first.
        ready = self.pool.ready
        depth = self.per_worker if all(ready) else 1
        return ready[wid] and len(self._inflight[wid]) < depth

    def _least_loaded(self) -> int | None:
        best = None
        for wid, inflight in enumerate(self._inflight):
            if self._room(wid) and (best is None or len(inflight) < len(self._inflight[best])):
                best = wid
        return best

    def _dispatch(self) -> None:
        """Send waiting tasks to workers with room, lowest priority (batch number) first.
        Requests pinned to a worker wait in that worker's own heap."""
        heap = self._pending
        if not self._has_pinned:
            while heap:
                wid = self._least_loaded()
                if wid is None:
                    return
                request = heapq.heappop(heap)
                if not request.future.done():
                    self._start(wid, request)
            return
        waiting = []
        while heap:
            request = heapq.heappop(heap)
            if request.future.done():
                continue
            wid = request.worker if request.worker is not None else self._least_loaded()
            if wid is None or not self._room(wid):
                waiting.append(request)
                continue
            self._start(wid, request)
        for request in waiting:
            heapq.heappush(heap, request)

    def _start(self, wid: int, request: _Request) -> None:
        queued = request.task
        task = queued._replace(drops=self._drops[wid])
        try:
            with _shared.collecting() as segments:
                data = _wire.encode(task)
        except Exception as exc:  # noqa: BLE001 - an index or read result that does not pickle
            request.future.set_exception(_wire.unsendable(exc, request.indices))
            return  # nothing was sent: the worker stays free and the pool stays usable
        for segment in segments:  # the shared bytes its items view: mapped as the worker unpickles it
            try:
                send_fd(self.pool.ctrls[wid], segment.fd, SLOT_HEADER.pack(segment.id, segment.size))
            except OSError:
                pass  # a dead worker is reported by its task socket
        request.worker = wid
        self._idle.clear()
        self._drops[wid] = []
        self._inflight[wid][task.task_id] = request
        self._post(wid, data)

    async def serve(self) -> None:
        """Read every worker's replies until cancelled; a dead worker breaks the pool.

        Each socket has a reader callback for the whole epoch: a reply costs one wake-up and
        one ``recv``, where awaiting a read per message would register and unregister the
        socket with the loop's poller every time."""
        loop = asyncio.get_running_loop()
        self._broken_reading = loop.create_future()
        watched = []
        try:
            for wid, sock in enumerate(self.pool.socks):
                loop.add_reader(sock.fileno(), self._readable, wid, _wire.Reader(sock))
                watched.append(sock.fileno())
            await self._broken_reading  # raises what a reply callback hit; else waits for cancel
        finally:
            for fd in watched:
                loop.remove_reader(fd)
            for task in list(self._crash_reports):
                task.cancel()

    def _readable(self, wid: int, reader: _wire.Reader) -> None:
        loop = asyncio.get_running_loop()
        try:
            messages = reader.read_available()
            if messages is None:
                loop.remove_reader(reader.sock.fileno())
                report = loop.create_task(self._crashed(wid))
                self._crash_reports.add(report)
                report.add_done_callback(self._crash_reported)
                return
            for msg in messages:
                if not self._handle(wid, msg):
                    loop.remove_reader(reader.sock.fileno())
                    return
        except BaseException as exc:  # noqa: BLE001 - raised by serve(), in the engine's task group
            loop.remove_reader(reader.sock.fileno())
            if not self._broken_reading.done():
                self._broken_reading.set_exception(exc)

    def _crash_reported(self, task: asyncio.Task) -> None:
        self._crash_reports.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._broken_reading.done():
            self._broken_reading.set_exception(task.exception())

    def _handle(self, wid: int, msg) -> bool:
        """One message from worker ``wid``; ``False`` when nothing more is read from it."""
        if isinstance(msg, WorkerReady):
            self.pool.ready[wid] = True
            self._reported.set()
            self._dispatch()
        elif isinstance(msg, InitError):
            self._fail_all(unpack_exception(msg.packed, f"raised by worker_init_fn in worker {wid}"))
            return False
        elif isinstance(msg, Fetched):
            self._answered(wid, msg)
        elif isinstance(msg, Streams):
            if self._streams is not None:
                self._streams[wid] = msg.record
                if all(record is not None for record in self._streams):
                    self._streams_in.set()
        else:  # Done or Stopped
            request = self._inflight[wid].pop(msg.task_id, None)
            if request is not None and not request.future.done():
                request.future.set_result(msg)
            self._dispatch()
            if not self.outstanding():
                self._idle.set()
        return True

    async def _crashed(self, wid: int) -> None:
        proc = self.pool.procs[wid]
        await asyncio.to_thread(proc.join, 1.0)
        indices = [i for r in self._inflight[wid].values() for i in r.indices]
        if self.pool.ready[wid] or indices:
            what = (f"while working on dataset indices {indices}. If it ran out of memory, lower "
                    f"num_workers or batch_size; if it crashed in native code, check those samples.")
        else:
            what = f"before it started{_not_started(self.pool.context)}."
        exc = WorkerCrashedError(
            f"{crash_message(proc.pid, proc.exitcode)} aioload worker {wid} {describe_exit(proc.exitcode)} {what}",
            worker_id=wid,
            pid=proc.pid,
            exitcode=proc.exitcode,
            indices=indices,
        )
        self._fail_all(exc)

    async def started(self) -> BaseException | None:
        """Wait until every worker has started; the error that kept one from starting (its
        ``worker_init_fn`` failed, it died), else ``None``. As in torch, such a worker fails
        the epoch even when its siblings did all of the epoch's work."""
        while not all(self.pool.ready):
            if self.pool.broken is not None:
                return self.pool.broken
            self._reported.clear()
            await self._reported.wait()
        return None

    async def report_streams(self, timeout: float) -> tuple | None:
        """Each worker's random streams (:func:`aioload._base.seeding.capture_streams`), asked once
        every task sent is answered; ``None`` where a worker does not answer within ``timeout``
        or the pool broke."""
        self._streams = [None] * self.pool.num_workers
        self._streams_in.clear()
        await self.broadcast(ReportStreams())
        try:
            async with asyncio.timeout(timeout):
                await self._streams_in.wait()
        except TimeoutError:
            return None
        if self.pool.broken is not None:
            return None
        return tuple(self._streams)

    def _fail_all(self, exc: BaseException) -> None:
        self.pool.broken = exc
        self._reported.set()
        self._idle.set()
        self._streams_in.set()
        requests = [r for inflight in self._inflight for r in inflight.values()] + self._pending
        for inflight in self._inflight:
            inflight.clear()
        self._pending.clear()
        for request in requests:
            if not request.future.done():
                request.future.set_exception(exc)
        fetches, self._fetches = self._fetches, {}
        self._fetched.set()
        for _, future in fetches.values():
            if not future.done():
                future.set_exception(exc)

    def outstanding(self) -> int:
        return sum(len(inflight) for inflight in self._inflight)

    def tasks_of(self, wid: int) -> list[int]:
        """The ids of the tasks sent to worker ``wid`` and not answered yet."""
        return list(self._inflight[wid])

    def requests_for(self, priority) -> list[tuple[list, int | None, int | None]]:
        """The unanswered tasks of batch ``priority``: ``(indices, worker, task id)``, with
        worker ``None`` while the task waits for a free worker."""
        found = [(r.indices, wid, task_id) for wid, inflight in enumerate(self._inflight)
                 for task_id, r in inflight.items() if r.priority == priority]
        return found + [(r.indices, None, None) for r in self._pending if r.priority == priority]

    async def aclose(self) -> bool:
        """End the tasks this session started (backlog flushes, crash reports) and wait for
        them, so that none outlives the epoch's event loop. ``False`` when a message was cut
        short: that worker's stream is then unusable and the pool must not serve another epoch."""
        whole = not any(self._backlog)
        tasks = [task for task in self._flushing if task is not None] + list(self._crash_reports)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for backlog in self._backlog:
            backlog.clear()
        return whole

    async def drain(self, timeout: float) -> bool:
        """Wait until the workers have answered every task sent to them (so no slot is still
        being written); ``False`` if that took longer than ``timeout``. Workers that read are
        told to fail their reads in flight first: an abandoned epoch (``break``) does not wait
        for slow reads, and the workers stay usable for the next one."""
        for request in self._pending:
            request.future.cancel()
        self._pending.clear()
        if self.pool.broken is not None:
            return True
        fetching = {wid for wid, _ in self._fetches.values()}
        if (self.cancel_reads and self.outstanding()) or fetching:
            data = _wire.encode(CancelReads())
            for wid, inflight in enumerate(self._inflight):
                if (inflight and self.cancel_reads) or wid in fetching:
                    self._post(wid, data)
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
                await self._fetched.wait()  # every memfd sent is taken off its socket
        except TimeoutError:
            return False
        return True
