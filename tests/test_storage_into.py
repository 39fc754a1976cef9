"""A whole object received straight into a caller's buffer (``_storage.storage.read_into``,
``h1.Connection.read_into``), as window mode receives a shard into its memfd: the bytes
arrive intact over HTTP (sized, chunked) and from a local file, a body cut short or a retry
after a cut leaves the right bytes or a clear error, what the server sends beyond its
``Content-Length`` never lands in the buffer nor answers the next read, and nothing is left
behind (connections, descriptors, shared memory, /dev/shm)."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

import aioload
from aioload._handoff.shared import SharedPool
from aioload._storage.storage import read_into
from tests.resources import Snapshot, assert_released
from tests.httpserver import Server
from tests.test_http_client import BIG, LOOPS, ONCE, THRICE, Raw, chunked, open_connections, response, run


class Into:
    """Buffers from a real :class:`SharedPool` (memfds), as the window takes them: ``sizes``
    lists each size asked for; ``last`` is the last buffer given (the one a read fills)."""

    def __init__(self):
        self.pool = SharedPool(0, "aioload-shard")
        self.sizes: list[int] = []
        self.last = None

    def __call__(self, size: int) -> memoryview:
        self.sizes.append(size)
        self.last = self.pool.take(size)
        return self.last.view()

    def data(self) -> bytes:
        return self.last.view().tobytes()


@LOOPS
def test_a_sized_body_lands_in_the_buffer_intact_and_the_connection_is_reused(loop):
    async def main():
        async with Raw(lambda n: response(BIG + b"%d" % n)) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = []
            for _ in range(3):
                into = Into()
                size = await read_into(storage, srv.url(), into)
                got.append((size, into.sizes, into.data()))
            await storage.aclose()
            return got, srv.connections

    got, connections = run(main, loop)
    assert got == [(len(BIG) + 1, [len(BIG) + 1], BIG + b"%d" % n) for n in range(3)]
    assert connections == 1  # each body read to its end: the connection went back to the pool


def test_a_chunked_body_is_gathered_and_copied_in_intact():
    async def main():
        async with Raw(lambda n: chunked([BIG[:70_000], BIG[70_000:]])) as srv:
            into = Into()
            size = await read_into(aioload.Storage(retry=ONCE), srv.url(), into)
            return size, into.sizes, into.data()

    assert run(main) == (len(BIG), [len(BIG)], BIG)


def test_a_local_file_is_read_into_the_buffer_intact(tmp_path):
    data = os.urandom(3 << 20) + b"end"
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    into = Into()
    size = asyncio.run(read_into(aioload.Storage(), path, into))
    assert (size, into.sizes, into.data()) == (len(data), [len(data)], data)
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    into = Into()
    assert asyncio.run(read_into(aioload.Storage(), empty, into)) == 0 and into.data() == b""


def test_a_missing_local_file_names_itself_and_takes_no_buffer(tmp_path):
    into = Into()
    with pytest.raises(FileNotFoundError, match="nothere.tar"):
        asyncio.run(read_into(aioload.Storage(), tmp_path / "nothere.tar", into))
    assert into.sizes == []


@LOOPS
def test_a_body_cut_mid_way_fails_clearly_and_leaves_nothing(loop):
    whole = response(BIG)
    broken = whole[:-50_000]
    before = Snapshot.take()

    async def main():
        async with Raw(lambda n: (broken, "close")) as srv:
            storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=2, backoff=0.001))
            into = Into()
            with pytest.raises(aioload.RemoteReadError) as info:
                await read_into(storage, srv.url(), into)
            left = len(open_connections())
            await storage.aclose()
            return info.value, into.sizes, srv.requests, left

    err, sizes, requests, left = run(main, loop)
    assert re.match(r"^GET \S+ failed after 2 attempts; last status: HTTP 200 \(truncated body: the server "
                    r"closed the connection after \d+ of 204800 bytes", str(err))
    assert sizes == [len(BIG), len(BIG)] and requests == 2 and left == 0
    del err
    assert_released(before)


@LOOPS
def test_a_retry_after_a_cut_rewrites_a_fresh_buffer_from_its_start(loop):
    whole = response(BIG)
    broken = response(b"\xff" * len(BIG))[:-50_000]  # the cut attempt's bytes differ from the object's

    async def main():
        async with Raw(lambda n: (broken, "close") if n == 0 else whole) as srv:
            into = Into()
            size = await read_into(aioload.Storage(retry=THRICE), srv.url(), into)
            return size, into.sizes, into.data(), srv.requests

    size, sizes, data, requests = run(main, loop)
    assert (size, sizes, requests) == (len(BIG), [len(BIG), len(BIG)], 2)
    assert data == BIG


@LOOPS
def test_what_a_server_sends_beyond_its_content_length_stays_out_of_the_buffer(loop):
    # Each answer is followed by a whole second response: it must land neither in this read's
    # buffer nor in the next read's, on a reused connection.
    async def main():
        async with Raw(lambda n: response(BIG + b"%d" % n) + response(b"stale")) as srv:
            storage = aioload.Storage(retry=ONCE)
            got = []
            for _ in range(3):
                into = Into()
                await read_into(storage, srv.url(), into)
                got.append(into.data())
            await storage.aclose()
            return got, srv.requests, srv.connections

    got, requests, connections = run(main, loop)
    assert got == [BIG + b"%d" % n for n in range(3)]
    assert requests == connections == 3  # a connection with bytes left unread is never reused


def test_a_read_cancelled_mid_body_leaves_nothing():
    before = Snapshot.take()

    async def main():
        async with Raw(lambda n: (response(BIG)[:-50_000], "hang")) as srv:
            storage = aioload.Storage(retry=ONCE)
            into = Into()
            task = asyncio.ensure_future(read_into(storage, srv.url(), into))
            while srv.requests == 0 or not into.sizes:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            left = len(open_connections())
            await storage.aclose()
            return into.sizes, left

    sizes, left = run(main)
    assert sizes == [len(BIG)] and left == 0
    assert_released(before)


def test_the_test_servers_truncated_shard_fails_naming_its_url_and_retries_to_the_right_bytes(tmp_path):
    data = os.urandom(1 << 20)
    (tmp_path / "a.tar").write_bytes(data)
    before = Snapshot.take()
    with Server(tmp_path) as server:
        server.script("a.tar", "truncate", "truncate")
        once = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=30))
        with pytest.raises(aioload.RemoteReadError, match=re.escape(server.url("a.tar")) + ".*truncated body"):
            asyncio.run(read_into(once, server.url("a.tar"), Into()))
        into = Into()
        again = aioload.Storage(retry=aioload.RetryPolicy(attempts=2, backoff=0.001, timeout=30))
        assert asyncio.run(read_into(again, server.url("a.tar"), into)) == len(data)
        assert into.data() == data and into.sizes == [len(data), len(data)]
        del into
    assert_released(before)


@LOOPS
@pytest.mark.parametrize("where", ["http", "local"])
def test_the_window_receives_a_shard_into_shared_memory_without_a_buffer_of_its_size(tmp_path, where, loop):
    import numpy as np
    import tracemalloc

    from aioload._shards.window import Window

    data = os.urandom(8 << 20)
    (tmp_path / "a.tar").write_bytes(data)
    before = Snapshot.take()
    with Server(tmp_path) as server:
        url = server.url("a.tar") if where == "http" else str(tmp_path / "a.tar")
        window = Window([url], lambda idx: np.zeros(len(idx), dtype=np.int64), 1, aioload.Storage(), 1, 0)

        async def main():
            tracemalloc.start()
            try:
                held = await window.fetched(0)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            return held.view().tobytes() == data, type(held).__name__, window.held_bytes, peak

        intact, kind, counted, peak = run(main, loop)
    assert (intact, kind, counted) == (True, "SharedBytes", len(data))
    assert peak < len(data) // 8  # received in place: no bytearray (nor bytes) of the shard's size
    assert window.held_bytes == 0  # the loop's end let go of the shard
    del window
    assert_released(before)
