"""The hand-off plumbing between the engine, the workers and the consumer: framed messages over
real Unix sockets, and the ready queue's permit accounting."""

import asyncio
import random
import socket
import threading
import time

import pytest

from aioload._engine.ready import SKIP, ReadyQueue
from aioload._workers.wire import Reader, encode, send_blocking


def _messages(seed: int, count: int = 200) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        size = rng.choice([0, 1, 7, 100, 5000, 70_000, 300_000])  # some larger than the buffer
        out.append((i, rng.randbytes(size), {"k": [i] * (size % 5)}))
    return out


def _send_in_pieces(sock: socket.socket, messages: list, seed: int) -> None:
    """Every message framed, the whole stream cut at random points (headers split too)."""
    stream = b"".join(encode(m) for m in messages)
    rng = random.Random(seed)
    pos = 0
    while pos < len(stream):
        step = rng.choice([1, 3, 8, 9, 1000, 65_536, 200_000])
        sock.sendall(stream[pos : pos + step])
        pos += step
    sock.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_blocking_reader_gets_every_message_whatever_the_fragmentation(seed):
    ours, theirs = socket.socketpair()
    messages = _messages(seed)
    sender = threading.Thread(target=_send_in_pieces, args=(theirs, messages, seed))
    sender.start()
    reader = Reader(ours)
    got = [reader.recv_blocking() for _ in messages]
    assert reader.recv_blocking() is None  # end of stream
    sender.join()
    ours.close()
    assert got == messages


@pytest.mark.parametrize("seed", [2, 3])
def test_loop_reader_gets_every_message_whatever_the_fragmentation(seed):
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    messages = _messages(seed)
    sender = threading.Thread(target=_send_in_pieces, args=(theirs, messages, seed))

    async def main():
        # as the engine reads replies: a reader callback on the loop, one read per wake-up
        loop = asyncio.get_running_loop()
        reader, got, ended = Reader(ours), [], loop.create_future()

        def readable():
            found = reader.read_available()
            if found is None:  # end of stream: reported once, after every message before it
                loop.remove_reader(ours.fileno())
                ended.set_result(len(got))
            else:
                got.extend(found)

        loop.add_reader(ours.fileno(), readable)
        sender.start()
        return got, await asyncio.wait_for(ended, 60)

    got, messages_before_end = asyncio.run(main())
    sender.join()
    ours.close()
    assert got == messages
    assert messages_before_end == len(messages)


def test_reader_parses_messages_that_arrived_together_without_reading_again():
    ours, theirs = socket.socketpair()
    for i in range(5):
        send_blocking(theirs, ("done", i))
    theirs.close()
    reader = Reader(ours)
    assert reader.recv_blocking() == ("done", 0)
    # the other four came in the same read: they are parsed from the buffer
    ours.close()
    assert [reader.recv_blocking() for _ in range(4)] == [("done", i) for i in range(1, 5)]
    assert reader.recv_blocking() is None


def test_reader_reports_a_peer_that_went_away_mid_message():
    ours, theirs = socket.socketpair()
    theirs.sendall(encode(("done", 1, b"x" * 1000))[:500])
    theirs.close()
    assert Reader(ours).recv_blocking() is None
    ours.close()


# ----------------------------------------------------------------------------- ready queue


def _waiting_consumer(ready: ReadyQueue, got: list) -> threading.Thread:
    """A thread blocked in ``ready.get``; what it takes lands in ``got``."""
    consumer = threading.Thread(target=lambda: got.append(ready.get(timeout=10)))
    consumer.start()
    deadline = time.monotonic() + 10
    while not ready._hungry:
        assert time.monotonic() < deadline, "the consumer thread never waited"
        time.sleep(0.005)
    return consumer


def test_a_batch_put_for_a_waiting_consumer_is_handed_over_without_a_permit():
    ready = ReadyQueue(in_order=True)
    got = []
    consumer = _waiting_consumer(ready, got)
    assert ready.put(0, "batch 0") is True  # the engine keeps this batch's permit
    consumer.join(10)
    assert got == [("batch 0", False)]  # and the consumer owes none


def test_batches_put_ahead_of_the_consumer_each_return_a_permit():
    ready = ReadyQueue(in_order=True)
    assert ready.put(1, "batch 1") is False  # nobody waits
    assert ready.put(0, "batch 0") is False
    assert ready.get(timeout=1) == ("batch 0", True)
    assert ready.get_nowait() == (True, "batch 1", True)


def test_only_the_batch_the_consumer_waits_for_is_handed_over_in_order():
    ready = ReadyQueue(in_order=True)
    got = []
    consumer = _waiting_consumer(ready, got)
    assert ready.put(1, "batch 1") is False  # the consumer waits for batch 0
    assert ready.put(2, SKIP) is False
    assert ready.put(0, "batch 0") is True
    consumer.join(10)
    assert got == [("batch 0", False)]
    assert ready.get(timeout=1) == ("batch 1", True)


def test_an_async_waiter_counts_as_waiting():
    ready = ReadyQueue(in_order=False)
    woken = []
    assert ready.when_ready(lambda: woken.append(True)) is True
    assert ready.put(5, "batch 5") is True
    assert woken == [True]
    assert ready.put(6, "batch 6") is False  # the waiter was served already
    assert ready.get_nowait() == (True, "batch 5", False)
    assert ready.get_nowait() == (True, "batch 6", True)
