"""One row's value out of fetched Parquet pages: the page header, the codec, the definition
levels, then the value, PLAIN or through the chunk's dictionary page.

A data page (v1 or v2) holds the values of consecutive rows of one leaf column; for a column
outside lists, one definition level per row tells whether the row's value (or a struct above
it) is null, and only non-null values are stored. :func:`leaf_value` decodes a page just far
enough for one row: its levels, and the values up to the row's. :func:`column_value` puts a
column's leaves together (a struct as a dict), as pyarrow's ``as_py()`` does.

Raises :class:`PageError` for a page it cannot read (a corrupt header, an encoding the
footer did not announce); the dataset names the file, the column and the row.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from aioload._parquet.pageindex import (BOOLEAN, BYTE_ARRAY, DICTIONARY_ENCODINGS, DOUBLE, FIXED_LEN_BYTE_ARRAY,
                                        FLOAT, INT32, INT64, PLAIN, RLE, Leaf, Node)
from aioload._parquet.thrift import read_struct

DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3


class PageError(ValueError):
    """A page that cannot be decoded."""


def header(buf: Any, at: int) -> tuple[dict[int, Any], int]:
    """A page's header and where its body starts."""
    try:
        return read_struct(buf, at)
    except ValueError as exc:
        raise PageError(f"the page header at byte {at} cannot be read ({exc})") from None


def _decompress(body: Any, codec: str | None, size: int) -> memoryview:
    if codec is None:
        return memoryview(body)
    import pyarrow as pa

    return memoryview(pa.decompress(body, decompressed_size=size, codec=codec))


def hybrid(data: memoryview, bit_width: int, count: int) -> np.ndarray:
    """The first ``count`` values of an RLE / bit-packed hybrid run (levels, dictionary indices)."""
    out = np.zeros(count, dtype=np.int64)
    got = pos = 0
    size = (bit_width + 7) // 8
    while got < count and pos < len(data):
        head = shift = 0
        while True:
            b = data[pos]
            pos += 1
            head |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if head & 1:  # bit-packed: groups of 8 values, least significant bit first
            n = (head >> 1) * 8
            nbytes = (head >> 1) * bit_width
            bits = np.unpackbits(np.frombuffer(data[pos:pos + nbytes], dtype=np.uint8), bitorder="little")
            values = bits[:n * bit_width].reshape(n, bit_width) @ (1 << np.arange(bit_width, dtype=np.int64)) \
                if bit_width else np.zeros(n, dtype=np.int64)
            pos += nbytes
        else:
            n = head >> 1
            values = np.full(n, int.from_bytes(data[pos:pos + size], "little"), dtype=np.int64)
            pos += size
        take = min(n, count - got)
        out[got:got + take] = values[:take]
        got += take
    if got < count:
        raise PageError(f"the page's levels or indices stop after {got} of {count} values")
    return out


_FIXED = {INT32: 4, INT64: 8, FLOAT: 4, DOUBLE: 8}
_FORMATS = {("int", 4): "<i", ("int", 8): "<q", ("uint", 4): "<I", ("uint", 8): "<Q",
            ("float", 4): "<f", ("float", 8): "<d"}


def plain_value(data: memoryview, k: int, leaf: Leaf) -> Any:
    """Value ``k`` of PLAIN-encoded values."""
    if leaf.physical == BYTE_ARRAY:
        pos = 0
        for _ in range(k):
            pos += 4 + int.from_bytes(data[pos:pos + 4], "little")
        n = int.from_bytes(data[pos:pos + 4], "little")
        if pos + 4 + n > len(data):
            raise PageError(f"value {k} runs past the page's {len(data)} bytes")
        return _python(bytes(data[pos + 4:pos + 4 + n]), leaf)
    if leaf.physical == BOOLEAN:
        return bool(data[k // 8] >> (k % 8) & 1)
    width = leaf.width if leaf.physical == FIXED_LEN_BYTE_ARRAY else _FIXED[leaf.physical]
    if (k + 1) * width > len(data):
        raise PageError(f"value {k} runs past the page's {len(data)} bytes")
    if leaf.physical == FIXED_LEN_BYTE_ARRAY:
        return bytes(data[k * width:(k + 1) * width])
    return struct.unpack_from(_FORMATS[leaf.kind, width], data, k * width)[0]


def _python(raw: bytes, leaf: Leaf) -> Any:
    return raw.decode("utf-8") if leaf.kind == "str" else raw


def _dictionary_page(buf: Any, at: int, codec: str | None) -> tuple[int, memoryview]:
    """``(entries, PLAIN values)`` of the dictionary page at ``buf[at]``."""
    head, body = header(buf, at)
    if head.get(1) != DICTIONARY_PAGE:
        raise PageError(f"the column chunk's dictionary page (byte {at}) is a page of type {head.get(1)}")
    return head.get(7, {}).get(1, 0), _decompress(memoryview(buf)[body:body + head[3]], codec, head[2])


def dictionary_value(buf: Any, at: int, codec: str | None, k: int, leaf: Leaf) -> Any:
    """Entry ``k`` of the dictionary page at ``buf[at]``."""
    count, data = _dictionary_page(buf, at, codec)
    if not 0 <= k < count:
        raise PageError(f"a dictionary index {k} is outside the dictionary's {count} entries")
    return plain_value(data, k, leaf)


class _Page:
    """A data page's parts: ``count`` values (rows, outside lists), their ``encoding``, the
    definition levels' bytes (``None``: the leaf is required) and the values' bytes."""

    def __init__(self, buf: Any, at: int, codec: str | None, leaf: Leaf):
        head, body = header(buf, at)
        kind, compressed, size = head.get(1), head.get(3, 0), head.get(2, 0)
        raw = memoryview(buf)[body:body + compressed]
        if len(raw) < compressed:
            raise PageError(f"the page at byte {at} runs past the bytes fetched")
        self.levels: memoryview | None = None
        if kind == DATA_PAGE:
            page = head[5]
            self.count, self.encoding = page[1], page[2]
            data = _decompress(raw, codec, size)
            pos = 0
            if leaf.max_def:
                if page.get(3, RLE) != RLE:
                    raise PageError(f"the page's definition levels are encoded {page.get(3)} (BIT_PACKED, "
                                    "deprecated), not RLE")
                n = int.from_bytes(data[:4], "little")
                self.levels, pos = data[4:4 + n], 4 + n
            self.values = data[pos:]
        elif kind == DATA_PAGE_V2:
            page = head[8]
            self.count, self.encoding = page[1], page[4]
            nrep, ndef = page.get(6, 0), page.get(5, 0)
            self.levels = raw[nrep:nrep + ndef] if leaf.max_def else None
            self.values = raw[nrep + ndef:]
            if page.get(7, True):
                self.values = _decompress(self.values, codec, size - nrep - ndef)
        else:
            raise PageError(f"the page at byte {at} is of type {kind}, not a data page")
        if self.encoding not in (PLAIN, RLE) and self.encoding not in DICTIONARY_ENCODINGS \
                or self.encoding == RLE and leaf.physical != BOOLEAN:
            raise PageError(f"the page's encoding {self.encoding} is neither PLAIN nor a dictionary's")

    def defs(self, leaf: Leaf, n: int) -> np.ndarray:
        """The first ``n`` definition levels."""
        if self.levels is None:
            return np.full(n, leaf.max_def, dtype=np.int64)
        return hybrid(self.levels, leaf.max_def.bit_length(), n)

    def indices(self, n: int) -> np.ndarray:
        """The first ``n`` dictionary indices (or booleans, RLE-encoded)."""
        if self.encoding == RLE:
            size = int.from_bytes(self.values[:4], "little")
            return hybrid(self.values[4:4 + size], 1, n)
        return hybrid(self.values[1:], self.values[0], n) if n else np.zeros(0, dtype=np.int64)


def leaf_value(buf: Any, at: int, codec: str | None, slot: int, leaf: Leaf,
               dictionary: tuple[Any, int] | None) -> tuple[int, Any]:
    """``(definition level, value)`` of the row at ``slot`` in the data page at ``buf[at]``
    (``dictionary``: the buffer and position of the chunk's dictionary page, where fetched);
    the value is ``None`` where the level is below the leaf's maximum."""
    page = _Page(buf, at, codec, leaf)
    if not 0 <= slot < page.count:
        raise PageError(f"the row is value {slot} of a page of {page.count}")
    defs = page.defs(leaf, slot + 1)
    if defs[slot] < leaf.max_def:
        return int(defs[slot]), None
    k = int(np.count_nonzero(defs[:slot] == leaf.max_def))
    if page.encoding == PLAIN:
        return leaf.max_def, plain_value(page.values, k, leaf)
    if page.encoding == RLE:
        return leaf.max_def, bool(page.indices(k + 1)[k])
    if dictionary is None:
        raise PageError("the page is dictionary-encoded and its column chunk has no dictionary page")
    return leaf.max_def, dictionary_value(dictionary[0], dictionary[1], codec, int(page.indices(k + 1)[k]), leaf)


def page_values(buf: Any, at: int, codec: str | None, leaf: Leaf,
                dictionary: tuple[Any, int] | None) -> list[tuple[int, Any]]:
    """``(definition level, value)`` of every row of the data page at ``buf[at]``: a small
    chunk's page, decoded once for the rows that come to it again."""
    page = _Page(buf, at, codec, leaf)
    defs = page.defs(leaf, page.count)
    n = int(np.count_nonzero(defs == leaf.max_def))
    if page.encoding == PLAIN:
        values = [plain_value(page.values, k, leaf) for k in range(n)] if leaf.physical == BYTE_ARRAY \
            else _plain_all(page.values, n, leaf)
    elif page.encoding == RLE:
        values = [bool(b) for b in page.indices(n)]
    else:
        if dictionary is None:
            raise PageError("the page is dictionary-encoded and its column chunk has no dictionary page")
        count, data = _dictionary_page(dictionary[0], dictionary[1], codec)
        entries = _plain_all(data, count, leaf)
        indices = page.indices(n)
        if n and (indices.min() < 0 or indices.max() >= count):
            raise PageError(f"a dictionary index is outside the dictionary's {count} entries")
        values = [entries[i] for i in indices.tolist()]
    out: list[tuple[int, Any]] = []
    it = iter(values)
    for d in defs.tolist():
        out.append((d, next(it) if d == leaf.max_def else None))
    return out


def _plain_all(data: memoryview, n: int, leaf: Leaf) -> list[Any]:
    """The first ``n`` PLAIN-encoded values."""
    if leaf.physical == BYTE_ARRAY:
        out, pos = [], 0
        for _ in range(n):
            size = int.from_bytes(data[pos:pos + 4], "little")
            if pos + 4 + size > len(data):
                raise PageError(f"a value runs past the page's {len(data)} bytes")
            out.append(_python(bytes(data[pos + 4:pos + 4 + size]), leaf))
            pos += 4 + size
        return out
    if leaf.physical == BOOLEAN:
        bits = np.unpackbits(np.frombuffer(data[:(n + 7) // 8], dtype=np.uint8), bitorder="little")
        return [bool(b) for b in bits[:n]]
    if leaf.physical == FIXED_LEN_BYTE_ARRAY:
        return [bytes(data[k * leaf.width:(k + 1) * leaf.width]) for k in range(n)]
    width = _FIXED[leaf.physical]
    if n * width > len(data):
        raise PageError(f"{n} values run past the page's {len(data)} bytes")
    return np.frombuffer(data[:n * width], dtype=_FORMATS[leaf.kind, width]).tolist()


def needs_dictionary(buf: Any, at: int) -> bool:
    """Whether the data page at ``buf[at]`` is dictionary-encoded."""
    head, _ = header(buf, at)
    page = head.get(5) if head.get(1) == DATA_PAGE else head.get(8)
    encoding = (page or {}).get(2 if head.get(1) == DATA_PAGE else 4)
    return encoding in DICTIONARY_ENCODINGS


def column_value(node: Node, values: dict[int, tuple[int, Any]]) -> Any:
    """A column's value from its leaves' ``(definition level, value)``: ``None`` where the
    column (or a struct inside it) is null, a dict for a struct."""
    if node.level is not None and values[node.first_leaf().index][0] < node.level:
        return None
    if node.leaf is not None:
        return values[node.leaf.index][1]
    return {name: column_value(child, values) for name, child in node.fields}
