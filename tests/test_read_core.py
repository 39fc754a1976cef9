"""The one read core (aioload._data.reads.BatchReads) that the engine's loop, the workers and the
executor all read through, tested alone on asyncio.run: read_nowait first, the bound on reads in
flight, read_timeout, one note per failure, cancellation, the counted latencies and bytes, and
the stall meter that times each step of a read."""

from __future__ import annotations

import asyncio
import time

import pytest

import aioload
from aioload._data.dataset import NOT_READY
from aioload._data.reads import STALL_READS, STALL_SAMPLE, STALL_STEP, BatchReads, FailedRead, StallMeter, Watch


class Store(aioload.Dataset):
    def __init__(self, fail=(), slow=(), at_hand=(), block=0.0):
        self.fail, self.slow, self.at_hand, self.block = set(fail), set(slow), set(at_hand), block
        self.running = self.most = 0

    def __len__(self):
        return 100

    def describe(self, index):
        return f"/data/{index}"

    def read_nowait(self, index):
        return f"near {index}".encode() if index in self.at_hand else NOT_READY

    async def read(self, index):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.block:
                time.sleep(self.block)
            await asyncio.sleep(5 if index in self.slow else 0.01)
            if index in self.fail:
                raise OSError(f"cannot read {index}")
            return f"raw {index}".encode()
        finally:
            self.running -= 1


class Record(Watch):
    def __init__(self):
        self.events = []

    def at_hand(self, index):
        self.events.append(("at hand", index))

    def started(self, index):
        self.events.append(("started", index))

    def finished(self, index, seconds, nbytes):
        self.events.append(("finished", index, nbytes))


def read(dataset, indices, **kwargs):
    async def main():
        core = BatchReads(dataset, bound=asyncio.Semaphore(kwargs.pop("bound", 64)), **kwargs)
        return core, await core.read(indices)

    return asyncio.run(main())


def test_items_at_hand_skip_the_loop_and_the_rest_are_read_under_the_bound():
    store, watch = Store(at_hand={1}), Record()
    _, (raws, latencies, nbytes) = read(store, [0, 1, 2, 3, 4], bound=2, read_timeout=None, watch=watch)
    assert raws == [b"raw 0", b"near 1", b"raw 2", b"raw 3", b"raw 4"]
    assert store.most == 2 and len(latencies) == 4 and nbytes == 4 * len(b"raw 0")
    assert ("at hand", 1) in watch.events and ("finished", 3, 5) in watch.events


def test_a_failed_or_slow_read_is_a_failed_read_noted_once_where_it_ran():
    _, (raws, _, _) = read(Store(fail={2}, slow={3}), [1, 2, 3], read_timeout=0.3, place=" in an aioload worker")
    assert raws[0] == b"raw 1"
    failed, slow = raws[1], raws[2]
    assert isinstance(failed, FailedRead) and isinstance(slow, FailedRead)
    assert str(failed.error) == "cannot read 2"
    assert failed.error.__notes__ == ["while reading dataset index 2 (/data/2) in an aioload worker"]
    assert isinstance(slow.error, aioload.DataLoaderTimeoutError) and slow.error.stuck == [(3, "read")]


def test_cancelled_reads_become_failed_reads():
    async def main():
        core = BatchReads(Store(slow={0, 1}), bound=asyncio.Semaphore(4), read_timeout=None)
        reading = asyncio.ensure_future(core.read([0, 1, 2]))
        await asyncio.sleep(0.1)
        assert core.cancel() == 2  # the two slow ones were still in flight
        return await reading

    raws, latencies, _ = asyncio.run(main())
    assert raws[2] == b"raw 2"
    assert [str(r.error) for r in raws[:2]] == [f"dataset.read({i}) was cancelled: the epoch ended before it returned"
                                                for i in (0, 1)]


def test_the_stall_meter_finds_reads_that_block_and_says_so_once():
    meter = StallMeter()
    read(Store(block=STALL_STEP * 1.5), list(range(20)), read_timeout=None, meter=meter)
    stall = meter.take()
    assert stall is not None and stall.reads == STALL_READS and stall.blocked_s >= 1.0
    assert stall.longest_s >= STALL_STEP and stall.index in range(20)
    assert meter.take() is None  # reported once


def test_once_reads_are_sampled_a_habit_of_blocking_is_still_found():
    meter = StallMeter()
    read(Store(), list(range(STALL_SAMPLE * STALL_SAMPLE)), read_timeout=None, meter=meter)  # each one timed
    assert meter.take() is None and meter.begin() == 0  # from here on, one read in STALL_SAMPLE
    store = Store(block=STALL_STEP * 1.1)
    read(store, list(range(STALL_SAMPLE * 4)), read_timeout=None, bound=1, meter=meter)
    stall = meter.take()
    assert stall is not None and stall.reads == STALL_READS
    assert stall.blocked_s == pytest.approx(STALL_SAMPLE * 4 * STALL_STEP * 1.1, rel=0.5)  # each timed read stands for 16


def test_reads_that_await_leave_the_meter_quiet():
    meter = StallMeter()
    read(Store(), list(range(40)), read_timeout=None, meter=meter)
    assert meter.take() is None and meter.blocked_s == 0.0


@pytest.mark.parametrize("limit", [None, 1.0])
def test_a_timed_read_returns_its_value_with_or_without_a_limit(limit):
    from aioload._data.reads import read_within

    class Echo(aioload.Dataset):
        async def read(self, index):
            await asyncio.sleep(0)
            return index * 2

    assert asyncio.run(read_within(Echo(), 21, limit, StallMeter())) == 42
