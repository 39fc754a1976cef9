"""Buffers that bytes are read into, reused once nobody holds them.

A read that returns a new ``bytearray`` of a few hundred KiB each time costs its process more
than the read: the allocator gives the pages back (or keeps them for other sizes) and they are
faulted in again, zeroed. :class:`Buffers` keeps the buffers it gave and gives one again once
its reference count says that only this object holds it. The HTTP client receives bodies of
known length into them (:mod:`aioload._storage.h1`); local reads of the page cache read into
them (:mod:`aioload._storage.nowait`).
"""

from __future__ import annotations

import sys

REUSED = 128
"""The most buffers one :class:`Buffers` keeps for reuse: about the reads a worker has in flight."""
REUSED_MOST = 16 << 20
"""The most bytes of buffers one :class:`Buffers` keeps for reuse."""
REUSED_LOOK = 8
"""Kept buffers looked at for a free one per read, at most: where every buffer is held (the
worker's reads waiting to be decoded outnumber them) a new one costs less than a longer look."""


def _refs_when_free() -> int:
    """``sys.getrefcount`` of a buffer that only a list holds, read as :class:`Buffers` reads
    it (in a loop over the list): the count differs between Python versions."""
    kept = [bytearray(1)]
    for buf in kept:
        return sys.getrefcount(buf)
    return 0


_FREE = _refs_when_free()


class Buffers:
    """Buffers reused once nothing but this object holds them: a read's ``bytearray`` goes to
    the caller, and comes back into use when the caller (and every view of it, every part of it
    still to be taken apart) has let go of it, which its reference count tells. Not thread-safe:
    one thread takes from one :class:`Buffers` at a time. A fresh buffer for each range
    request cost the worker more than the request's Python: the allocator gave its pages back
    and faulted them in again, zeroed (py-spy: 18 % of a 72 KB ranged GET's CPU in
    ``bytearray(n)``). At most :data:`REUSED` buffers and :data:`REUSED_MOST` bytes are kept;
    :data:`REUSED_LOOK` of them are looked at in turn, from the one after the last reused (they
    tend to be let go of in the order they were taken)."""

    __slots__ = ("_kept", "_bytes", "_next")

    def __init__(self) -> None:
        self._kept: list[bytearray] = []
        self._bytes = 0
        self._next = 0

    def take(self, n: int) -> bytearray:
        """A buffer of exactly ``n`` bytes (its old bytes left in it: the caller writes them all)."""
        kept = self._kept
        count = len(kept)
        for step in range(min(count, REUSED_LOOK)):
            at = (self._next + step) % count
            buf = kept[at]
            if sys.getrefcount(buf) == _FREE and n // 2 <= len(buf) <= 2 * n:
                self._next = at + 1
                self._bytes += n - len(buf)
                if len(buf) > n:
                    del buf[n:]
                elif len(buf) < n:
                    buf.extend(bytes(n - len(buf)))
                return buf
        self._next = (self._next + REUSED_LOOK) % count if count else 0  # look further on next time
        buf = bytearray(n)
        if count < REUSED and self._bytes + n <= REUSED_MOST:
            kept.append(buf)
            self._bytes += n
        return buf
