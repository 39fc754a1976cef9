"""Which bytes one row needs: a file's columns as pages, from its footer and its page index.

A uniform shuffle reads one row at a time, and a row group is far more than a row (100
images, 10-15 MB). Parquet's page index (the ``OffsetIndex`` that pyarrow writes with
``write_page_index=True``, and ``datasets`` by default) gives each data page of a column
chunk its byte range and its first row, so the row's value of a column is in one page, plus
the chunk's dictionary page where the page is dictionary-encoded. :class:`FilePages` reads
the footer (Thrift, :mod:`aioload._parquet.thrift`) for each column's leaves (their types,
definition levels, codecs, encodings, page index ranges) and says, for row ``r`` of row group
``g``, the byte ranges of each leaf to fetch (:meth:`FilePages.pieces`); the page index
itself is fetched once per file and process (:meth:`FilePages.index_range`).

A column is read by pages only where every one of its leaves can be: not inside a list or
map (a row is then in one page of each leaf), of a type the page decoder knows
(:mod:`aioload._parquet.values`), compressed with a codec pyarrow decompresses, encoded
PLAIN or with a dictionary, and with a page index in every row group. Every other column is
read with its row group, as window mode reads all (:mod:`aioload._parquet.rowgroups`).

A chunk's page index is checked when it is first used (:class:`PageIndexError`): at least one
page, the first at row 0, first rows increasing and within the row group's rows, each page's
bytes within its column chunk, in order. Each data page's value count is then checked against
the rows the index gives it (:func:`aioload._parquet.values.leaf_value`): an index whose first
rows are off by one would otherwise shift every value silently.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass
from typing import Any

import numpy as np

from aioload._parquet.thrift import read_struct

I32_MAX, I64_MAX = (1 << 31) - 1, (1 << 63) - 1

# parquet.thrift's numbering
CODECS = {0: None, 1: "snappy", 2: "gzip", 4: "brotli", 6: "zstd", 7: "lz4_raw"}
PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY = 0, 2, 3, 8
DICTIONARY_ENCODINGS = {PLAIN_DICTIONARY, RLE_DICTIONARY}
ENCODINGS = {PLAIN, RLE} | DICTIONARY_ENCODINGS
REQUIRED, OPTIONAL, REPEATED = 0, 1, 2
BOOLEAN, INT32, INT64, INT96, FLOAT, DOUBLE, BYTE_ARRAY, FIXED_LEN_BYTE_ARRAY = range(8)
SMALL = 64 << 10
"""A leaf's column chunk up to this size is fetched whole (once per row group and process,
then kept), not page by page: a label's or a path's chunk, which every row would otherwise
fetch a page of."""


class PageIndexError(ValueError):
    """A page index (or the footer's part that locates it) that does not describe its chunk."""


@dataclass(frozen=True)
class Leaf:
    """A leaf column as the page decoder needs it: its position among the file's leaves, its
    physical type (and ``width`` for fixed-length bytes), its maximum definition level and
    ``kind``, how a value becomes Python (``"bytes"``, ``"str"``, ``"int"``, ``"uint"``,
    ``"float"``, ``"bool"``)."""

    index: int
    name: str
    physical: int
    width: int
    max_def: int
    kind: str


@dataclass(frozen=True)
class Node:
    """A top-level column's shape: a leaf, or a struct of nodes (``fields``); ``level``: the
    definition level from which it is not null (``None``: required)."""

    level: int | None
    leaf: Leaf | None = None
    fields: tuple[tuple[str, "Node"], ...] = ()

    def first_leaf(self) -> Leaf:
        return self.leaf if self.leaf is not None else self.fields[0][1].first_leaf()

    def leaves(self) -> list[Leaf]:
        return [self.leaf] if self.leaf is not None else [x for _, n in self.fields for x in n.leaves()]


@dataclass(frozen=True)
class Chunk:
    """One leaf's column chunk in one row group: its byte range, its dictionary page's start
    (``None``: none), codec, whether its data pages may be dictionary-encoded (``dict_pages``:
    how many of the first pages are, as the writer's encoding statistics tell; ``None``: all
    may be), and its offset index's byte range."""

    start: int
    length: int
    dictionary: int | None
    codec: str | None
    dict_pages: int | None
    index: tuple[int, int]


_INTS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}


def _kind(physical: int, width: int, arrow_type: Any) -> str | None:
    """How a leaf's values become Python, or ``None`` where the page decoder cannot say."""
    import pyarrow as pa

    t = arrow_type
    if physical == BYTE_ARRAY:
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return "bytes"
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return "str"
    elif physical == FIXED_LEN_BYTE_ARRAY and pa.types.is_fixed_size_binary(t) and t.byte_width == width:
        return "bytes"
    elif physical in (INT32, INT64) and pa.types.is_integer(t):
        bits = t.bit_width
        if (physical == INT64) == (bits == 64):
            return "int" if pa.types.is_signed_integer(t) else "uint"
    elif physical == FLOAT and pa.types.is_float32(t) or physical == DOUBLE and pa.types.is_float64(t):
        return "float"
    elif physical == BOOLEAN and pa.types.is_boolean(t):
        return "bool"
    return None


class _Schema:
    """The footer's flat schema list walked as a tree, leaf positions counted."""

    def __init__(self, elements: list[dict[int, Any]]):
        self.elements, self.at, self.leaf = elements, 1, 0

    def skip(self) -> None:
        e = self.elements[self.at]
        self.at += 1
        if e.get(5):
            for _ in range(e[5]):
                self.skip()
        else:
            self.leaf += 1

    def node(self, arrow_type: Any, level: int) -> Node | None:
        """The next element as a :class:`Node`, or ``None`` (read past) where pages cannot read it."""
        import pyarrow as pa

        e = self.elements[self.at]
        rep = e.get(3, REQUIRED)
        if rep == REPEATED:
            self.skip()
            return None
        if rep == OPTIONAL:
            level += 1
        children = e.get(5)
        if children:
            if not pa.types.is_struct(arrow_type) or arrow_type.num_fields != children:
                self.skip()
                return None
            self.at += 1
            fields, ok = [], True
            for i in range(children):
                child = self.node(arrow_type.field(i).type, level)
                ok = ok and child is not None
                fields.append((arrow_type.field(i).name, child))
            return Node(level if rep == OPTIONAL else None, fields=tuple(fields)) if ok else None  # type: ignore[arg-type]
        self.at += 1
        self.leaf += 1
        physical, width = e.get(1, -1), e.get(2, 0)
        kind = _kind(physical, width, arrow_type)
        if kind is None:
            return None
        leaf = Leaf(self.leaf - 1, e[4].decode("utf-8", "replace"), physical, width, level, kind)
        return Node(level if rep == OPTIONAL else None, leaf=leaf)


def _chunk(column: dict[int, Any]) -> Chunk | None:
    """A column chunk's :class:`Chunk`, or ``None`` where its pages cannot be read alone."""
    meta = column.get(3)
    if meta is None or 4 not in column or 5 not in column or column.get(1):  # no page index, or another file's
        return None
    if meta.get(4, 0) not in CODECS or not set(meta.get(2, [])) <= ENCODINGS:
        return None
    dictionary = meta.get(11) or None  # 0 also means none
    dict_pages = None
    stats = meta.get(13)
    if stats:
        data = [(s[2], s[3]) for s in stats if s.get(1) in (0, 3)]  # DATA_PAGE, DATA_PAGE_V2
        coded = sum(n for encoding, n in data if encoding in DICTIONARY_ENCODINGS)
        # writers fall back from a dictionary to PLAIN once, so the first `coded` pages are the coded ones
        dict_pages = coded if coded < sum(n for _, n in data) else None
    start = _bounded(dictionary if dictionary is not None else meta[9], I64_MAX, "a column chunk's first page")
    index = (_bounded(column[4], I64_MAX, "an offset index's offset"), _bounded(column[5], I32_MAX, "an offset "
                                                                                                  "index's length"))
    return Chunk(start, _bounded(meta[7], I64_MAX, "a column chunk's size"), dictionary, CODECS[meta.get(4, 0)],
                 dict_pages, index)


class FilePages:
    """One file's columns as pages: which of ``columns`` can be read by page (``nodes``), and
    the byte ranges a row needs. ``raw``: the footer's bytes (ending with the 8 that end a
    file); ``arrow_schema``: pyarrow's schema of the file."""

    def __init__(self, raw: bytes, arrow_schema: Any, columns: list[str]):
        try:
            self._read(raw, arrow_schema, columns)
            # every read asks for these: computed once
            self._leaves = tuple(leaf for node in self.nodes.values() for leaf in node.leaves())
            spans = [chunks[leaf.index].index for chunks in self.chunks for leaf in self._leaves]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise PageIndexError(f"the footer does not describe its columns' pages ({type(exc).__name__}: "
                                 f"{exc})") from None
        start = min((a for a, _ in spans), default=0)
        self._span = (start, max(a + n for a, n in spans) - start) if spans else None
        self._pages: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._firsts: dict[tuple[int, int], list[int]] = {}  # each chunk's first rows, for bisect

    def _read(self, raw: bytes, arrow_schema: Any, columns: list[str]) -> None:
        length = int.from_bytes(raw[-8:-4], "little")
        meta, _ = read_struct(raw[len(raw) - 8 - length:len(raw) - 8])
        schema = _Schema(meta[2])
        self.nodes: dict[str, Node] = {}
        for name in arrow_schema.names:
            node = schema.node(arrow_schema.field(name).type, 0)
            if node is not None and name in columns:
                self.nodes[name] = node
        self.chunks: list[dict[int, Chunk]] = []
        self.rows: list[int] = []
        for group in meta.get(4, []):
            self.rows.append(_bounded(group[3], I64_MAX, "a row group's row count"))
            chunks = {}
            for name, node in list(self.nodes.items()):
                for leaf in node.leaves():
                    chunk = _chunk(group[1][leaf.index])
                    if chunk is None:
                        break
                    chunks[leaf.index] = chunk
                else:
                    continue
                del self.nodes[name]  # one row group without a page index: that column goes by row group
            self.chunks.append(chunks)

    @property
    def names(self) -> dict[int, str]:
        """Each leaf's column (by leaf position)."""
        return {leaf.index: name for name, node in self.nodes.items() for leaf in node.leaves()}

    def leaves(self) -> tuple[Leaf, ...]:
        """The leaves read by page."""
        return self._leaves

    def index_range(self) -> tuple[int, int] | None:
        """``(offset, length)`` of the page index of the leaves read by page (``None``: none)."""
        return self._span

    def pages(self, index: tuple[int, bytes], group: int, leaf: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(offsets, sizes, first rows)`` of a chunk's data pages, from the page index's
        bytes (``index``: its offset in the file, and its bytes)."""
        key = (group, leaf)
        found = self._pages.get(key)
        if found is None:
            found = self._pages[key] = self._index(index, group, leaf)
        return found

    def _index(self, index: tuple[int, bytes], group: int, leaf: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        at, data = index
        chunk = self.chunks[group][leaf]
        offset, length = chunk.index
        where = f"row group {group}, column {self.names.get(leaf, leaf)!r}"
        if not 0 <= offset - at <= offset - at + length <= len(data):
            raise PageIndexError(f"{where}: the offset index's bytes lie outside the page index fetched")
        try:
            parsed, _ = read_struct(memoryview(data)[:offset - at + length], offset - at)
        except ValueError as exc:
            raise PageIndexError(f"{where}: the offset index cannot be read ({exc})") from None
        locations = parsed.get(1)
        if not isinstance(locations, list) or not locations or not all(isinstance(p, dict) for p in locations):
            raise PageIndexError(f"{where}: the offset index lists no page")
        try:
            offsets, sizes, firsts = (np.array([p[k] for p in locations], dtype=np.int64) for k in (1, 2, 3))
        except (KeyError, TypeError, OverflowError, ValueError):
            raise PageIndexError(f"{where}: a page's location in the offset index lacks its offset, size or "
                                 "first row") from None
        end, rows = chunk.start + chunk.length, self.rows[group]
        if firsts[0] != 0 or np.any(np.diff(firsts) <= 0) or firsts[-1] >= max(rows, 1):
            raise PageIndexError(f"{where}: the offset index's first rows {firsts[:8].tolist()}... are not "
                                 f"increasing from 0 within the row group's {rows} rows")
        if np.any(sizes <= 0) or offsets[0] < chunk.start or np.any(offsets[1:] < offsets[:-1] + sizes[:-1]) \
                or offsets[-1] + sizes[-1] > end:
            raise PageIndexError(f"{where}: the offset index's pages do not lie in order within the column "
                                 f"chunk's bytes [{chunk.start}, {end})")
        return offsets, sizes, firsts

    def page_of(self, index: tuple[int, bytes], group: int, leaf: int, row: int) -> int:
        """The page of a chunk that holds row ``row`` (its first rows bisected, as a list: a
        numpy search on one value costs more than the whole bisect)."""
        return bisect.bisect_right(self._first_rows(index, group, leaf), row) - 1

    def page_rows(self, index: tuple[int, bytes], group: int, leaf: int, page: int) -> int:
        """How many rows the page index gives page ``page`` of a chunk."""
        firsts = self._first_rows(index, group, leaf)
        end = self.rows[group] if page + 1 == len(firsts) else firsts[page + 1]
        return end - firsts[page]

    def _first_rows(self, index: tuple[int, bytes], group: int, leaf: int) -> list[int]:
        """Each page's first row, as a list (made once a chunk)."""
        firsts = self._firsts.get((group, leaf))
        if firsts is None:
            firsts = self._firsts[group, leaf] = self.pages(index, group, leaf)[2].tolist()
        return firsts

    def pieces(self, index: tuple[int, bytes], group: int, row: int, leaf: Leaf) -> list[tuple[Any, int, int]]:
        """``(key, offset, length)`` of what row ``row`` of row group ``group`` needs of
        ``leaf``: its whole chunk where it is small, else its data page and, where that may be
        dictionary-encoded, the dictionary page. Keys: ``(group, leaf, "chunk" | "dict" | page)``."""
        chunk = self.chunks[group][leaf.index]
        if chunk.length <= SMALL:
            return [((group, leaf.index, "chunk"), chunk.start, chunk.length)]
        offsets, sizes, _ = self.pages(index, group, leaf.index)
        page = self.page_of(index, group, leaf.index, row)
        out = [((group, leaf.index, page), int(offsets[page]), int(sizes[page]))]
        if chunk.dictionary is not None and (chunk.dict_pages is None or page < chunk.dict_pages):
            out.append(self.dictionary(group, leaf.index))
        return out

    def dictionary(self, group: int, leaf: int) -> tuple[Any, int, int]:
        """The ``(key, offset, length)`` of a chunk's dictionary page (it ends where its first
        data page starts)."""
        chunk = self.chunks[group][leaf]
        assert chunk.dictionary is not None
        end = chunk.start + chunk.length
        if (group, leaf) in self._pages:
            end = int(self._pages[group, leaf][0][0])
        return (group, leaf, "dict"), chunk.dictionary, end - chunk.dictionary

    def locate(self, index: tuple[int, bytes], group: int, row: int, leaf: Leaf) -> tuple[int, int, int]:
        """``(page offset in the file, first row of that page, its rows)`` of row ``row``'s page
        of ``leaf``."""
        offsets, _, firsts = self.pages(index, group, leaf.index)
        page = self.page_of(index, group, leaf.index, row)
        return int(offsets[page]), int(firsts[page]), self.page_rows(index, group, leaf.index, page)


def _bounded(value: Any, top: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise PageIndexError(f"{what} is {value!r}, not an int in [0, {top}]")
    return value
