"""Uniform mode's range reads, joined where they lie close together in one shard.

Each sample of uniform mode is one range request. Reads that start in the same turn of an
event loop (a task's reads, started together in a worker) and fall in the same shard less
than ``gap`` bytes apart are asked for with one request, and each sample gets its own part of
that request's buffer (:class:`~aioload._data.reads.BufferPart`), so what a sample's read returns is
the same bytes as before, and ``decode`` checks them the same way.

How a turn's reads find each other, without a task or a timer of their own: each read lists
its range under its shard (:class:`Ranges`, one per event loop and dataset), yields once
(``asyncio.sleep(0)``), and the first of them to run again takes the listed ranges next to its
own (each gap at most ``gap``, the whole at most ``most`` bytes) into one request that it
makes itself, in its own task (its timeout, its retries, its statistics). The reads it took
wait for that request; when it fails or is cancelled, each of them asks for its own range
alone, so that an error still belongs to one sample and names it. A read that nobody took
makes its own request, as it did before.

A joined request costs the bytes between its samples (counted as arrived and not returned,
:mod:`aioload._storage.arrived`); it saves a request's round of CPU in the worker (the request
and response heads, the socket's system calls, the futures that wait for them). Listing and
yielding cost every read a turn of the loop, a few microseconds, which pays only where reads
meet: in order (``shuffle=False``) nearly all of a task's do, in a uniform shuffle over many
shards almost none (about ``reads in flight x 3 / samples`` of them). So each loop's
:class:`Ranges` counts: when fewer than 1 in :data:`RARE` of :data:`PROBE` listed reads were
joined, the next ``PROBE x`` :data:`PAUSE` reads go alone, unlisted, and then it looks again.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from aioload._data.reads import BufferPart
from aioload._storage import arrived

GAP = 64 * 1024
"""Bytes between two samples of a shard up to which their reads are joined (the default of
``WebDataset(coalesce_gap=...)``): about one ImageNet JPEG, read in less CPU than a request costs."""

MOST = 8 << 20
"""The most bytes one joined request asks for."""

PROBE = 256
"""Listed reads over which a loop counts how many were joined."""

RARE = 50
"""Fewer than one joined read in this many listed is too few to pay for the listing."""

PAUSE = 15
"""After too few joins, reads go alone for this many times :data:`PROBE` reads."""


class _Wanted:
    """One read's range, listed for this turn of the loop; ``taken``: a future once another
    read took it into its request (its result: this read's part, or ``None``: ask alone)."""

    __slots__ = ("start", "end", "taken")

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.taken: asyncio.Future | None = None


class Ranges:
    """The ranges listed on one event loop, by shard URL, and how often listing paid."""

    __slots__ = ("listed", "tried", "joined", "alone")

    def __init__(self) -> None:
        self.listed: dict[str, list[_Wanted]] = {}
        self.tried = 0  # reads listed since the last count
        self.joined = 0  # of those, reads that shared a request
        self.alone = 0  # reads still to go alone, unlisted, before listing again

    def counted(self, tried: int, joined: int) -> None:
        self.tried += tried
        self.joined += joined
        if self.tried >= PROBE:
            if self.joined * RARE < self.tried:
                self.alone = PROBE * PAUSE
            self.tried = self.joined = 0

    async def close(self) -> None:
        self.listed.clear()


async def read(ranges: Ranges, url: str, start: int, end: int, gap: int, most: int,
               fetch: Callable[[int, int], Awaitable]) -> object:
    """The bytes ``[start, end)`` of ``url``: ``fetch(offset, length)``'s result for this
    range alone, or this range's :class:`BufferPart` of a request joined with others."""
    if ranges.alone:
        ranges.alone -= 1
        return await fetch(start, end - start)
    mine = _Wanted(start, end)
    listed = ranges.listed.setdefault(url, [])
    listed.append(mine)
    try:
        await asyncio.sleep(0)  # the reads that start in this turn of the loop are listed by now
    except BaseException:
        _unlist(ranges, url, listed, mine)
        raise
    if mine.taken is not None:  # a read that ran first took this range into its request
        ranges.counted(1, 1)
        part = await mine.taken
        return part if part is not None else await fetch(start, end - start)
    _unlist(ranges, url, listed, mine)
    group = _join(listed, mine, gap, most)
    if not listed and ranges.listed.get(url) is listed:
        del ranges.listed[url]
    ranges.counted(1, 1 if group else 0)
    if not group:
        return await fetch(start, end - start)
    lo = min(w.start for w in group + [mine])
    hi = max(w.end for w in group + [mine])
    try:
        data = await fetch(lo, hi - lo)
    except BaseException:
        for w in group:  # each asks alone: its own error, its own sample's name
            if not w.taken.done():
                w.taken.set_result(None)
        raise
    size = len(data)
    for w in group:
        if not w.taken.done():
            w.taken.set_result(BufferPart(data, min(w.start - lo, size), min(w.end - lo, size)))
    wanted = sum(w.end - w.start for w in group) + end - start
    if size > wanted:
        arrived.dropped(size - wanted)  # the gaps between the samples
    return BufferPart(data, min(start - lo, size), min(end - lo, size))


def _unlist(ranges: Ranges, url: str, listed: list[_Wanted], mine: _Wanted) -> None:
    try:
        listed.remove(mine)
    except ValueError:
        pass
    if not listed and ranges.listed.get(url) is listed:
        del ranges.listed[url]


def _join(listed: list[_Wanted], mine: _Wanted, gap: int, most: int) -> list[_Wanted]:
    """Take out of ``listed`` the ranges that join ``mine`` (each next one starting at most
    ``gap`` bytes after the end so far, the whole at most ``most`` bytes), each given a
    future; those taken."""
    if not listed:
        return []
    ordered = sorted(listed, key=lambda w: w.start)
    lo, hi = mine.start, mine.end
    taken: list[_Wanted] = []
    after = [w for w in ordered if w.start >= mine.start]
    for w in after:  # to the right of mine, nearest first
        if w.start - hi > gap or max(hi, w.end) - lo > most:
            break
        hi = max(hi, w.end)
        taken.append(w)
    for w in reversed([w for w in ordered if w.start < mine.start]):  # to the left, nearest first
        if lo - w.end > gap or hi - w.start > most:
            break
        lo = w.start
        hi = max(hi, w.end)
        taken.append(w)
    if not taken:
        return []
    loop = asyncio.get_running_loop()
    for w in taken:
        listed.remove(w)
        w.taken = loop.create_future()
    return taken
