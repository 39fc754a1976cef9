"""Receive buffers reused once nobody holds them (``aioload._storage.buffers.Buffers``): a
buffer the caller still holds -- itself, a view of it, a part of it -- is never given to another
body; one let go of is, at the size asked; over the real HTTP server each body keeps its own
bytes."""

from __future__ import annotations

import asyncio
import gc

import aioload
from aioload._data.reads import BufferPart
from aioload._storage.buffers import Buffers
from aioload._storage import scope as _scope
from aioload._storage.storage import read_buffer
from tests.httpserver import Server
from tests.resources import fd_count


def test_a_held_buffer_is_never_given_again_and_one_let_go_of_is():
    buffers = Buffers()
    first = buffers.take(1000)
    second = buffers.take(1000)
    assert first is not second and len(first) == len(second) == 1000
    kept = id(first)
    del first
    again = buffers.take(900)
    assert id(again) == kept and len(again) == 900  # shrunk to the size asked
    held = id(second)
    view = memoryview(second)[10:20]
    del second
    other = buffers.take(1000)
    assert id(other) != held  # a view of it is still held
    view.release()
    part, parted = BufferPart(other, 0, 10), id(other)
    del other
    reused = buffers.take(1000)
    assert id(reused) == held  # free again once its view was released
    fresh = buffers.take(1000)
    assert len(fresh) == 1000 and id(fresh) not in (kept, held, parted)  # the part holds its buffer
    assert bytes(part.view()) == bytes(10)


def test_a_buffer_too_far_from_the_size_asked_is_not_reused():
    buffers = Buffers()
    small = buffers.take(100)
    kept = id(small)
    del small
    assert id(buffers.take(1000)) != kept and len(buffers.take(1000)) == 1000


def test_bodies_received_into_reused_buffers_keep_their_own_bytes(tmp_path):
    files = {f"f{i}": bytes([i]) * (50_000 + 1000 * i) for i in range(4)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    storage = aioload.Storage()
    fds = fd_count()
    with Server(tmp_path) as server:
        async def main():
            held = await read_buffer(storage, server.url("f0"), 100, 40_000)
            seen = []
            for name in ("f1", "f2", "f3", "f1"):
                body = await read_buffer(storage, server.url(name), 0, len(files[name]))
                seen.append((name, id(body), bytes(body)))
                del body  # let go of: the next body may land in it
            return bytes(held), id(held), seen

        held, held_id, seen = asyncio.run(main())
    assert held == files["f0"][100:40_100]
    assert all(data == files[name] for name, _, data in seen)
    assert held_id not in {body_id for _, body_id, _ in seen}  # held all along: never reused
    assert len({body_id for _, body_id, _ in seen}) < len(seen)  # let go of: reused
    gc.collect()
    assert _scope.open_scopes() == 0 and fd_count() <= fds  # (an earlier test's may close meanwhile)
