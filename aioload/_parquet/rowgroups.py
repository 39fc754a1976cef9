"""Row groups fetched by range, decoded once, and kept a while in the process that reads them.

A row group is the unit a Parquet reader can decode: its column chunks hold every row's value,
compressed by page. A read of one row therefore fetches the chunks of the columns asked for
in the row's row group (:func:`fetch`: the footer's byte ranges, neighbours within
:data:`GAP` merged into one request, the requests of a row group in flight together) and
keeps them in the :class:`RowGroupCache` of its process, so every other row of that row group
the order brings there soon is served from the same fetch. The rows of a row group that come
to one worker at once share one fetch in flight.

Decoding (:meth:`Chunks.table`) runs pyarrow over the fetched bytes as if they were the file:
:class:`_Sparse` is a file of the real size that holds only those ranges, and pyarrow, given
the parsed footer, reads nothing else. The decoded table replaces the bytes in the entry.
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Generic, Hashable, Protocol, SupportsInt, TypeVar

import numpy as np

from aioload._storage.storage import Storage, read_buffer

GAP = 64 << 10
"""Column chunks closer than this are fetched in one request, the gap's bytes with them."""


def ranges(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """The ``(offset, length)`` requests that cover the chunks, sorted, neighbours merged."""
    out: list[list[int]] = []
    for start, length in sorted(zip(starts.tolist(), lengths.tolist())):
        if out and start - (out[-1][0] + out[-1][1]) <= GAP:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return [(a, n) for a, n in out]


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``parts`` (``(offset, bytes)``) are known;
    a read elsewhere is an ``OSError`` (the footer promised pyarrow would not ask for it)."""

    def __init__(self, size: int, parts: list[tuple[int, Any]]):
        super().__init__()
        self._size, self._parts, self._pos = size, parts, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), max(0, self._size - self._pos))
        for start, data in self._parts:
            if start <= self._pos and self._pos + n <= start + len(data):
                at = self._pos - start
                buffer[:n] = memoryview(data)[at:at + n]
                self._pos += n
                return n
        raise OSError(f"bytes {self._pos}-{self._pos + n} were not fetched (the footer's column chunk "
                      "ranges do not cover them)")


class Chunks:
    """One row group's fetched column chunks (``parts``: ``(offset, bytes)``), then its decoded
    table. ``nbytes``: what the entry weighs in the cache (fetched bytes, twice: the table
    that replaces them is about their size once decompressed)."""

    def __init__(self, parts: list[tuple[int, Any]]):
        self.parts = parts
        self.nbytes = 2 * sum(len(d) for _, d in parts)
        self._table: Any = None
        self._numeric: set[str] | None = None
        self._error: BaseException | None = None
        self._culprit: tuple[str | None] | None = None  # the column found to fail, once looked for
        self._lock = threading.Lock()

    def __reduce__(self):  # to a process that decodes what another read: the bytes travel
        return (Chunks, (self.parts,))

    def table(self, metadata, size: int, group: int, columns: list[str]) -> Any:
        """The row group's columns as a ``pyarrow.Table``, decoded on first use; a decode that
        failed raises its error again for every row that asks."""
        with self._lock:
            if self._table is None and self._error is None:
                try:
                    self._table = self._read(metadata, size, group, columns)
                    self.parts = []  # the table holds the rows now
                except Exception as exc:  # noqa: BLE001 - kept, and raised for every row of the group
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._table

    def _read(self, metadata, size: int, group: int, columns: list[str]) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = pa.PythonFile(_Sparse(size, self.parts), mode="r")
        reader = pq.ParquetFile(source, metadata=metadata, pre_buffer=False)
        # one thread: the workers are the parallelism (pyarrow's pool would take every core in each)
        return reader.read_row_group(group, columns=columns, use_threads=False)

    def culprit(self, metadata, size: int, group: int, columns: list[str], rows: int) -> str | None:
        """Where the row group failed to decode (or decoded to other than ``rows`` rows): the
        first of ``columns`` that fails read alone, or decodes to another number of rows;
        ``None`` where each reads alone. Looked for once, on the error's path only (the bytes
        are kept while the table is not made)."""
        with self._lock:
            if self._culprit is None:
                found = None
                if self.parts:
                    for name in columns:
                        try:
                            if self._read(metadata, size, group, [name]).num_rows != rows:
                                found = name
                        except Exception:  # noqa: BLE001 - this column is the one that fails
                            found = name
                        if found is not None:
                            break
                self._culprit = (found,)
            return self._culprit[0]


    def numeric_lists(self, table) -> set[str]:
        """The columns of ``table`` that are lists of integers or floats."""
        if self._numeric is None:
            import pyarrow as pa

            def numeric(t) -> bool:
                return pa.types.is_integer(t) or pa.types.is_floating(t)

            self._numeric = {f.name for f in table.schema
                             if (pa.types.is_list(f.type) or pa.types.is_large_list(f.type))
                             and numeric(f.type.value_type)}
        return self._numeric


async def fetch(storage: Storage, url: str, requests: list[tuple[int, int]]) -> Chunks:
    """The ranges of one row group, requested together."""
    async def one(offset: int, length: int) -> tuple[int, Any]:
        data = await read_buffer(storage, url, offset, length)
        if len(data) < length:
            raise OSError(f"{url}: {len(data)} of {length} bytes came back from byte {offset}: the file is "
                          "shorter than its footer says (truncated, or written again since it was read)")
        return offset, data

    return Chunks(list(await asyncio.gather(*(one(a, n) for a, n in requests))))


class _Orphaned(Exception):
    """What the reads waiting for a fetch get when the read that ran it was cancelled."""


class Weighed(Protocol):
    nbytes: int


T = TypeVar("T", bound=Weighed)


class RowGroupCache(Generic[T]):
    """The row groups this process fetched, least recently used dropped first once they weigh
    more than ``max_bytes`` (but ``keep`` are always kept: window mode keeps its open row
    groups). A row group being fetched is shared by every read that asks for it meanwhile.
    Pages (:mod:`aioload._parquet.pages`) are kept in one too: any entry with ``nbytes``."""

    def __init__(self, max_bytes: SupportsInt, keep: int = 1, kind: str = "parquet_row_groups"):
        self.max_bytes, self.keep, self.cache_kind = max_bytes, keep, kind  # its bytes in loader.stats()
        self._done: OrderedDict[Hashable, T] = OrderedDict()
        self._weight = 0
        self._pending: dict[Hashable, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.fetches = 0
        self.hits = 0

    def held_bytes(self) -> int:
        return self._weight

    def __getstate__(self):  # a copy (a spawned worker's) starts empty
        return {"max_bytes": self.max_bytes, "keep": self.keep, "kind": self.cache_kind}

    def __setstate__(self, state):
        self.__init__(state["max_bytes"], state["keep"], state.get("kind", "parquet_row_groups"))

    def peek(self, key: Hashable) -> T | None:
        with self._lock:
            chunks = self._done.get(key)
            if chunks is not None:
                self._done.move_to_end(key)
                self.hits += 1
            return chunks

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        """The entry for ``key``: held, or being fetched by another read (awaited with it), or
        made here by ``make()``. The read that makes it runs the fetch itself (no task of its
        own: a task and a shield cost about 20 µs a fetch, more than the rest of a page read's
        Python); where that read is cancelled, the reads that were waiting for it fetch again."""
        while True:
            chunks = self.peek(key)
            if chunks is not None:
                return chunks
            loop = asyncio.get_running_loop()
            if self._loop is not loop:  # futures of another loop (a blocking read's) cannot be awaited here
                self._loop, self._pending = loop, {}
            pending = self._pending.get(key)
            if pending is None:
                return await self._fetch(key, make, loop)
            try:
                return await asyncio.shield(pending)
            except _Orphaned:
                continue  # the read that fetched it was cancelled: fetch it here

    async def _fetch(self, key: Hashable, make: Callable[[], Awaitable[T]], loop) -> T:
        pending = self._pending[key] = loop.create_future()
        try:
            chunks = await make()
        except BaseException as exc:
            pending.set_exception(_Orphaned() if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else exc)
            pending.exception()  # retrieved: nobody else may be waiting for it
            raise
        finally:
            if self._pending.get(key) is pending:
                del self._pending[key]
        self.put(key, chunks)
        pending.set_result(chunks)
        return chunks

    def used(self, key: Hashable, entry: Any, rows: int) -> None:
        """One more row has been read from ``entry`` (which counts them in ``entry.uses``): once
        ``rows`` have, it leaves the cache, where it is still the one held for ``key``."""
        with self._lock:
            entry.uses += 1
            if entry.uses >= rows and self._done.get(key) is entry:
                del self._done[key]
                self._weight -= entry.nbytes

    def put(self, key: Hashable, chunks: T) -> None:
        """Keep ``chunks`` (fetched by the caller: a read that needed no wait), dropping the
        least recently used past ``max_bytes``."""
        with self._lock:
            self.fetches += 1
            old = self._done.pop(key, None)
            if old is not None:
                self._weight -= old.nbytes
            self._done[key] = chunks
            self._weight += chunks.nbytes
            while self._weight > int(self.max_bytes) and len(self._done) > self.keep:  # an int, or a LoaderShare
                _, dropped = self._done.popitem(last=False)
                self._weight -= dropped.nbytes
