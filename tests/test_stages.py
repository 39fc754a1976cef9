"""The engine's stages one at a time, without a worker process or an engine thread: the read
stage under ``asyncio.run`` with a dataset whose reads wait or fail on demand, the decode
stage's task sizing and error reports, the layout-learning gate, the stuck report, and the
typed messages over a real socket pair."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from types import SimpleNamespace

import pytest

import aioload
from aioload._engine.budget import ErrorBudget
from aioload._data.dataset import NOT_READY
from aioload._engine.decode import WHOLE_BATCH_SECONDS, DecodeStage, LayoutLesson
from aioload._base.errors import DataLoaderTimeoutError, pack_exception
from aioload._handoff.layout import LeafSpec
from aioload._data.limiter import Limiter
from aioload._workers.messages import (BatchOut, Done, DropSlots, InitError, IterWork, ReadReport, RowsOut, RowsWork,
                                      Shutdown, StartEpoch, Stopped, Task, TaskError, WorkerReady)
from aioload._engine.reads import ReadStage
from aioload._engine.spec import BatchBound, Mode, Ready, Shared, Spec
from aioload._engine.spec import Reads as Where
from aioload._observe.stats import StatsRecorder
from aioload._engine.stuck import InFlight, StuckReport
from aioload._workers.wire import Reader, encode, send_blocking

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds


class Reads(aioload.Dataset):
    """Reads that count how many run at once, and fail, hang or return a lock on demand."""

    def __init__(self, fail=(), hang=(), lock=(), at_hand=()):
        self.fail, self.hang, self.lock, self.at_hand = set(fail), set(hang), set(lock), set(at_hand)
        self.running = 0
        self.most = 0
        self.read_calls: list = []
        self.nowait_calls: list = []
        self.release = None  # an asyncio.Event that held reads wait for, when set up

    def __len__(self):
        return 100

    def describe(self, index):
        return f"/data/{index}.bin"

    def read_nowait(self, index):
        self.nowait_calls.append(index)
        return f"near {index}".encode() if index in self.at_hand else NOT_READY

    async def read(self, index):
        self.read_calls.append(index)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # let every other read start that can
            if self.release is not None:
                await self.release.wait()
            if index in self.hang:
                await asyncio.Event().wait()
            if index in self.fail:
                raise OSError(f"no such object {index}")
            if index in self.lock:
                return {"lock": threading.Lock()}
            return f"raw {index}".encode()
        finally:
            self.running -= 1

    def decode(self, raw):
        return raw


def make_spec(dataset=None, **overrides) -> Spec:
    values = dict(dataset=dataset, split=dataset is not None, mode=Mode.ROWS,
                  reads=Where.ENGINE if dataset is not None else Where.NONE, batch_size=8, num_workers=4,
                  io_concurrency=3, bound=BatchBound(4, 2, 8, whole=False, reads=True), queue_depth=2, in_order=True,
                  on_error="raise", pin=False, prefetch_tasks=2, describe=getattr(dataset, "describe", None))
    values.update(overrides)
    return Spec(**values)


def read_stage(spec: Spec, pickled: bool = True) -> tuple[ReadStage, StatsRecorder, ErrorBudget]:
    stats = StatsRecorder()
    budget = ErrorBudget(spec.on_error, spec.max_errors, spec.epoch_samples, stats.skip)
    return ReadStage(spec, stats, budget, Limiter(spec.io_concurrency), InFlight(), pickled=pickled), stats, budget


# -- the read stage -------------------------------------------------------------------------------
def test_reads_in_flight_never_exceed_io_concurrency():
    ds = Reads()
    reads, stats, _ = read_stage(make_spec(ds, io_concurrency=3))
    items = asyncio.run(reads.items(list(range(10))))
    assert items == [(i, f"raw {i}".encode()) for i in range(10)]
    assert ds.most == 3
    assert stats.reads == 10 and stats.bytes_read == sum(len(f"raw {i}") for i in range(10))
    assert stats.reads_in_flight == 0 and reads.inflight.samples == {}


def test_read_nowait_items_skip_the_loop():
    ds = Reads(at_hand={0, 2})
    reads, stats, _ = read_stage(make_spec(ds))
    items = asyncio.run(reads.items([0, 1, 2, 3]))
    assert items == [(0, b"near 0"), (1, b"raw 1"), (2, b"near 2"), (3, b"raw 3")]
    assert ds.nowait_calls == [0, 1, 2, 3] and sorted(ds.read_calls) == [1, 3]
    assert stats.reads == 4


def test_read_in_workers_sends_bare_indices_and_reads_nothing():
    ds = Reads(at_hand={0})
    reads, stats, _ = read_stage(make_spec(ds, reads=Where.WORKERS))
    indices = [5, 0, 7]
    assert asyncio.run(reads.items(indices)) == [5, 0, 7]
    assert ds.read_calls == [] and ds.nowait_calls == [] and stats.reads == 0
    # and without it, the same stage reads them
    reads, _, _ = read_stage(make_spec(ds))
    assert asyncio.run(reads.items(indices)) == [(5, b"raw 5"), (0, b"near 0"), (7, b"raw 7")]


def test_a_dataset_without_a_read_stage_gets_bare_indices():
    reads, _, _ = read_stage(make_spec(None, split=False, reads=Where.NONE, describe=None))
    assert asyncio.run(reads.items([3, 4])) == [3, 4]


def test_read_timeout_names_the_index_the_limit_and_the_path():
    ds = Reads(hang={7})
    reads, stats, _ = read_stage(make_spec(ds, read_timeout=0.05))
    with pytest.raises(DataLoaderTimeoutError) as info:
        asyncio.run(reads.items([6, 7]))
    assert str(info.value) == (
        "dataset.read(7) did not return within read_timeout=0.05 seconds; raise read_timeout if the "
        "storage is just slow, or use on_error='skip' to leave such samples out")
    assert info.value.__notes__ == ["while reading dataset index 7 (/data/7.bin)"]
    assert info.value.stuck == [(7, "read")]
    assert stats.reads == 2 and stats.reads_in_flight == 0


def test_skipped_reads_are_left_out_and_recorded_in_the_budget():
    ds = Reads(fail={1, 3})
    reads, stats, budget = read_stage(make_spec(ds, on_error="skip"))
    items = asyncio.run(reads.items([0, 1, 2, 3]))
    assert items == [(0, b"raw 0"), (2, b"raw 2")]
    assert budget.count == 2 and stats.skipped == [1, 3] and stats.skipped_total == 2


def test_a_failed_read_raises_with_its_index_and_path():
    reads, _, _ = read_stage(make_spec(Reads(fail={2})))
    with pytest.raises(OSError) as info:
        asyncio.run(reads.items([1, 2]))
    assert str(info.value) == "no such object 2"
    assert info.value.__notes__ == ["while reading dataset index 2 (/data/2.bin)"]


def test_an_unpicklable_read_result_says_what_to_return_instead():
    ds = Reads(lock={4})
    reads, _, _ = read_stage(make_spec(ds))
    with pytest.raises(TypeError) as info:
        asyncio.run(reads.items([4]))
    message = str(info.value)
    assert message.startswith("dataset.read(4) returned a dict holding a _thread.lock, which cannot be pickled "
                              "to reach a worker process (TypeError: ")
    assert message.endswith("return bytes, numbers, strings, arrays or tensors from read(), and open files, "
                            "locks or clients in decode()")
    assert info.value.__notes__ == ["while reading dataset index 4 (/data/4.bin)"]
    # skipped with on_error="skip"; not checked at all when nothing is pickled (num_workers=0)
    reads, stats, budget = read_stage(make_spec(ds, on_error="skip"))
    assert asyncio.run(reads.items([3, 4])) == [(3, b"raw 3")] and stats.skipped == [4]
    reads, _, _ = read_stage(make_spec(ds), pickled=False)
    [(index, raw)] = asyncio.run(reads.items([4]))
    assert index == 4 and isinstance(raw["lock"], type(threading.Lock()))


def test_the_stuck_report_sees_reads_and_the_queue_for_a_read_slot():
    ds = Reads()
    spec = make_spec(ds, io_concurrency=1)
    reads, _, _ = read_stage(spec)
    report = StuckReport(spec, None, None, reads.inflight)

    async def main():
        ds.release = asyncio.Event()
        reads.inflight.batches[0] = [10, 11]
        task = asyncio.create_task(reads.items([10, 11]))
        while not ds.read_calls:
            await asyncio.sleep(0)
        seen = report.where()
        ds.release.set()
        await task
        return seen

    assert asyncio.run(main()) == [(10, "read"), (11, "waiting for a read slot (io_concurrency=1)")]
    assert reads.inflight.samples == {}
    assert report.describe([(10, "read"), (11, "waiting for a read slot (io_concurrency=1)")]) == (
        "dataset index 10 (/data/10.bin) is stuck in read; dataset index 11 (/data/11.bin) is waiting for a "
        "read slot (io_concurrency=1)")


@pytest.mark.parametrize("overrides, stage", [
    (dict(), "decode"),
    (dict(reads=Where.WORKERS), "read or decode"),
    (dict(split=False, reads=Where.NONE), "__getitem__"),
    (dict(mode=Mode.ITER), "__iter__"),
])
def test_the_stuck_report_names_what_a_worker_does(overrides, stage):
    ds = Reads()
    spec = make_spec(ds, **overrides)
    inflight = InFlight()
    inflight.batches[3] = [40, 41]
    # The worker pool's side as the report reads it: worker 1 (pid 4242) is on task 9, index 41.
    pool = SimpleNamespace(ready=[True, True], procs=[None, SimpleNamespace(pid=4242)],
                           current=lambda wid: (9, 41))
    session = SimpleNamespace(requests_for=lambda seq: [([40, 41], 1, 9)] if seq == 3 else [],
                              tasks_of=lambda wid: [9])
    report = StuckReport(spec, pool, session, inflight)
    assert report.where() == [(41, f"{stage} in worker 1 (pid 4242)")]


# -- the decode stage -----------------------------------------------------------------------------
def decode_stage(spec: Spec, shared: Shared | None = None, quick: list | None = None):
    stats = StatsRecorder()
    budget = ErrorBudget(spec.on_error, spec.max_errors, spec.epoch_samples, stats.skip)
    shared = shared or Shared()
    reads = ReadStage(spec, stats, budget, Limiter(spec.io_concurrency), InFlight(), pickled=True)
    lesson = LayoutLesson(shared, spec.num_workers)
    on_quick = (quick.append if quick is not None else lambda q: None)
    return DecodeStage(spec, shared, stats, budget, reads, None, register=None, permits=Limiter(4), lesson=lesson,
                       finish=None, on_quick=on_quick)


def test_chunks_split_the_first_batches_then_follow_the_time_per_sample():
    stage = decode_stage(make_spec(Reads(), num_workers=4))
    assert stage._chunk(64) == 16  # nothing measured yet: split across the workers
    assert stage._chunk(3) == 1
    stage.shared.per_sample_s = 0.01  # 0.64 s a batch: tasks of about CHUNK_SECONDS
    assert stage._chunk(64) == 10
    stage.shared.per_sample_s = 0.001  # 64 ms a batch: split across the workers
    assert stage._chunk(64) == 16
    stage.shared.per_sample_s = WHOLE_BATCH_SECONDS / 64  # quick: the batch in one task
    assert stage._chunk(64) == 64
    assert decode_stage(make_spec(Reads(), num_workers=4, round_robin=True))._chunk(64) == 64
    assert decode_stage(make_spec(Reads(), num_workers=4, batched_fetch=True))._chunk(64) == 64


def test_a_learning_batch_occupies_one_worker_per_chunk():
    stage = decode_stage(make_spec(Reads(), num_workers=4))
    assert stage.shares(list(range(10))) == 4  # chunks of 3: 4 chunks
    assert stage.shares([1, 2]) == 2
    assert decode_stage(make_spec(Reads(), num_workers=4, mode=Mode.WHOLE)).shares(list(range(10))) == 1
    assert decode_stage(make_spec(Reads(), num_workers=4, round_robin=True)).shares(list(range(10))) == 1


def packed(exc: BaseException) -> bytes:
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001
        return pack_exception(raised)


def test_task_errors_become_exceptions_that_say_where():
    stage = decode_stage(make_spec(Reads()))
    reply = Done(1, RowsOut([b"skeleton"], [-1, 0, -1]), [TaskError(2, 7, "decode", packed(ValueError("bad pixel"))),
                                                          TaskError(0, 5, "decode", packed(KeyError("label")))],
                 None, 0, 0.1)
    errors = stage.task_errors(reply, offset=8)
    assert [(e.pos, e.index) for e in errors] == [(10, 7), (8, 5)]
    with pytest.raises(KeyError) as info:
        stage.raise_first(errors)  # the batch's first sample that failed
    assert info.value.__notes__[0] == ("while running decode for dataset index 5 (/data/5.bin) in an aioload worker; "
                                       "on_error='skip' leaves such samples out and goes on")
    assert info.value.__notes__[1].startswith("Original traceback:")  # the worker's
    batch = stage.unpack(TaskError(0, [1, 2], "collate_fn", packed(RuntimeError("sizes differ"))))
    assert isinstance(batch, RuntimeError) and str(batch) == "sizes differ"
    assert batch.__notes__[0] == "while running collate_fn for the batch of dataset indices [1, 2] in an aioload worker"
    chunk = stage.unpack(TaskError(0, [3, 4], "__getitems__", packed(OSError("shard gone"))))
    assert chunk.__notes__[0] == "while running __getitems__ for dataset indices [3, 4] in an aioload worker"
    it = stage.unpack(TaskError(0, None, "__iter__", packed(StopIteration())))
    assert it.__notes__[0] == "in stage __iter__ in an aioload worker"


def test_skipped_task_errors_are_recorded_in_sample_order():
    stage = decode_stage(make_spec(Reads(), on_error="skip"))
    errors = [TaskError(3, 9, "decode", packed(ValueError("a"))), TaskError(1, 4, "decode", packed(ValueError("b"))),
              TaskError(0, [20, 21], "collate", packed(ValueError("c")))]
    stage.skip(errors)
    assert stage.budget.count == 4 and stage.stats.skipped == [20, 21, 4, 9]


def test_a_reply_teaches_the_layout_and_records_decode_and_worker_reads():
    quick: list = []
    stage = decode_stage(make_spec(Reads()), quick=quick)
    assert stage.lesson.learning()
    reply = Done(0, RowsOut([b"skeleton"], [0, 0, 0, 0]), [], [], 0, 0.004, cpu_s=0.003,
                 reads=ReadReport([0.01, 0.03], 2048, None, waited_s=0.02, limited_s=0.015, limit=16, worker=1))
    stage.note_reply(reply, rows=8)
    assert stage.shared.no_leaves and not stage.lesson.learning()
    s = stage.stats
    assert (s.decoded, s.decode_s, s.decode_cpu_s) == (4, 0.004, 0.003)
    assert (s.reads, s.bytes_read) == (2, 2048) and s.read_s == pytest.approx(0.04)
    assert (s.read_wait_s, s.read_limited_s) == (0.02, 0.015) and s.worker_read_limit() == 16
    assert stage.shared.per_sample_s == 0.001 and quick == [True]  # 8 ms a batch of 8: quick
    stage.note_reply(Done(1, RowsOut([b"skeleton"], [0]), [], None, 0, 0.5), rows=8)  # no cpu_s: counted as wall time
    assert s.decode_cpu_s == pytest.approx(0.503) and s.reads == 2
    assert quick == [True, False]  # 0.8 * 1 ms + 0.2 * 500 ms a sample: no longer quick


def test_a_layout_from_specs_is_learned_once():
    leaves = [LeafSpec("t", "torch.float32", (3,))]
    stage = decode_stage(make_spec(Reads()))
    stage.note_reply(Done(0, RowsOut([b"skeleton"], [0]), [], leaves, 0, 0.01), rows=8, timed=False)
    assert stage.shared.layout.leaves == leaves and stage.shared.layout.rows == 8
    first = stage.shared.layout
    stage.note_reply(Done(1, RowsOut([b"skeleton"], [0]), [], [], 0, 0.01), rows=4, timed=False)
    assert stage.shared.layout is first and not stage.shared.no_leaves and stage.shared.per_sample_s is None


def test_batches_that_teach_the_layout_wait_for_free_workers():
    shared = Shared()
    lesson = LayoutLesson(shared, workers=2)
    started: list = []

    async def main():
        gate = asyncio.Event()

        async def make(name):
            started.append(name)
            await gate.wait()
            return name

        a = asyncio.create_task(lesson.run(make, "a", shares=1))
        b = asyncio.create_task(lesson.run(make, "b", shares=1))
        c = asyncio.create_task(lesson.run(make, "c", shares=1))
        for _ in range(5):
            await asyncio.sleep(0)
        first = list(started)
        shared.no_leaves = True  # a reply showed the layout
        lesson.learned()
        for _ in range(5):
            await asyncio.sleep(0)
        second = list(started)
        gate.set()
        return first, second, await asyncio.gather(a, b, c)

    first, second, results = asyncio.run(main())
    assert first == ["a", "b"]  # two workers: a third teacher waits
    assert second == ["a", "b", "c"]  # once the layout is known, it goes
    assert results == ["a", "b", "c"] and lesson.teachers == 0


# -- messages ------------------------------------------------------------------------------------
MESSAGES = [
    StartEpoch(12345, True),
    Task(7, (3, ([LeafSpec("t", "torch.uint8", (3, 4))], 8, 64), (0, 64)), RowsWork([(1, b"raw")], 0, True), [2, 5]),
    Task(8, None, IterWork()),
    DropSlots([1, 2]),
    Shutdown(),
    WorkerReady(4242),
    InitError(packed(RuntimeError("no GPU"))),
    Done(7, RowsOut([b"\x80skeleton"], [0, 0, -1]), [TaskError(2, 9, "decode", packed(ValueError("bad")))], None, 128,
         0.25, cpu_s=0.2, reads=ReadReport([0.001, 0.002], 4096, None, 0.0, 0.0, 32, 0)),
    Done(8, BatchOut(None), [], [], 0, 0.1),
    Stopped(8),
]


def test_messages_survive_the_socket_with_their_types_and_fields():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for message in MESSAGES:
            send_blocking(theirs, message)
        reader = Reader(ours)
        got = [reader.recv_blocking() for _ in MESSAGES]
    assert got == MESSAGES
    assert [type(m) for m in got] == [type(m) for m in MESSAGES]
    done = got[7]
    assert done.errors[0].stage == "decode" and isinstance(done.errors[0], TaskError)
    assert done.reads.latencies == [0.001, 0.002] and done.reads.limit == 32 and done.overflow_wanted == 128
    assert got[1].work.items == [(1, b"raw")] and type(got[2].work) is IterWork
    assert got[1].drops == [2, 5] and got[2].drops == ()


def test_messages_that_arrive_together_are_parsed_from_one_read():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"".join(encode(m) for m in MESSAGES))
        ours.setblocking(False)
        reader = Reader(ours)
        assert reader.read_available() == MESSAGES


def test_done_defaults_its_cpu_seconds_worker_reads_copy_note_and_caches():
    done = Done(1, RowsOut([], []), [], None, 0, 0.5)
    assert done._fields[-4:] == ("cpu_s", "reads", "copy", "caches")
    assert done.cpu_s is None and done.reads is None and done.copy is None and done.caches is None
    assert re.fullmatch(r"Done\(task_id=1, .*cpu_s=None, reads=None, copy=None, caches=None\)", repr(done))


# -- a batch's lease ------------------------------------------------------------------------------
class StandInSlots:
    """The slot pool's side a lease uses: ``release``."""

    def __init__(self):
        self.released: list = []

    def release(self, slot) -> None:
        self.released.append(slot)


class StandInReady:
    """The ready queue's side a lease uses: ``put``, which says whether a consumer took it."""

    def __init__(self, waiting: bool = False):
        self.waiting = waiting
        self.items: dict = {}

    def put(self, seq, item) -> bool:
        self.items[seq] = item
        return self.waiting


def lease_for(seq: int = 3, waiting: bool = False, turn=None):
    from aioload._engine.lease import Lease

    permits, ready, shared, inflight = Limiter(4), StandInReady(waiting), Shared(), InFlight()
    shared.slots = StandInSlots()

    async def taken():
        await permits.acquire()  # as the sampler stage does, before the lease is made
        return Lease(seq, [7, 8], [7, 8], turn, permits=permits, ready=ready, shared=shared, inflight=inflight)

    return asyncio.run(taken()), permits, ready, shared, inflight


@pytest.mark.parametrize("waiting, item, permit_back", [
    (False, "batch", False),  # the consumer returns the permit when it takes the batch
    (True, "batch", True),    # handed to a waiting consumer, which owes none: back at once
    (False, "skip", True),    # nothing to take: back at once
])
def test_a_lease_returns_its_permit_once_and_where_the_batch_went(waiting, item, permit_back):
    from aioload._engine.ready import SKIP

    lease, permits, ready, shared, inflight = lease_for(waiting=waiting)
    assert inflight.batches == {3: [7, 8]} and permits.in_use == 1
    value = SKIP if item == "skip" else Ready(batch="b", samples=2)
    lease.deliver(value)
    lease.close()
    lease.close()  # idempotent: nothing is returned twice
    assert ready.items == {3: value} and inflight.batches == {}
    assert permits.in_use == (0 if permit_back else 1)
    assert shared.slots.released == []


def test_a_lease_gives_back_a_slot_no_batch_took_and_the_permit_of_a_batch_never_delivered():
    lease, permits, ready, shared, _ = lease_for()
    slot = object()
    assert lease.hold(slot) is slot
    lease.close()  # the batch failed before it was delivered (its epoch is ending)
    assert shared.slots.released == [slot] and permits.in_use == 0 and ready.items == {}


def test_a_slot_passed_to_the_batchs_tensors_goes_back_when_they_are_gone():
    import gc

    from aioload._handoff.layout import Layout
    from aioload._handoff.shm import Segment

    lease, _, _, shared, _ = lease_for()
    layout = Layout([LeafSpec("t", "torch.float32", (2,))], rows=4, overflow=0)
    segment = Segment.create(layout.size, "aioload-test")
    slot = SimpleNamespace(segment=segment, layout=layout)
    try:
        lease.hold(slot)
        view = lease.view()
        column = view.column(0, 4)
        view.release()
        lease.close()
        assert shared.slots.released == []  # the batch's tensor still views the slot
        del column
        gc.collect()
        assert shared.slots.released == [slot]
    finally:
        segment.close()


def test_a_lease_lets_the_next_batch_of_its_worker_go_even_when_it_sent_nothing():
    from aioload._engine.spec import Turn

    turn = Turn(0, None)
    after = Turn(0, turn)
    lease, *_ = lease_for(turn=turn)

    async def main():
        waiting = asyncio.create_task(after.wait())
        await asyncio.sleep(0)
        assert not waiting.done()
        lease.close()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(main())


# -- the reads-in-flight policy and its evidence ---------------------------------------------------
def test_a_worker_limit_doubles_only_while_the_limit_holds_its_decoding_back():
    from aioload._data.reads import GROW_WAIT_S, next_limit

    assert next_limit(32, 512, waited_s=0.2, limited_s=0.15) == 64  # waited, reads queued behind the limit
    assert next_limit(32, 512, waited_s=0.2, limited_s=0.05) == 32  # waited below the limit: latency, not the limit
    assert next_limit(32, 512, waited_s=0.0, limited_s=0.0) == 32  # no wait: nothing to fix
    assert next_limit(32, 512, waited_s=GROW_WAIT_S / 2, limited_s=GROW_WAIT_S / 2) == 32  # too short to judge
    assert next_limit(400, 512, waited_s=0.2, limited_s=0.2) == 512  # never beyond the ceiling
    assert next_limit(512, 512, waited_s=0.2, limited_s=0.2) == 512
    assert next_limit(16, 16, waited_s=0.2, limited_s=0.2) == 16  # a fixed limit (its own ceiling) stays


def test_a_limiter_counts_the_time_acquirers_waited_behind_it():
    async def main():
        lim = Limiter(1)
        assert lim.bound_seconds() == 0.0
        await lim.acquire()
        waiter = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        assert lim.bound_seconds() > 0.0  # someone waits now: the clock runs
        held = lim.bound_seconds()
        lim.release()
        await waiter
        done = lim.bound_seconds()
        assert done >= held
        await asyncio.sleep(0)
        assert lim.bound_seconds() == done  # nobody waits: it stands still
        lim.release()

    asyncio.run(main())
