"""A row's pages fetched by range and kept a while in the process that reads them.

What a row needs (:meth:`aioload._parquet.pageindex.FilePages.pieces`: a data page of each
leaf read by page, the chunk's dictionary page where that page may use it, or a small chunk
whole) is fetched together, each piece once per process while the :class:`~aioload.
_parquet.rowgroups.RowGroupCache` of pages holds it (a page being fetched is shared by every
read that needs it meanwhile). A data page that turns out dictionary-encoded against the
writer's encoding statistics costs one more request for its dictionary page.

:class:`RowPages` is what a read returns; :meth:`RowPages.value` decodes it (in the worker)
into a column's value with :mod:`aioload._parquet.values`.
"""

from __future__ import annotations

import asyncio
from typing import Any, SupportsInt

from aioload._parquet.pageindex import FilePages, Leaf
from aioload._parquet.rowgroups import RowGroupCache
from aioload._parquet.values import Entries, column_value, dictionary, leaf_value, needs_dictionary, page_values
from aioload._storage.nowait import NoWait
from aioload._storage.storage import Storage, read_buffer


class Piece:
    """Fetched bytes of a file: ``data`` from byte ``offset``; ``nbytes``, its weight in a cache;
    ``decoded``: a small chunk's pages decoded whole, by their position in ``data``, and a
    dictionary page's entries (key ``("dict", position)``); ``uses``: the rows read from it."""

    def __init__(self, offset: int, data: Any):
        self.offset, self.data, self.nbytes = offset, data, len(data)
        self.decoded: dict[Any, list] = {}
        self.uses = 0


async def fetch_piece(storage: Storage, url: str, offset: int, length: int) -> Piece:
    data = await read_buffer(storage, url, offset, length)
    if len(data) < length:
        raise OSError(f"{url}: {len(data)} of {length} bytes came back from byte {offset}: the file is "
                      "shorter than its footer says (truncated, or written again since it was read)")
    return Piece(offset, data)


WHOLE_PAGE_ROWS = 1 << 16
"""A small chunk's page of up to this many rows is decoded whole once (its rows kept as Python
values); a longer one (a few bytes of RLE can hold 2**31 nulls) is decoded a row at a time."""


def _entries(piece: Piece, at: int, codec: str | None, leaf: Leaf) -> Entries:
    """The dictionary page at ``piece.data[at]``, decoded on first use and kept with the piece."""
    def entries() -> list:
        found = piece.decoded.get(("dict", at))
        if found is None:
            found = piece.decoded[("dict", at)] = dictionary(piece.data, at, codec, leaf)
        return found
    return entries


class RowPages:
    """What one row needs of the columns read by page: the pieces (by key), the page index,
    and where the row is (``group``, ``row`` within it)."""

    def __init__(self, group: int, row: int, index: tuple[int, Any], pieces: dict[Any, Piece]):
        self.group, self.row, self.index, self.pieces = group, row, index, pieces

    def __reduce__(self):  # to a process that decodes what another read: the bytes travel
        return (RowPages, (self.group, self.row, self.index, self.pieces))

    def leaf_value(self, plan: FilePages, leaf: Leaf) -> tuple[int, Any]:
        chunk = plan.chunks[self.group][leaf.index]
        page_at, first, rows = plan.locate(self.index, self.group, self.row, leaf)
        whole = self.pieces.get((self.group, leaf.index, "chunk"))
        entries = None
        if whole is not None and rows > WHOLE_PAGE_ROWS:  # a long page in a small chunk (a run of nulls, say)
            if chunk.dictionary is not None:
                entries = _entries(whole, chunk.dictionary - whole.offset, chunk.codec, leaf)
            return leaf_value(whole.data, page_at - whole.offset, chunk.codec, self.row - first, leaf, entries, rows)
        if whole is not None:  # a small chunk: its page decoded once for every row that comes to it
            at = page_at - whole.offset
            decoded = whole.decoded.get(at)
            if decoded is None:
                if chunk.dictionary is not None:
                    entries = _entries(whole, chunk.dictionary - whole.offset, chunk.codec, leaf)
                decoded = whole.decoded[at] = page_values(whole.data, at, chunk.codec, leaf, entries, rows)
            return decoded[self.row - first]
        page = self.pieces[self.group, leaf.index, plan.page_of(self.index, self.group, leaf.index, self.row)]
        found = self.pieces.get((self.group, leaf.index, "dict"))
        if found is not None:
            entries = _entries(found, 0, chunk.codec, leaf)
        return leaf_value(page.data, 0, chunk.codec, self.row - first, leaf, entries, rows)

    def value(self, plan: FilePages, column: str) -> Any:
        """The row's value of a column read by page."""
        node = plan.nodes[column]
        return column_value(node, {leaf.index: self.leaf_value(plan, leaf) for leaf in node.leaves()})


def _unannounced_dictionary(plan: FilePages, group: int, leaf: Leaf, pieces: dict) -> tuple[Any, int, int] | None:
    """``(key, offset, length)`` of the dictionary page ``leaf``'s data page in ``pieces`` is
    coded against where the writer's encoding statistics did not say so (it was not asked for
    with the page); ``None`` where none is needed beyond ``pieces``."""
    chunk = plan.chunks[group][leaf.index]
    if chunk.dictionary is None or (group, leaf.index, "chunk") in pieces:
        return None
    key, offset, length = plan.dictionary(group, leaf.index)
    if key in pieces:
        return None
    page = pieces[next(k for k in pieces if k[1] == leaf.index and k[2] != "dict")]
    return (key, offset, length) if needs_dictionary(page.data, 0) else None


class PageReader:
    """The pages of one dataset's files, fetched and kept in this process: the page index of
    each file (once) and the pages rows need (bounded by ``max_bytes``).

    A data page leaves the cache once this process has read every one of its rows: an epoch
    reads a row once, so such a page would not be asked for again before the next epoch, and
    held it would only push out pages whose rows are still to come. A page of one row (an
    image, say) goes as soon as its row is read; its buffer is read into again once the row is
    decoded (:class:`~aioload._storage.buffers.Buffers`), where kept it took fresh memory for
    every row until the cache was full (``max_bytes`` of pages no row would ask for again in
    the epoch, and a fresh buffer faulted in for each). Dictionary pages and small chunks serve
    many rows and stay while the cache has room."""

    def __init__(self, max_bytes: SupportsInt):
        self.max_bytes = max_bytes
        self.pages: RowGroupCache[Piece] = RowGroupCache(max_bytes, 1, kind="parquet_pages")
        # a file's page index is a few bytes a page: kept
        self.indexes: RowGroupCache[Piece] = RowGroupCache(1 << 62, 1, kind="parquet_pages")
        self.nowait = NoWait()  # a local page already in the page cache: read here, no trip through the loop

    def __getstate__(self):  # a copy (a spawned worker's) starts empty
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state):
        self.__init__(state["max_bytes"])

    def index_nowait(self, f: int) -> tuple[int, Any] | None:
        piece = self.indexes.peek(f)
        return None if piece is None else (piece.offset, piece.data)

    async def index(self, storage: Storage, url: str, f: int, plan: FilePages) -> tuple[int, Any]:
        span = plan.index_range()
        if span is None:
            return 0, b""
        piece = await self.indexes.get(f, lambda: fetch_piece(storage, url, *span))
        return piece.offset, piece.data

    def read_nowait(self, storage: Storage, url: str, f: int, plan: FilePages, group: int,
                    row: int) -> RowPages | None:
        """The row's pages where each is held, or (a local file) in the page cache and read
        now; ``None`` where one must be waited for."""
        index = self.index_nowait(f)
        if index is None:
            return None
        pieces = {}
        for leaf in plan.leaves():
            for key, offset, length in plan.pieces(index, group, row, leaf):
                if (piece := self._piece_now(storage, url, f, key, offset, length)) is None:
                    return None
                pieces[key] = piece
            extra = _unannounced_dictionary(plan, group, leaf, pieces)
            if extra is not None:
                key, offset, length = extra
                if (piece := self._piece_now(storage, url, f, key, offset, length)) is None:
                    return None
                pieces[key] = piece
        self._used(f, index, plan, group, pieces)
        return RowPages(group, row, index, pieces)

    def _used(self, f: int, index: tuple[int, Any], plan: FilePages, group: int, pieces: dict[Any, Piece]) -> None:
        """A row has been read from ``pieces``: its data pages whose every row has now been read
        here leave the cache."""
        for key, piece in pieces.items():
            page = key[2]
            if type(page) is int:  # a data page (not "chunk" nor "dict")
                self.pages.used((f, key), piece, plan.page_rows(index, group, key[1], page))

    def _piece_now(self, storage: Storage, url: str, f: int, key: Any, offset: int, length: int) -> Piece | None:
        """A piece held, or read from the page cache now (and kept); ``None``: it must be waited for."""
        piece = self.pages.peek((f, key))
        if piece is None:
            data = self.nowait.read(storage, url, offset, length)
            if data is None:
                return None
            piece = Piece(offset, data)
            self.pages.put((f, key), piece)
        return piece

    async def read(self, storage: Storage, url: str, f: int, plan: FilePages, group: int, row: int) -> RowPages:
        index = self.index_nowait(f) or await self.index(storage, url, f, plan)
        wanted = {key: (offset, length) for leaf in plan.leaves()
                  for key, offset, length in plan.pieces(index, group, row, leaf)}
        pieces = {key: piece for key in wanted if (piece := self.pages.peek((f, key))) is not None}
        missing = [key for key in wanted if key not in pieces]  # no task for what is held
        if len(missing) == 1:
            pieces[missing[0]] = await self._get(storage, url, f, missing[0], *wanted[missing[0]])
        elif missing:
            pieces.update(zip(missing, await asyncio.gather(*(self._get(storage, url, f, key, *wanted[key])
                                                              for key in missing))))
        for leaf in plan.leaves():
            extra = _unannounced_dictionary(plan, group, leaf, pieces)
            if extra is not None:
                pieces[extra[0]] = await self._get(storage, url, f, *extra)
        self._used(f, index, plan, group, pieces)
        return RowPages(group, row, index, pieces)

    async def _get(self, storage: Storage, url: str, f: int, key: Any, offset: int, length: int) -> Piece:
        return await self.pages.get((f, key), lambda: fetch_piece(storage, url, offset, length))
