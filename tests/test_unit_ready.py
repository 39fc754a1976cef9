"""The ready queue (:mod:`aioload._engine.ready`): order, skips, the end, errors, and its two consumers.

# unit tests: no worker process

The engine's side is played by the test (or a thread of it) calling ``put``/``finish``/``fail``;
the consumer's side is a thread blocked in ``get`` or a coroutine woken through
``when_ready``, as the sync and async front ends use them. The permit hand-over of ``put``
(``True`` for a waiting consumer) is covered in tests/test_wire.py.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from aioload._engine.ready import SKIP, Delivered, EndOfEpoch, ReadyQueue

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

HANG_GUARD = 10  # seconds; only stops a hang


# ----------------------------------------------------------------------------- helpers
def take_all(ready: ReadyQueue) -> list:
    """Every item until the end of the epoch, as a blocked consumer takes them."""
    got = []
    while True:
        try:
            item, _owed = ready.get(timeout=HANG_GUARD)
        except EndOfEpoch:
            return got
        got.append(item)


def producer(ready: ReadyQueue, order: list[int], total: int | None = None) -> threading.Thread:
    """An engine thread that puts batch ``seq`` as ``f"b{seq}"`` in ``order``, then finishes."""

    def run():
        for seq in order:
            ready.put(seq, f"b{seq}")
        ready.finish(len(order) if total is None else total)

    thread = threading.Thread(target=run, name="test-engine")
    thread.start()
    return thread


async def take_all_async(ready: ReadyQueue, waiting: threading.Event | None = None) -> list:
    """Every item until the end of the epoch, as the async front end takes them: woken from
    the engine's thread through ``when_ready``, never blocking the loop. ``waiting`` is set
    each time a waker is kept (the consumer is about to wait)."""
    loop = asyncio.get_running_loop()
    got = []
    while True:
        try:
            found, item, _owed = ready.get_nowait()
        except EndOfEpoch:
            return got
        if found:
            got.append(item)
            continue
        woken = asyncio.Event()
        if ready.when_ready(lambda: loop.call_soon_threadsafe(woken.set)):
            if waiting is not None:
                waiting.set()
            await asyncio.wait_for(woken.wait(), HANG_GUARD)


def stepping_producer(ready: ReadyQueue, order: list[int], waiting: threading.Event) -> threading.Thread:
    """An engine thread that puts each batch (and the end) only once the consumer waits, so
    that every one of them must wake it."""

    def run():
        for seq in order:
            assert waiting.wait(HANG_GUARD), "the consumer never waited"
            waiting.clear()
            ready.put(seq, f"b{seq}")
        assert waiting.wait(HANG_GUARD)
        ready.finish(len(order))

    thread = threading.Thread(target=run, name="test-engine")
    thread.start()
    return thread


# ----------------------------------------------------------------------------- order
def test_in_order_batches_come_in_sampler_order_whatever_order_they_finish():
    ready = ReadyQueue(in_order=True)
    ready.put(2, "b2")
    ready.put(1, "b1")
    assert ready.get_nowait() == (False, None, False), "batch 0 is awaited: later ones wait"
    assert len(ready) == 2
    ready.put(0, "b0")
    assert [ready.get_nowait() for _ in range(3)] == [(True, f"b{i}", True) for i in range(3)]
    assert ready.taken == 3 and len(ready) == 0


def test_out_of_order_batches_come_as_they_finish():
    ready = ReadyQueue(in_order=False)
    ready.put(3, "b3")
    assert ready.get_nowait() == (True, "b3", True), "batch 3 does not wait for 0-2"
    ready.put(5, "b5")
    ready.put(1, "b1")
    assert sorted(ready.get_nowait()[1] for _ in range(2)) == ["b1", "b5"]
    ready.put(0, "b0")
    ready.put(2, "b2")
    ready.put(4, "b4")
    ready.finish(6)
    assert sorted(take_all(ready)) == ["b0", "b2", "b4"]
    assert ready.delivered.low == 6


def test_a_skipped_number_yields_nothing_and_counts_as_delivered():
    ready = ReadyQueue(in_order=True)
    ready.put(0, SKIP)
    ready.put(2, SKIP)
    ready.put(1, "b1")
    ready.put(3, "b3")
    ready.finish(4)
    assert take_all(ready) == ["b1", "b3"]
    assert ready.taken == 2 and ready.delivered.low == 4 and ready.delivered.complete


def test_finish_ends_the_epoch_once_every_number_below_total_is_delivered():
    ready = ReadyQueue(in_order=True)
    ready.put(0, "b0")
    ready.finish(2)
    assert ready.get(timeout=HANG_GUARD) == ("b0", True)
    with pytest.raises(TimeoutError):
        ready.get(timeout=0.01)  # batch 1 is still to come
    assert not ready.delivered.complete
    ready.put(1, "b1")
    assert ready.get(timeout=HANG_GUARD) == ("b1", True)
    with pytest.raises(EndOfEpoch):
        ready.get(timeout=HANG_GUARD)
    assert ready.delivered.complete
    with pytest.raises(EndOfEpoch):
        ready.get_nowait()


def test_an_empty_epoch_ends_at_once():
    ready = ReadyQueue(in_order=True)
    ready.finish(0)
    with pytest.raises(EndOfEpoch):
        ready.get_nowait()


# ----------------------------------------------------------------------------- errors
def test_fail_is_raised_where_the_awaited_batch_would_be():
    ready = ReadyQueue(in_order=True)
    ready.put(0, "b0")
    ready.put(2, "b2")
    error = ValueError("decode failed")
    ready.fail(error)
    ready.fail(RuntimeError("a later error"))  # the first error is the one raised
    assert ready.get_nowait() == (True, "b0", True), "a batch already made is delivered first"
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            ready.get(timeout=HANG_GUARD)
        assert info.value is error


def test_fail_wakes_a_blocked_consumer():
    ready = ReadyQueue(in_order=True)
    raised = []

    def consume():
        try:
            ready.get(timeout=HANG_GUARD)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    error = OSError("engine broke")
    ready.fail(error)
    consumer.join(HANG_GUARD)
    assert raised == [error]


def test_get_times_out_when_nothing_comes():
    ready = ReadyQueue(in_order=False)
    with pytest.raises(TimeoutError):
        ready.get(timeout=0.01)


def test_drain_removes_and_returns_what_is_buffered():
    ready = ReadyQueue(in_order=True)
    for seq in (3, 1, 2):
        ready.put(seq, f"b{seq}")
    assert sorted(ready.drain()) == ["b1", "b2", "b3"]
    assert len(ready) == 0 and ready.drain() == []
    assert ready.get_nowait() == (False, None, False)


# ----------------------------------------------------------------------------- resume
def test_a_resumed_epoch_skips_what_was_delivered_before():
    delivered = Delivered(2, [3, 5])  # 0, 1, 3 and 5 were delivered before the save
    ready = ReadyQueue(in_order=True, delivered=delivered)
    ready.put(6, "b6")
    ready.put(4, "b4")
    assert ready.get_nowait() == (False, None, False), "batch 2 is awaited"
    ready.put(2, "b2")
    assert [ready.get_nowait()[1] for _ in range(3)] == ["b2", "b4", "b6"]
    ready.finish(7)
    with pytest.raises(EndOfEpoch):
        ready.get_nowait()
    assert ready.delivered is delivered and delivered.low == 7


def test_delivered_keeps_a_low_mark_and_the_numbers_above_it():
    d = Delivered()
    for seq in (1, 3, 0):
        d.add(seq)
    assert (d.low, d.above) == (2, {3}) and len(d) == 3
    assert 0 in d and 3 in d and 2 not in d
    copy = d.copy()
    d.add(2)
    assert (d.low, d.above) == (4, set()) and (copy.low, copy.above) == (2, {3})
    d.add(1)  # already below the mark
    assert len(d) == 4
    assert (Delivered(1, [2, 1, 4]).low, Delivered(1, [2, 4]).low) == (3, 1)


# ----------------------------------------------------------------------------- consumers
@pytest.mark.parametrize("in_order", [True, False])
def test_a_blocked_consumer_thread_gets_every_batch_of_an_engine_thread(in_order):
    order = list(range(200))
    random.Random(4).shuffle(order)
    ready = ReadyQueue(in_order=in_order)
    engine = producer(ready, order)
    got = take_all(ready)
    engine.join(HANG_GUARD)
    if in_order:
        assert got == [f"b{i}" for i in range(200)]
    else:
        assert sorted(got) == sorted(f"b{i}" for i in range(200))
    assert ready.delivered.complete and ready.taken == 200


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("stepping", [False, True])
def test_an_async_consumer_woken_by_when_ready_gets_every_batch(in_order, stepping):
    order = list(range(200 if not stepping else 40))
    random.Random(5).shuffle(order)
    ready = ReadyQueue(in_order=in_order)
    waiting = threading.Event()

    async def main():
        engine = stepping_producer(ready, order, waiting) if stepping else producer(ready, order)
        try:
            return await take_all_async(ready, waiting)
        finally:
            await asyncio.to_thread(engine.join, HANG_GUARD)

    got = asyncio.run(main())
    if in_order:
        assert got == [f"b{i}" for i in sorted(order)]
    else:
        assert sorted(got) == sorted(f"b{i}" for i in order)


def test_when_ready_keeps_no_waker_while_something_can_be_taken():
    ready = ReadyQueue(in_order=True)
    woken = []
    ready.put(1, "b1")
    assert ready.when_ready(lambda: woken.append(1)) is True, "in order, batch 1 does not count"
    ready.put(0, "b0")
    assert woken == [1]
    assert ready.when_ready(lambda: woken.append(2)) is False
    ready.put(2, "b2")
    assert woken == [1], "a waker is called once and only when kept"
    ready.fail(RuntimeError("x"))
    assert ready.when_ready(lambda: woken.append(3)) is False, "an error can be taken"
