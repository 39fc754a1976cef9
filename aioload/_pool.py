"""The worker pool: processes that decode, their sockets, and the dispatch of tasks to them.

The pool outlives epochs (workers are kept for the loader's lifetime); a :class:`PoolSession`
drives it from one epoch's event loop. Each worker has two Unix sockets: one carries tasks and
replies (length-prefixed pickles), the other carries shared-memory file descriptors.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import multiprocessing as mp
import socket
import threading
from aioload import _wire
from aioload._errors import WorkerCrashedError, describe_exit, unpack_exception
from aioload._shm import Segment, send_fd
from aioload._worker import SLOT_HEADER, WorkerConfig, worker_main

PER_WORKER_TASKS = 2
"""Tasks queued on one worker: one being decoded, one waiting, so a worker never idles."""


def choose_context(multiprocessing_context) -> mp.context.BaseContext:
    """The start method: the user's, else fork while no other thread runs, else forkserver."""
    if multiprocessing_context is None:
        methods = mp.get_all_start_methods()
        if "fork" in methods and threading.active_count() == 1:
            return mp.get_context("fork")
        return mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if isinstance(multiprocessing_context, str):
        return mp.get_context(multiprocessing_context)
    return multiprocessing_context


class WorkerPool:
    """``num_workers`` processes, each holding one copy of the dataset."""

    def __init__(self, cfg: WorkerConfig, num_workers: int, context):
        self.num_workers = num_workers
        self.context = context
        self.procs: list[mp.process.BaseProcess] = []
        self.socks: list[socket.socket] = []
        self.ctrls: list[socket.socket] = []
        self.ready = [False] * num_workers
        self.broken: BaseException | None = None
        self.closed = False
        forking = context.get_start_method() == "fork"
        try:
            for wid in range(num_workers):
                parent, child = socket.socketpair()
                cparent, cchild = socket.socketpair()
                inherited = tuple(self.socks + self.ctrls) if forking else ()
                proc = context.Process(
                    target=worker_main,
                    args=(wid, cfg, child, cchild, inherited),
                    name=f"aioload-worker-{wid}",
                )
                proc.start()
                child.close()
                cchild.close()
                parent.setblocking(False)
                self.procs.append(proc)
                self.socks.append(parent)
                self.ctrls.append(cparent)
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return not self.closed and self.broken is None

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
        stop = _wire.encode(("stop",))
        for sock in self.socks:
            try:
                sock.setblocking(True)
                sock.settimeout(0.5)
                sock.sendall(stop)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
            proc.close() if proc.exitcode is not None else None
        for sock in self.socks + self.ctrls:
            sock.close()


class _Request:
    __slots__ = ("priority", "seq", "message", "indices", "future", "worker")

    def __init__(self, priority, seq, message, indices, future):
        self.priority, self.seq, self.message = priority, seq, message
        self.indices, self.future, self.worker = indices, future, None

    def __lt__(self, other):
        return (self.priority, self.seq) < (other.priority, other.seq)


class PoolSession:
    """One epoch's use of the pool, inside the engine's event loop."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._ids = itertools.count()
        self._pending: list[_Request] = []
        self._inflight: list[dict[int, _Request]] = [dict() for _ in range(pool.num_workers)]
        self._locks = [asyncio.Lock() for _ in range(pool.num_workers)]
        self._drops: list[list[int]] = [[] for _ in range(pool.num_workers)]
        self._sends: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def drop_slot(self, slot_id: int) -> None:
        for drops in self._drops:
            drops.append(slot_id)

    async def broadcast(self, message) -> None:
        for wid, sock in enumerate(self.pool.socks):
            async with self._locks[wid]:
                await _wire.send(sock, message)

    async def submit(self, kind: str, slot, payload, indices, priority, worker=None) -> tuple:
        """Queue one task; returns the worker's reply. Lower ``priority`` is served first;
        ``worker`` pins the task to one worker (an IterableDataset's batches come from the
        worker whose copy produced them)."""
        if self.pool.broken is not None:
            raise self.pool.broken
        future = asyncio.get_running_loop().create_future()
        task_id = next(self._ids)
        request = _Request(priority, task_id, (kind, task_id, slot, payload), indices, future)
        request.worker = worker
        heapq.heappush(self._pending, request)
        self._dispatch()
        return await future

    def _free_worker(self, request: _Request) -> int | None:
        candidates = range(self.pool.num_workers) if request.worker is None else (request.worker,)
        best = None
        for wid in candidates:
            load = len(self._inflight[wid])
            if self.pool.ready[wid] and load < PER_WORKER_TASKS and (best is None or load < best[0]):
                best = (load, wid)
        return None if best is None else best[1]

    def _dispatch(self) -> None:
        self._pending = [r for r in self._pending if not r.future.done()]
        heapq.heapify(self._pending)
        waiting = []
        while self._pending:
            request = heapq.heappop(self._pending)
            wid = self._free_worker(request)
            if wid is None:
                waiting.append(request)
                if request.worker is None:
                    break
                continue
            request.worker = wid
            self._idle.clear()
            kind, task_id, slot, payload = request.message
            drops, self._drops[wid] = self._drops[wid], []
            self._inflight[wid][task_id] = request
            send = asyncio.get_running_loop().create_task(
                self._send(wid, (kind, task_id, slot, payload, drops))
            )
            self._sends.add(send)
            send.add_done_callback(self._sends.discard)
        for request in waiting:
            heapq.heappush(self._pending, request)

    async def _send(self, wid: int, message) -> None:
        try:
            async with self._locks[wid]:
                await _wire.send(self.pool.socks[wid], message)
        except OSError:
            pass  # the reader sees the end of stream and reports the crash

    async def serve(self) -> None:
        """Read every worker's replies until cancelled; a dead worker breaks the pool."""
        async with asyncio.TaskGroup() as tg:
            for wid in range(self.pool.num_workers):
                tg.create_task(self._read(wid))

    async def _read(self, wid: int) -> None:
        sock = self.pool.socks[wid]
        while True:
            msg = await _wire.recv(sock)
            if msg is None:
                await self._crashed(wid)
                return
            tag = msg[0]
            if tag == "ready":
                self.pool.ready[wid] = True
                self._dispatch()
            elif tag == "init_error":
                exc = unpack_exception(msg[1], f"raised by worker_init_fn in worker {wid}")
                self._fail_all(exc)
                return
            else:
                request = self._inflight[wid].pop(msg[1], None)
                if request is not None and not request.future.done():
                    request.future.set_result(msg)
                self._dispatch()
                if not self.outstanding():
                    self._idle.set()

    async def _crashed(self, wid: int) -> None:
        proc = self.pool.procs[wid]
        await asyncio.to_thread(proc.join, 1.0)
        indices = [i for r in self._inflight[wid].values() for i in r.indices]
        exc = WorkerCrashedError(
            f"aioload worker {wid} (pid {proc.pid}) {describe_exit(proc.exitcode)} while "
            f"working on dataset indices {indices}. If it ran out of memory, lower num_workers "
            f"or batch_size; if it crashed in native code, check those samples.",
            worker_id=wid,
            exitcode=proc.exitcode,
            indices=indices,
        )
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self.pool.broken = exc
        self._idle.set()
        requests = [r for inflight in self._inflight for r in inflight.values()] + self._pending
        for inflight in self._inflight:
            inflight.clear()
        self._pending.clear()
        for request in requests:
            if not request.future.done():
                request.future.set_exception(exc)

    def outstanding(self) -> int:
        return sum(len(inflight) for inflight in self._inflight)

    async def drain(self, timeout: float) -> bool:
        """Wait until the workers have answered every task sent to them (so no slot is still
        being written); ``False`` if that took longer than ``timeout``."""
        for request in self._pending:
            request.future.cancel()
        self._pending.clear()
        if self.pool.broken is not None:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
