"""Task dispatch of :class:`aioload._workers.pool.PoolSession`: room, order, pinning, errors, crashes.

# unit tests: no worker process

A :class:`PoolSession` uses six attributes of its :class:`~aioload._workers.pool.WorkerPool`:
``num_workers``, ``socks`` (one non-blocking task socket per worker), ``ready`` (which workers
said they started), ``broken`` (the error that broke the pool), ``procs`` (``pid``,
``exitcode`` and ``join`` of a worker found dead). :class:`StandInPool` provides exactly
those over real ``socket.socketpair()`` sockets; the test coroutine plays each worker on the
other end with the worker's own message framing (:mod:`aioload._workers.wire`) and messages
(:mod:`aioload._workers.messages`): it says ``WorkerReady``/``InitError``, reads the ``Task`` and
``StartEpoch`` values sent to it, and answers each task with a ``Done`` when the test decides,
so every dispatch decision is observed as the messages a worker receives. The session runs
with its real ``serve()`` on the test's loop.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
import socket

import pytest

from aioload._workers import wire as _wire
from aioload._base.errors import WorkerCrashedError, pack_exception
from aioload._engine.spec import MAX_AHEAD, BatchBound
from aioload._workers.messages import BatchOut, CancelReads, Done, InitError, StartEpoch, Task, WorkerReady
from aioload._workers.pool import PER_WORKER_TASKS, PoolSession

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

HANG_GUARD = 10  # seconds; nothing here waits on time, this only stops a hang


# ----------------------------------------------------------------------------- stand-ins
class DeadProcess:
    """What the session reads of a dead worker's process."""

    def __init__(self, pid: int, exitcode: int):
        self.pid, self.exitcode = pid, exitcode

    def join(self, timeout=None) -> None:
        pass


class PlayedWorker:
    """The worker's end of one task socket, driven by the test."""

    def __init__(self, wid: int, sock: socket.socket):
        self.wid = wid
        self.sock = sock
        sock.setblocking(False)
        self.reader = _wire.Reader(sock)
        self.got: list = []  # every message received (Task, StartEpoch, ...), in order
        self.answered: set[int] = set()

    def received(self) -> list:
        """The messages that arrived since the last call (sent while the session dispatched)."""
        new = []
        while True:
            messages = self.reader.read_available()
            if not messages:
                break
            new.extend(messages)
        self.got.extend(new)
        return new

    def tasks(self) -> list[Task]:
        """The tasks that arrived since the last call; nothing but tasks is expected."""
        new = self.received()
        assert all(type(m) is Task for m in new), f"worker {self.wid} got {new}"
        return new

    def ids(self) -> list[int]:
        return [t.task_id for t in self.tasks()]

    def labels(self) -> list:
        """The payloads of the tasks that arrived since the last call."""
        return [t.work for t in self.tasks()]

    def say(self, message) -> None:
        self.sock.sendall(_wire.encode(message))

    def ready(self) -> None:
        self.say(WorkerReady(4000 + self.wid))

    def answer(self, task_id: int, label=None) -> None:
        self.answered.add(task_id)
        self.say(done(task_id, label))

    def answer_all(self) -> None:
        """Answer every task received and not answered yet."""
        self.received()
        for message in self.got:
            if type(message) is Task and message.task_id not in self.answered:
                self.answer(message.task_id)

    def die(self) -> None:
        self.sock.close()


def done(task_id: int, label=None) -> Done:
    """A worker's reply to task ``task_id``: one batch-wide payload (``label``), no errors, no
    leaf specs (the samples hold no leaves; the tasks here have no slot), no overflow wanted."""
    return Done(task_id, BatchOut(label), [], [], 0, 0.0)


class StandInPool:
    """The attributes of a WorkerPool that a PoolSession uses, with played workers."""

    def __init__(self, num_workers: int, exitcode: int = -signal.SIGKILL):
        self.num_workers = num_workers
        self.ready = [False] * num_workers
        self.broken: BaseException | None = None
        self.socks: list[socket.socket] = []
        self.workers: list[PlayedWorker] = []
        self.procs = [DeadProcess(4000 + wid, exitcode) for wid in range(num_workers)]
        for wid in range(num_workers):
            parent, child = socket.socketpair()
            parent.setblocking(False)
            self.socks.append(parent)
            self.workers.append(PlayedWorker(wid, child))

    def close(self) -> None:
        for sock in self.socks + [w.sock for w in self.workers]:
            sock.close()


def run(body, workers: int = 2, ready: int | None = None, cancel_reads: bool = False, **pool_args):
    """Run ``await body(session, pool)`` with the session serving; the first ``ready`` workers
    (all by default) have reported that they started; ``cancel_reads``: the workers read."""

    async def main():
        pool = StandInPool(workers, **pool_args)
        session = PoolSession(pool, cancel_reads=cancel_reads)
        serving = asyncio.create_task(session.serve())
        try:
            for worker in pool.workers[: workers if ready is None else ready]:
                worker.ready()
            if ready is None:
                assert await asyncio.wait_for(session.started(), HANG_GUARD) is None
            else:
                await until(lambda: sum(pool.ready) == ready)
            return await body(session, pool)
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await session.aclose()
            pool.close()

    return asyncio.run(main())


async def until(condition) -> None:
    """Let the loop run (reader callbacks, flushes) until ``condition()`` holds."""
    async with asyncio.timeout(HANG_GUARD):
        while not condition():
            await asyncio.sleep(0)


def task(session, priority=0, indices=None, payload=None, worker=None):
    """Queue a task of batch ``priority``; its work (what the worker sees as ``Task.work``; the
    pool does not look into it) defaults to the priority, its dataset indices to ``[priority]``."""
    payload = priority if payload is None else payload
    indices = [priority] if indices is None else list(indices)
    return session.enqueue(payload, None, indices, priority, worker)


async def reply(future):
    return await asyncio.wait_for(future, HANG_GUARD)


async def reply_done(future) -> Done:
    """The reply of a single task, which must be the worker's ``Done`` itself."""
    result = await reply(future)
    assert type(result) is Done, result
    return result


# ----------------------------------------------------------------------------- dispatch
def test_a_task_goes_to_the_least_loaded_worker():
    async def body(session, pool):
        w0, w1 = pool.workers
        a, b = task(session, 0), task(session, 1)
        (ida,), (idb,) = w0.ids(), w1.ids()
        w0.answer(ida, "a")
        assert await reply_done(a) == done(ida, "a")
        # worker 1 still has room (one task of PER_WORKER_TASKS) but worker 0 has none queued
        c = task(session, 2)
        assert w0.labels() == [2] and w1.labels() == []
        w1.answer(idb, "b")
        assert await reply_done(b) == done(idb, "b")
        assert not c.done()

    run(body)


def test_each_worker_gets_per_worker_tasks_and_the_rest_wait():
    async def body(session, pool):
        n = 3 * PER_WORKER_TASKS
        futures = {p: task(session, p) for p in range(n + 1)}
        assert [len(w.labels()) for w in pool.workers] == [PER_WORKER_TASKS] * 3
        assert session.outstanding() == n
        assert session.requests_for(n) == [([n], None, None)], "the last task waits for room"
        w2 = pool.workers[2]
        first = w2.got[0]
        w2.answer(first.task_id)
        await reply(futures[first.work])
        assert w2.labels() == [n], "the waiting task went to the worker that had room"
        (indices, wid, task_id), = session.requests_for(n)
        assert (indices, wid) == ([n], 2) and task_id in session.tasks_of(2)
        for worker in pool.workers:
            worker.answer_all()
        await reply(asyncio.gather(*futures.values()))
        assert session.outstanding() == 0 and session.tasks_of(2) == []

    run(body, workers=3)


def test_while_workers_start_each_ready_one_gets_one_task():
    async def body(session, pool):
        w0, w1 = pool.workers
        futures = [task(session, p) for p in range(4)]
        assert w0.labels() == [0], "a ready worker takes one task while another is still starting"
        assert w1.labels() == []
        w1.ready()
        assert await asyncio.wait_for(session.started(), HANG_GUARD) is None
        assert session.outstanding() == 2 * PER_WORKER_TASKS
        assert w1.labels() == [1, 3] and w0.labels() == [2]
        for worker in pool.workers:
            worker.answer_all()
        await reply(asyncio.gather(*futures))

    run(body, ready=1)


def test_lower_priority_numbers_are_sent_first():
    async def body(session, pool):
        (w,) = pool.workers
        futures = {p: task(session, p) for p in range(PER_WORKER_TASKS)}
        for p, label in ((7, "7"), (3, "3a"), (5, "5"), (3, "3b")):
            futures[label] = task(session, p, payload=label)
        assert w.labels() == list(range(PER_WORKER_TASKS))
        for _ in range(len(futures)):  # the worker finishes its oldest task, and the next one comes
            oldest = next(m for m in w.got if m.task_id not in w.answered)
            w.answer(oldest.task_id)
            await reply(futures[oldest.work])
            w.labels()
        assert [m.work for m in w.got] == [*range(PER_WORKER_TASKS), "3a", "3b", "5", "7"], \
            "lowest priority first; equal priorities in the order they were queued"

    run(body, workers=1)


def test_pinned_tasks_wait_for_their_worker_and_go_in_priority_order():
    async def body(session, pool):
        w0, w1 = pool.workers
        pinned = [task(session, p, worker=1) for p in range(PER_WORKER_TASKS)]
        assert w0.labels() == [] and w1.labels() == list(range(PER_WORKER_TASKS))
        later = [task(session, 9, worker=1), task(session, 4, worker=1)]
        assert w1.labels() == [], "worker 1 is full: its pinned tasks wait even though worker 0 is idle"
        assert [r[1] for r in session.requests_for(9) + session.requests_for(4)] == [None, None]
        free = task(session, 8)
        assert w0.labels() == [8], "a task pinned to no worker goes to one with room"
        w1.answer_all()
        await reply(asyncio.gather(*pinned))
        assert w1.labels() == [4, 9]
        w1.answer_all()
        w0.answer_all()
        await reply(asyncio.gather(*later, free))

    run(body)


def test_a_task_that_does_not_pickle_fails_alone_and_leaves_its_worker_free():
    async def body(session, pool):
        (w,) = pool.workers
        bad = task(session, 0, indices=[4, 5], payload=lambda: None)  # a lambda does not pickle
        with pytest.raises(TypeError, match=r"^the task for dataset indices \[4, 5\] cannot be pickled to "
                                             r"reach a worker process \((PicklingError|AttributeError)") as info:
            await reply(bad)
        assert info.value.__cause__ is not None
        assert w.received() == [] and session.outstanding() == 0 and pool.broken is None
        good = [task(session, p) for p in range(1, 1 + PER_WORKER_TASKS)]
        assert len(w.ids()) == PER_WORKER_TASKS, "the failed task took no room on the worker"
        for m in w.got:
            w.answer(m.task_id)
        await reply(asyncio.gather(*good))

    run(body, workers=1)


def test_a_dead_worker_fails_every_task_with_an_error_naming_it():
    async def body(session, pool):
        w0, w1 = pool.workers
        mine = [task(session, 0, indices=[1, 2])]
        other = [task(session, 1, indices=[7])]
        mine.append(task(session, 2, indices=[3]))
        other += [task(session, p) for p in (5, 6)]  # worker 1 full: one waits
        assert w0.labels() == [0, 2] and w1.labels() == [1, 5]
        w0.die()
        with pytest.raises(WorkerCrashedError) as info:
            await reply(mine[0])
        exc = info.value
        assert str(exc) == (
            "DataLoader worker (pid 4000) is killed by signal: Killed. aioload worker 0 was killed by "
            "SIGKILL while working on dataset indices [1, 2, 3]. If it ran out of memory, lower "
            "num_workers or batch_size; if it crashed in native code, check those samples."
        )
        assert (exc.worker_id, exc.pid, exc.exitcode, exc.indices) == (0, 4000, -signal.SIGKILL, [1, 2, 3])
        for future in mine[1:] + other:  # the pool is broken: every task fails alike
            with pytest.raises(WorkerCrashedError) as again:
                await reply(future)
            assert again.value is exc
        assert pool.broken is exc and session.outstanding() == 0
        with pytest.raises(WorkerCrashedError):
            task(session, 9)
        assert await session.drain(HANG_GUARD) is True

    run(body)


def test_a_worker_that_exits_is_reported_with_its_exit_code():
    async def body(session, pool):
        pending = task(session, 0, indices=[11])
        pool.workers[0].die()
        with pytest.raises(WorkerCrashedError, match=r"^DataLoader worker \(pid 4000\) exited unexpectedly "
                                                     r"with exit code 3\. aioload worker 0 exited with code 3 "
                                                     r"while working on dataset indices \[11\]\."):
            await reply(pending)

    run(body, workers=1, exitcode=3)


def test_a_failed_worker_init_fn_is_the_error_started_returns():
    async def body(session, pool):
        pool.workers[0].ready()
        pool.workers[1].say(InitError(pack_exception(ValueError("no GPU for worker 1"))))
        error = await asyncio.wait_for(session.started(), HANG_GUARD)
        assert isinstance(error, ValueError) and str(error) == "no GPU for worker 1"
        assert "raised by worker_init_fn in worker 1" in error.__notes__
        assert pool.broken is error
        with pytest.raises(ValueError) as again:
            task(session, 0)
        assert again.value is error

    run(body, ready=0)


def test_a_reply_that_cannot_be_read_ends_serve_with_its_error():
    async def main():
        pool = StandInPool(1)
        session = PoolSession(pool)
        serving = asyncio.create_task(session.serve())
        try:
            garbage = b"\x00 not a pickle"
            pool.workers[0].sock.sendall(len(garbage).to_bytes(8, "little") + garbage)
            with pytest.raises(pickle.UnpicklingError):
                await asyncio.wait_for(serving, HANG_GUARD)
        finally:
            await session.aclose()
            pool.close()

    asyncio.run(main())


# ----------------------------------------------------------------------------- messages
def test_dropped_slots_ride_on_each_workers_next_task_once():
    async def body(session, pool):
        session.drop_slot(7)
        session.drop_slot(9)
        first = [task(session, p) for p in range(2)]
        second = [task(session, p) for p in range(2, 4)]
        for worker in pool.workers:
            drops = [m.drops for m in worker.tasks()]
            assert drops == [[7, 9], []], f"worker {worker.wid}"
        for worker in pool.workers:
            for m in worker.got:
                worker.answer(m.task_id)
        await reply(asyncio.gather(*first, *second))

    run(body)


def test_a_broadcast_reaches_every_worker_in_order_with_tasks():
    async def body(session, pool):
        await session.broadcast(StartEpoch(3, True))
        pending = task(session, 0)
        got = pool.workers[0].received()
        assert len(got) == 2
        assert type(got[0]) is StartEpoch and got[0] == StartEpoch(3, True)
        assert type(got[1]) is Task and got[1].work == 0
        (other,) = pool.workers[1].received()
        assert type(other) is StartEpoch and other == StartEpoch(3, True)
        pool.workers[0].answer(got[1].task_id)
        await reply(pending)

    run(body)


def test_a_task_larger_than_the_socket_buffer_arrives_whole_and_before_the_next():
    async def body(session, pool):
        (w,) = pool.workers
        big = bytes(range(256)) * 16384  # 4 MiB: more than a socket buffer takes at once
        large = task(session, 0, payload=big)
        small = task(session, 1, payload=b"after")
        got = []
        await until(lambda: got.extend(w.received()) or len(got) == 2)
        assert got[0].work == big and got[1].work == b"after"
        for m in got:
            w.answer(m.task_id)
        await reply(asyncio.gather(large, small))
        assert await session.aclose() is True, "nothing was cut short"

    run(body, workers=1)


def test_aclose_reports_a_message_cut_short():
    async def body(session, pool):
        pending = task(session, 0, payload=bytes(1 << 22))  # the worker never reads it
        assert await session.aclose() is False
        pending.cancel()

    run(body, workers=1)


def test_drain_withdraws_waiting_tasks_and_waits_for_sent_ones():
    async def body(session, pool):
        (w,) = pool.workers
        sent = [task(session, p) for p in range(PER_WORKER_TASKS)]
        waiting = task(session, 5)
        assert await session.drain(0.01) is False, "a sent task is unanswered"
        assert waiting.cancelled() and session.requests_for(5) == []
        for m in w.tasks():
            w.answer(m.task_id)
        assert await session.drain(HANG_GUARD) is True
        await reply(asyncio.gather(*sent))

    run(body, workers=1)


def test_an_abandoned_epoch_tells_the_workers_that_read_to_cancel_their_reads():
    async def body(session, pool):
        busy, idle = pool.workers
        sent = task(session, 0, worker=0)
        assert [type(m) for m in await until_received(busy)] == [Task]
        assert await session.drain(0.01) is False  # its read is still in flight: unanswered
        assert [type(m) for m in await until_received(busy)] == [CancelReads]
        assert idle.received() == []  # nothing in flight there: nothing to cancel
        busy.answer_all()  # the task, its read failed, is answered at once
        assert await session.drain(HANG_GUARD) is True
        await reply(sent)

    run(body, workers=2, cancel_reads=True)


async def until_received(worker: PlayedWorker) -> list:
    new: list = []
    await until(lambda: new.extend(worker.received()) or new)
    return new


# ----------------------------------------------------------------------------- permits
@pytest.mark.parametrize("workers,io,batch,whole,reads,quick,expected", [
    (1, 64, 8, False, False, False, 2),   # never fewer than two
    (4, 64, 8, False, False, False, 4),   # split into chunks: one per worker; no reads, io adds nothing
    (4, 64, 8, True, False, False, 4 * PER_WORKER_TASKS),  # whole batches: as many as the workers hold
    (4, 64, 8, False, False, True, 4 * PER_WORKER_TASKS),  # quick batches go whole too
    (2, 64, 8, False, True, False, 8),    # enough batches to keep 64 reads busy
    (2, 65, 8, False, True, False, 9),    # rounded up
    (2, 64, 1, False, True, True, 64),
    (16, 64, 32, False, True, True, 16 * PER_WORKER_TASKS),
    (2, 5, 0, False, True, False, 5),     # a batch of no size counts as one
])
def test_batches_in_flight(workers, io, batch, whole, reads, quick, expected):
    bound = BatchBound(workers, PER_WORKER_TASKS, batch, whole=whole, reads=reads)
    assert bound.batches(io, quick=quick) == expected


@pytest.mark.parametrize("workers,batch,rows_ahead,held", [
    (2, 64, 0, PER_WORKER_TASKS),         # nothing asked: prefetch_factor's
    (2, 64, 100, PER_WORKER_TASKS),       # less than the workers hold anyway
    (2, 64, 800, 7),                      # a window of 8 row groups of 100 rows, over 2 workers
    (1, 1, 10**6, MAX_AHEAD),             # bounded: each task holds a batch's slot
])
def test_a_dataset_that_reads_in_bursts_has_each_worker_hold_tasks_enough_to_read_ahead(workers, batch, rows_ahead,
                                                                                      held):
    bound = BatchBound(workers, PER_WORKER_TASKS, batch, whole=False, reads=False, rows_ahead=rows_ahead)
    assert bound.held == held
    assert bound.batches(0) == max(2, workers * (held if held > PER_WORKER_TASKS else 1))
