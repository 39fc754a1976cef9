"""One row's value out of fetched Parquet pages: the page header, the codec, the definition
levels, then the value, PLAIN or through the chunk's dictionary page.

A data page (v1 or v2) holds the values of consecutive rows of one leaf column; for a column
outside lists, one definition level per row tells whether the row's value (or a struct above
it) is null, and only non-null values are stored. :func:`leaf_value` decodes a page just far
enough for one row: its levels, and the values up to the row's, without expanding a run of
the RLE / bit-packed hybrid encoding into memory. :func:`column_value` puts a column's leaves
together (a struct as a dict), as pyarrow's ``as_py()`` does.

Nothing a header says is believed unchecked (what pyarrow's reader checks, and more): every
integer field is within its range; a page decompresses to exactly the size its header claims
(:mod:`aioload._parquet.codecs`); a data page holds as many values as the page index gives its
rows (``rows``); its levels are at most the leaf's maximum and its levels and values lie within
its bytes; a dictionary page's entries fit its bytes, and a dictionary index is one of them.
Raises :class:`PageError` for a page that breaks any of that (or uses an encoding the footer
did not announce); the dataset names the file, the row group, the column and the row.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np

from aioload._parquet.codecs import I32_MAX, CodecError, decompress
from aioload._parquet.pageindex import (BOOLEAN, BYTE_ARRAY, DICTIONARY_ENCODINGS, DOUBLE, FIXED_LEN_BYTE_ARRAY,
                                        FLOAT, INT32, INT64, PLAIN, PLAIN_DICTIONARY, RLE, Leaf, Node)
from aioload._parquet.thrift import read_struct

DATA_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 2, 3


class PageError(ValueError):
    """A page that cannot be decoded."""


def header(buf: Any, at: int) -> tuple[dict[int, Any], int]:
    """A page's header and where its body starts."""
    try:
        head, body = read_struct(buf, at)
    except ValueError as exc:
        raise PageError(f"the page header at byte {at} cannot be read ({exc})") from None
    return head, body


def field(struct_: dict[int, Any], key: int, what: str, default: Any = None, top: int = I32_MAX) -> int:
    """Integer field ``key`` of a header struct, within ``[0, top]``."""
    value = struct_.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise PageError(f"the page header's {what} is {value!r}, not an int in [0, {top}]")
    return value


def substruct(struct_: dict[int, Any], key: int, what: str) -> dict[int, Any]:
    value = struct_.get(key)
    if not isinstance(value, dict):
        raise PageError(f"the page header has no {what}")
    return value


def _decompress(body: Any, codec: str | None, size: int) -> memoryview:
    try:
        return decompress(body, codec, size)
    except CodecError as exc:
        raise PageError(str(exc)) from None


# -- the RLE / bit-packed hybrid (levels, dictionary indices, RLE booleans) -------------------
class _Runs:
    """The runs of a hybrid-encoded sequence of ``bit_width``-bit values: each ``(n, value)``
    for a repeated value, or ``(n, None)`` for ``n`` bit-packed values at :attr:`packed`.
    A run's values are never all expanded: a 35-byte page may hold a run of 2**31."""

    def __init__(self, data: memoryview, bit_width: int, what: str):
        if not 0 <= bit_width <= 32:
            raise PageError(f"the {what} have a bit width of {bit_width}, more than 32")
        self.data, self.width, self.what, self.pos = data, bit_width, what, 0
        self.packed = 0  # the byte where the current bit-packed run's values start

    def __iter__(self):
        data, width, size = self.data, self.width, (self.width + 7) // 8
        while self.pos < len(data):
            head = shift = 0
            while True:
                if self.pos >= len(data) or shift > 28:
                    raise PageError(f"the {self.what} hold a run header that is cut off or longer than 5 bytes")
                b = data[self.pos]
                self.pos += 1
                head |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    break
            if head & 1 and not width:  # bit-packed zero-bit values: a run of zeros
                yield (head >> 1) * 8, 0
            elif head & 1:  # groups of 8 values, least significant bit first; present as far as the bytes go
                self.packed = self.pos
                n = min((head >> 1) * 8, (len(data) - self.pos) * 8 // width)
                self.pos += min((head >> 1) * width, len(data) - self.pos)
                yield n, None
            else:
                if self.pos + size > len(data):
                    raise PageError(f"the {self.what} hold a run whose value is cut off")
                value = int.from_bytes(data[self.pos:self.pos + size], "little")
                self.pos += size
                yield head >> 1, value

    def unpack(self, first: int, n: int) -> np.ndarray:
        """Values ``first`` to ``first + n`` of the current bit-packed run."""
        lo, hi = first * self.width, (first + n) * self.width
        raw = np.frombuffer(self.data[self.packed + lo // 8:self.packed + (hi + 7) // 8], dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")[lo % 8:lo % 8 + n * self.width]
        return bits.reshape(n, self.width).astype(np.int64) @ (1 << np.arange(self.width, dtype=np.int64))


def hybrid(data: memoryview, bit_width: int, count: int, what: str = "levels") -> np.ndarray:
    """The first ``count`` values of an RLE / bit-packed hybrid sequence."""
    out = np.zeros(count, dtype=np.int64)
    got = 0
    runs = _Runs(data, bit_width, what)
    for n, value in runs:
        take = min(n, count - got)
        out[got:got + take] = value if value is not None else runs.unpack(0, take)
        got += take
        if got == count:
            return out
    raise PageError(f"the page's {what} stop after {got} of {count} values")


def hybrid_at(data: memoryview, bit_width: int, slot: int, target: int, what: str = "levels") -> tuple[int, int]:
    """``(value at slot, how many values before it equal target)`` of a hybrid sequence,
    decoded run by run (a bit-packed run's values only up to the slot)."""
    got = before = 0
    runs = _Runs(data, bit_width, what)
    for n, value in runs:
        if got + n > slot:
            if value is not None:
                return value, before + (slot - got) * (value == target)
            values = runs.unpack(0, slot - got + 1)
            return int(values[-1]), before + int(np.count_nonzero(values[:-1] == target))
        before += n if value == target else 0 if value is not None else \
            int(np.count_nonzero(runs.unpack(0, n) == target))
        got += n
    raise PageError(f"the page's {what} stop after {got} values, before value {slot}")


# -- PLAIN values and dictionaries -------------------------------------------------------------
_FIXED = {INT32: 4, INT64: 8, FLOAT: 4, DOUBLE: 8}
_FORMATS = {("int", 4): "<i", ("int", 8): "<q", ("uint", 4): "<I", ("uint", 8): "<Q",
            ("float", 4): "<f", ("float", 8): "<d"}


def _width(leaf: Leaf) -> int:
    return leaf.width if leaf.physical == FIXED_LEN_BYTE_ARRAY else _FIXED[leaf.physical]


def plain_value(data: memoryview, k: int, leaf: Leaf) -> Any:
    """Value ``k`` of PLAIN-encoded values."""
    if leaf.physical == BYTE_ARRAY:
        pos = 0
        for _ in range(k):
            pos += 4 + int.from_bytes(data[pos:pos + 4], "little")
            if pos > len(data):
                break
        n = int.from_bytes(data[pos:pos + 4], "little")
        if pos + 4 + n > len(data):
            raise PageError(f"value {k} runs past the page's {len(data)} bytes")
        return _python(bytes(data[pos + 4:pos + 4 + n]), leaf)
    if leaf.physical == BOOLEAN:
        if k // 8 >= len(data):
            raise PageError(f"value {k} runs past the page's {len(data)} bytes")
        return bool(data[k // 8] >> (k % 8) & 1)
    width = _width(leaf)
    if (k + 1) * width > len(data):
        raise PageError(f"value {k} runs past the page's {len(data)} bytes")
    if leaf.physical == FIXED_LEN_BYTE_ARRAY:
        return bytes(data[k * width:(k + 1) * width])
    return struct.unpack_from(_FORMATS[leaf.kind, width], data, k * width)[0]


def _python(raw: bytes, leaf: Leaf) -> Any:
    if leaf.kind != "str":
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PageError(f"a string value is not UTF-8 ({exc})") from None


def dictionary(buf: Any, at: int, codec: str | None, leaf: Leaf) -> list[Any]:
    """The entries of the dictionary page at ``buf[at]``: as many as its header says, which its
    bytes must hold (each at least its PLAIN size)."""
    head, body = header(buf, at)
    if head.get(1) != DICTIONARY_PAGE:
        raise PageError(f"the column chunk's dictionary page (byte {at}) is a page of type {head.get(1)}")
    compressed, size = field(head, 3, "compressed size"), field(head, 2, "uncompressed size")
    raw = memoryview(buf)[body:body + compressed]
    if len(raw) < compressed:
        raise PageError(f"the dictionary page at byte {at} runs past the bytes fetched")
    page = substruct(head, 7, "dictionary page header")
    count = field(page, 1, "dictionary size")
    if page.get(2, PLAIN) not in (PLAIN, PLAIN_DICTIONARY):
        raise PageError(f"the dictionary page's encoding {page.get(2)} is not PLAIN")
    data = _decompress(raw, codec, size)
    least = 4 if leaf.physical == BYTE_ARRAY else 1 / 8 if leaf.physical == BOOLEAN else _width(leaf)
    if count * least > len(data):
        raise PageError(f"the dictionary page claims {count} entries and its {len(data)} bytes hold at most "
                        f"{int(len(data) / least)}")
    return _plain_all(data, count, leaf)


# -- data pages ---------------------------------------------------------------------------------
Entries = Callable[[], list]
"""The chunk's dictionary entries, decoded (and kept) by the caller on first use."""


class _Page:
    """A data page's parts: ``count`` values (rows, outside lists, as many as the page index
    gives the page: ``rows``), their ``encoding``, the definition levels' bytes (``None``: the
    leaf is required) and the values' bytes."""

    def __init__(self, buf: Any, at: int, codec: str | None, leaf: Leaf, rows: int):
        head, body = header(buf, at)
        kind = head.get(1)
        compressed, size = field(head, 3, "compressed size"), field(head, 2, "uncompressed size")
        raw = memoryview(buf)[body:body + compressed]
        if len(raw) < compressed:
            raise PageError(f"the page at byte {at} runs past the bytes fetched")
        self.levels: memoryview | None = None
        if kind == DATA_PAGE:
            page = substruct(head, 5, "data page header")
            self.count, self.encoding = field(page, 1, "value count"), field(page, 2, "encoding")
            data = _decompress(raw, codec, size)
            pos = 0
            if leaf.max_def:
                if page.get(3, RLE) != RLE:
                    raise PageError(f"the page's definition levels are encoded {page.get(3)} (BIT_PACKED, "
                                    "deprecated), not RLE")
                n = int.from_bytes(data[:4], "little")
                if len(data) < 4 or 4 + n > len(data):
                    raise PageError(f"the page's definition levels claim {n} bytes of its {len(data)}")
                self.levels, pos = data[4:4 + n], 4 + n
            self.values = data[pos:]
        elif kind == DATA_PAGE_V2:
            page = substruct(head, 8, "data page header")
            self.count, self.encoding = field(page, 1, "value count"), field(page, 4, "encoding")
            nrep, ndef = field(page, 6, "repetition levels' size", 0), field(page, 5, "definition levels' size", 0)
            if field(page, 3, "row count") != self.count or field(page, 2, "null count", 0) > self.count:
                raise PageError(f"the page's row count ({page.get(3)}) or null count ({page.get(2)}) does not fit "
                                f"its {self.count} values (the column holds no lists)")
            if nrep + ndef > min(compressed, size):
                raise PageError(f"the page's levels claim {nrep + ndef} bytes of its {min(compressed, size)}")
            self.levels = raw[nrep:nrep + ndef] if leaf.max_def else None
            self.values = raw[nrep + ndef:]
            if page.get(7, True) is not False:
                self.values = _decompress(self.values, codec, size - nrep - ndef)
            elif compressed != size:
                raise PageError(f"the page is stored uncompressed in {compressed} bytes and claims {size}")
        else:
            raise PageError(f"the page at byte {at} is of type {kind}, not a data page")
        if self.count != rows:
            raise PageError(f"the page holds {self.count} values and the page index gives it {rows} rows")
        if self.encoding not in (PLAIN, RLE) and self.encoding not in DICTIONARY_ENCODINGS \
                or self.encoding == RLE and leaf.physical != BOOLEAN:
            raise PageError(f"the page's encoding {self.encoding} is neither PLAIN nor a dictionary's")

    def level(self, leaf: Leaf, slot: int) -> tuple[int, int]:
        """``(definition level at slot, how many values before it are not null)``."""
        if self.levels is None:
            return leaf.max_def, slot
        level, k = hybrid_at(self.levels, leaf.max_def.bit_length(), slot, leaf.max_def)
        if level > leaf.max_def:
            raise PageError(f"a definition level of {level} exceeds the column's maximum of {leaf.max_def}")
        return level, k

    def defs(self, leaf: Leaf) -> np.ndarray:
        """Every definition level."""
        if self.levels is None:
            return np.full(self.count, leaf.max_def, dtype=np.int64)
        out = hybrid(self.levels, leaf.max_def.bit_length(), self.count)
        if self.count and out.max() > leaf.max_def:
            raise PageError(f"a definition level of {out.max()} exceeds the column's maximum of {leaf.max_def}")
        return out

    def _coded(self) -> tuple[memoryview, int, str]:
        """The indices' (or RLE booleans') bytes, bit width and name."""
        if self.encoding == RLE:
            size = int.from_bytes(self.values[:4], "little")
            if len(self.values) < 4 or 4 + size > len(self.values):
                raise PageError(f"the page's booleans claim {size} bytes of its {len(self.values)}")
            return self.values[4:4 + size], 1, "booleans"
        if not len(self.values):
            raise PageError("the page's dictionary indices have no bit width")
        return self.values[1:], self.values[0], "dictionary indices"

    def index(self, k: int) -> int:
        """Dictionary index ``k`` (or RLE boolean ``k``)."""
        data, width, what = self._coded()
        return hybrid_at(data, width, k, -1, what)[0]

    def indices(self, n: int) -> np.ndarray:
        """The first ``n`` dictionary indices (or RLE booleans)."""
        if not n:
            return np.zeros(0, dtype=np.int64)
        data, width, what = self._coded()
        return hybrid(data, width, n, what)


def _entry(entries: Entries | None, k: int) -> Any:
    if entries is None:
        raise PageError("the page is dictionary-encoded and its column chunk has no dictionary page")
    found = entries()
    if not 0 <= k < len(found):
        raise PageError(f"a dictionary index {k} is outside the dictionary's {len(found)} entries")
    return found[k]


def leaf_value(buf: Any, at: int, codec: str | None, slot: int, leaf: Leaf, entries: Entries | None,
               rows: int) -> tuple[int, Any]:
    """``(definition level, value)`` of the row at ``slot`` in the data page at ``buf[at]``
    (``entries``: the chunk's dictionary, where it has one; ``rows``: the page's rows as the
    page index gives them); the value is ``None`` where the level is below the leaf's maximum."""
    page = _Page(buf, at, codec, leaf, rows)
    if not 0 <= slot < page.count:
        raise PageError(f"the row is value {slot} of a page of {page.count}")
    level, k = page.level(leaf, slot)
    if level < leaf.max_def:
        return level, None
    if page.encoding == PLAIN:
        return level, plain_value(page.values, k, leaf)
    if page.encoding == RLE:
        return level, bool(page.index(k))
    return level, _entry(entries, page.index(k))


def page_values(buf: Any, at: int, codec: str | None, leaf: Leaf, entries: Entries | None,
                rows: int) -> list[tuple[int, Any]]:
    """``(definition level, value)`` of every row of the data page at ``buf[at]``: a small
    chunk's page, decoded once for the rows that come to it again."""
    page = _Page(buf, at, codec, leaf, rows)
    defs = page.defs(leaf)
    n = int(np.count_nonzero(defs == leaf.max_def))
    if page.encoding == PLAIN:
        values = _plain_all(page.values, n, leaf)
    elif page.encoding == RLE:
        values = [bool(b) for b in page.indices(n)]
    else:
        indices = page.indices(n)
        if n and (entries is None or indices.max() >= len(entries())):
            _entry(entries, int(indices.max()))
        found = entries() if n and entries is not None else []
        values = [found[i] for i in indices.tolist()]
    it = iter(values)
    return [(d, next(it) if d == leaf.max_def else None) for d in defs.tolist()]


def _plain_all(data: memoryview, n: int, leaf: Leaf) -> list[Any]:
    """The first ``n`` PLAIN-encoded values."""
    if leaf.physical == BYTE_ARRAY:
        if 4 * n > len(data):
            raise PageError(f"{n} values run past the page's {len(data)} bytes")
        out, pos = [], 0
        for _ in range(n):
            size = int.from_bytes(data[pos:pos + 4], "little")
            if pos + 4 + size > len(data):
                raise PageError(f"a value runs past the page's {len(data)} bytes")
            out.append(_python(bytes(data[pos + 4:pos + 4 + size]), leaf))
            pos += 4 + size
        return out
    if leaf.physical == BOOLEAN:
        if (n + 7) // 8 > len(data):
            raise PageError(f"{n} values run past the page's {len(data)} bytes")
        bits = np.unpackbits(np.frombuffer(data[:(n + 7) // 8], dtype=np.uint8), bitorder="little")
        return [bool(b) for b in bits[:n]]
    width = _width(leaf)
    if n * width > len(data):
        raise PageError(f"{n} values run past the page's {len(data)} bytes")
    if leaf.physical == FIXED_LEN_BYTE_ARRAY:
        return [bytes(data[k * width:(k + 1) * width]) for k in range(n)]
    return np.frombuffer(data[:n * width], dtype=_FORMATS[leaf.kind, width]).tolist()


def needs_dictionary(buf: Any, at: int) -> bool:
    """Whether the data page at ``buf[at]`` is dictionary-encoded."""
    head, _ = header(buf, at)
    page = head.get(5) if head.get(1) == DATA_PAGE else head.get(8)
    encoding = page.get(2 if head.get(1) == DATA_PAGE else 4) if isinstance(page, dict) else None
    return encoding in DICTIONARY_ENCODINGS


def column_value(node: Node, values: dict[int, tuple[int, Any]]) -> Any:
    """A column's value from its leaves' ``(definition level, value)``: ``None`` where the
    column (or a struct inside it) is null, a dict for a struct."""
    if node.level is not None and values[node.first_leaf().index][0] < node.level:
        return None
    if node.leaf is not None:
        return values[node.leaf.index][1]
    return {name: column_value(child, values) for name, child in node.fields}
