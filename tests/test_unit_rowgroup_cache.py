"""The fetch a :class:`RowGroupCache` shares between the reads that ask for one key meanwhile:
made once; its error reaches every read that waited; a read cancelled while it fetches leaves
those that waited for it to fetch again, not failed; nothing is logged as never retrieved."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from aioload._parquet.rowgroups import RowGroupCache


class Entry:
    def __init__(self, value):
        self.value, self.nbytes = value, 10


class Maker:
    """``make()`` for the cache: counts its calls; each waits for ``release`` before it returns
    (or raises ``error``)."""

    def __init__(self, error: Exception | None = None):
        self.calls = 0
        self.error = error
        self.release = asyncio.Event()

    async def __call__(self) -> Entry:
        self.calls += 1
        call = self.calls
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return Entry(call)


@pytest.fixture
def asyncio_log(caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    yield caplog
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_reads_of_one_key_meanwhile_share_one_fetch_and_later_ones_a_held_entry(asyncio_log):
    async def main():
        cache, make = RowGroupCache(1 << 20), Maker()
        reads = [asyncio.ensure_future(cache.get("k", make)) for _ in range(3)]
        await asyncio.sleep(0.01)
        make.release.set()
        got = await asyncio.gather(*reads)
        later = await cache.get("k", make)
        return make.calls, got, later

    calls, got, later = asyncio.run(main())
    assert calls == 1
    assert got[0] is got[1] is got[2] is later


def test_a_failed_fetch_fails_every_read_that_waited_for_it_and_the_next_read_fetches_again(asyncio_log):
    async def main():
        cache, make = RowGroupCache(1 << 20), Maker(OSError("gone"))
        reads = [asyncio.ensure_future(cache.get("k", make)) for _ in range(3)]
        await asyncio.sleep(0.01)
        make.release.set()
        results = await asyncio.gather(*reads, return_exceptions=True)
        make.error = None
        again = await cache.get("k", make)
        return make.calls, results, again

    calls, results, again = asyncio.run(main())
    assert [type(r) for r in results] == [OSError] * 3 and all(str(r) == "gone" for r in results)
    assert calls == 2 and again.value == 2


def test_a_failed_fetch_nobody_waited_for_logs_nothing(asyncio_log):
    async def main():
        cache, make = RowGroupCache(1 << 20), Maker(OSError("gone"))
        make.release.set()
        with pytest.raises(OSError, match="gone"):
            await cache.get("k", make)

    asyncio.run(main())


def test_a_read_cancelled_while_it_fetches_leaves_the_waiting_reads_to_fetch_again(asyncio_log):
    async def main():
        cache, make = RowGroupCache(1 << 20), Maker()
        first = asyncio.ensure_future(cache.get("k", make))
        await asyncio.sleep(0.01)  # first is fetching
        waiting = [asyncio.ensure_future(cache.get("k", make)) for _ in range(2)]
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)  # the waiting reads start their own fetch: one of them fetches
        make.release.set()
        got = await asyncio.gather(*waiting)
        return first, make.calls, got

    first, calls, got = asyncio.run(main())
    assert first.cancelled()
    assert calls == 2  # the cancelled fetch, and one more shared by the two that waited
    assert got[0] is got[1] and got[0].value == 2


def test_a_waiting_read_cancelled_leaves_the_fetch_to_the_others(asyncio_log):
    async def main():
        cache, make = RowGroupCache(1 << 20), Maker()
        first = asyncio.ensure_future(cache.get("k", make))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(cache.get("k", make))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.01)
        make.release.set()
        return waiting, await first, make.calls

    waiting, got, calls = asyncio.run(main())
    assert waiting.cancelled() and calls == 1 and got.value == 1
