"""Uniform mode's range reads joined where samples of one shard lie close together
(``aioload._shards.coalesce``), over the real HTTP server on 127.0.0.1 and local files: each
sample gets the same bytes, in the same order, as when every sample is asked for alone; the
gap threshold decides what is joined; a joined request that fails leaves each sample its own
read and its own error; nothing is left open."""

from __future__ import annotations

import asyncio
import gc

import pytest

import aioload
from aioload._data.reads import BatchReads, BufferPart, FailedRead
from aioload._shards import coalesce
from aioload._storage import scope as _scope
from tests.httpserver import serving_copy
from tests.resources import fd_count
from tests.shards_data import image_samples, write_aioload

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own

RETRY = aioload.RetryPolicy(attempts=2, backoff=0.01, timeout=10)


@pytest.fixture(scope="module")
def folder(image_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("coalesced")
    write_aioload(image_samples(image_root), root, 10)
    return root


@pytest.fixture
def server(folder, tmp_path):
    with serving_copy(folder, tmp_path) as s:
        yield s


def dataset(where: str, folder, server=None, **kwargs) -> aioload.WebDataset:
    base = server.url("") if where == "http" else str(folder) + "/"
    return aioload.WebDataset(base + "aio-{000000..000004}.tar", storage=aioload.Storage(retry=RETRY), **kwargs)


def read_together(ds, indices) -> list:
    """``ds.read`` of every index started at once (as a worker starts a task's reads)."""
    async def main():
        return await asyncio.gather(*(ds.read(i) for i in indices))

    return asyncio.run(main())


def contents(ds, raws) -> list[dict]:
    return [ds.members(raw) for raw in raws]


# A shard's samples out of order, two of another shard, a sample read twice, one of a third shard.
INDICES = [3, 0, 1, 2, 5, 4, 9, 12, 11, 7, 3, 25]


@pytest.mark.parametrize("where", ["http", "local"])
def test_joined_reads_give_each_sample_its_own_bytes_in_order(where, folder, request):
    server = request.getfixturevalue("server") if where == "http" else None
    joined, alone = dataset(where, folder, server), dataset(where, folder, server, coalesce_gap=None)
    fds = fd_count()
    before = len(server.ranges) if server else 0
    raws = read_together(joined, INDICES)
    asked = len(server.ranges) - before if server else None
    assert [index for _, index in raws] == INDICES
    assert sum(isinstance(data, BufferPart) for data, _ in raws) >= 6  # shard 0's reads shared requests
    assert contents(joined, raws) == contents(alone, read_together(alone, INDICES))
    for (data, index) in raws:
        assert len(data) == joined._ends[index] - joined._starts[index]
    if server is not None:
        assert asked < len(INDICES)
    del raws
    gc.collect()
    assert _scope.open_scopes() == 0 and fd_count() <= fds  # (an earlier test's may close meanwhile)


def test_the_loader_delivers_the_same_samples_with_and_without_joined_reads(server, folder):
    def keys_and_digests(ds):
        from tests.shards_data import fingerprint

        ds._decode_fn = fingerprint
        with aioload.DataLoader(ds, batch_size=8, shuffle=True, seed=3, num_workers=2) as loader:
            return [row for keys, digests, classes in loader for row in zip(keys, digests, classes.tolist())]

    assert keys_and_digests(dataset("http", folder, server)) == keys_and_digests(
        dataset("http", folder, server, coalesce_gap=None))


def test_the_gap_threshold_decides_what_is_joined(server, folder):
    probe = dataset("http", folder, server)
    gap = int(probe._starts[2] - probe._ends[0])  # samples 0 and 2 of the first shard, sample 1 between them
    assert gap > 0
    for threshold, expected in [(gap - 1, [(0, 0), (2, 2)]), (gap, [(0, 2)])]:
        ds = dataset("http", folder, server, coalesce_gap=threshold)
        before = len(server.ranges)
        raws = read_together(ds, [0, 2])
        asked = sorted(server.ranges[before:])
        assert asked == sorted(f"bytes={ds._starts[a]}-{ds._ends[b] - 1}" for a, b in expected)
        assert contents(ds, raws) == contents(probe, [probe.read_blocking(0), probe.read_blocking(2)])


def test_a_joined_request_that_fails_leaves_each_sample_its_own_read_and_error(server, folder):
    ds = dataset("http", folder, server)
    server.script("aio-000000.tar", 404)  # the first request of the shard: the joined one
    indices = [0, 1, 2, 3]

    async def main():
        core = BatchReads(ds, bound=asyncio.Semaphore(8), read_timeout=None, place=" in a test")
        return await core.read(indices)

    raws, _, _ = asyncio.run(main())
    failed = [(index, raw) for index, raw in zip(indices, raws) if isinstance(raw, FailedRead)]
    assert len(failed) == 1  # the read that made the joined request; the others asked alone
    index, raw = failed[0]
    error = raw.error
    assert isinstance(error, aioload.RemoteReadError) and error.status == 404 and "aio-000000.tar" in str(error)
    assert f"while reading dataset index {index} (shard " in error.__notes__[-1]
    assert repr(ds.key(index)) in error.__notes__[-1] and error.__notes__[-1].endswith(" in a test")
    good = [(i, raw) for i, raw in zip(indices, raws) if not isinstance(raw, FailedRead)]
    assert contents(ds, [raw for _, raw in good]) == contents(ds, [ds.read_blocking(i) for i, _ in good])
    assert _scope.open_scopes() == 0


def test_a_storage_with_a_cache_reads_each_sample_alone(server, folder):
    ds = aioload.WebDataset(server.url("aio-{000000..000004}.tar"), coalesce_gap=1 << 20,
                            storage=aioload.Storage(retry=RETRY, cache=aioload.MemoryCache(1 << 24)))
    before = len(server.ranges)
    raws = read_together(ds, [0, 1, 2])
    assert len(server.ranges) - before == 3 and not any(isinstance(data, BufferPart) for data, _ in raws)


@pytest.mark.parametrize("gap", [-1, 1.5, True, "64k"])
def test_a_bad_gap_is_refused(folder, gap):
    with pytest.raises(ValueError, match=r"^coalesce_gap must be an int >= 0 \(bytes\) or None, got "):
        aioload.WebDataset(str(folder) + "/aio-000000.tar", coalesce_gap=gap)


def test_listing_pauses_where_reads_rarely_meet_and_looks_again_after():
    data = bytes(range(256)) * 64
    asked = []

    async def fetch(offset, length):  # a store of its own: the bytes of ``data``
        asked.append((offset, length))
        return bytearray(data[offset:offset + length])

    async def main():
        ranges = coalesce.Ranges()

        async def together(*spans):
            return await asyncio.gather(*(coalesce.read(ranges, "u", s, e, 0, 1 << 20, fetch) for s, e in spans))

        for _ in range(coalesce.PROBE // 2):  # pairs that meet: listing pays, and goes on
            assert [bytes(p.view()) for p in await together((0, 10), (10, 30))] == [data[0:10], data[10:30]]
        assert ranges.alone == 0
        for i in range(coalesce.PROBE):  # reads that never meet: listing stops paying
            await together((i, i + 1))
        assert ranges.alone == coalesce.PROBE * coalesce.PAUSE
        asked.clear()
        assert [bytes(p) for p in await together((0, 10), (10, 30))] == [data[0:10], data[10:30]]
        assert asked == [(0, 10), (10, 20)]  # paused: each alone
        while ranges.alone:
            await together((5, 6))
        asked.clear()
        parts = await together((0, 10), (10, 30))
        assert asked == [(0, 30)] and [bytes(p.view()) for p in parts] == [data[0:10], data[10:30]]

    asyncio.run(main())
