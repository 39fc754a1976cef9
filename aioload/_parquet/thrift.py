"""Thrift's compact protocol, read: how Parquet writes its footer, its page index and each
page's header.

:func:`read_struct` turns the bytes of one struct into ``{field id: value}``: integers as ints,
binary and strings as bytes, lists as lists, nested structs as dicts of their own. The
Parquet modules name the field ids they use (``parquet.thrift``'s numbering); fields they do
not know are read past and kept, unused. A struct that runs past its bytes, or a type this
reader does not know, raises :class:`ThriftError`; so does every value the encoding cannot hold
(an integer outside its type's range, a varint longer than an i64's ten bytes, a container
that claims more elements than its bytes can hold, nesting deeper than :data:`MAX_DEPTH`), so
that no input makes it loop, recurse or allocate beyond its bytes.
"""

from __future__ import annotations

import struct
from typing import Any

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)


MAX_DEPTH = 64
"""How deep structs, lists and maps may nest (Parquet's own structs nest at most 6 deep)."""
_RANGES = {_I16: 1 << 15, _I32: 1 << 31, _I64: 1 << 63}


class ThriftError(ValueError):
    """Bytes that are not the compact encoding of a Thrift struct."""


class _Reader:
    def __init__(self, data: bytes | memoryview, pos: int = 0):
        self.data, self.pos, self.depth = memoryview(data), pos, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ThriftError(f"the struct runs past its {len(self.data)} bytes")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out = 0
        for shift in range(0, 70, 7):
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
        raise ThriftError(f"a varint at byte {self.pos - 10} is longer than an i64's 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ThriftError(f"a value of {n} bytes runs past the struct's {len(self.data)} bytes")
        out = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return out

    def value(self, kind: int) -> Any:
        if kind == _TRUE:
            return True
        if kind == _FALSE:
            return False
        if kind == _BYTE:
            b = self.byte()
            return b - 256 if b > 127 else b
        if kind in (_I16, _I32, _I64):
            n, bound = self.zigzag(), _RANGES[kind]
            if not -bound <= n < bound:
                raise ThriftError(f"an i{bound.bit_length()} of {n} at byte {self.pos} is outside its type's range")
            return n
        if kind == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if kind == _BINARY:
            return self.take(self.varint())
        if kind in (_LIST, _SET):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.size(1)
            return self.nested(lambda: [self.element(element) for _ in range(size)])
        if kind == _MAP:
            size = self.size(2)
            if not size:
                return {}
            kinds = self.byte()
            return self.nested(lambda: {self.element(kinds >> 4): self.element(kinds & 0x0F) for _ in range(size)})
        if kind == _STRUCT:
            return self.nested(self.struct)
        raise ThriftError(f"unknown compact type {kind} at byte {self.pos}")

    def element(self, kind: int) -> Any:
        """A list's, set's or map's element: a boolean there is a byte of its own."""
        if kind in (_TRUE, _FALSE):
            return self.byte() == 1
        return self.value(kind)

    def size(self, each: int) -> int:
        """A container's element count, which its bytes must be able to hold (every element
        takes at least one byte, a map's entry two)."""
        size = self.varint()
        if size * each > len(self.data) - self.pos:
            raise ThriftError(f"a container at byte {self.pos} claims {size} elements, more than its "
                              f"{len(self.data) - self.pos} remaining bytes can hold")
        return size

    def nested(self, read: Any) -> Any:
        if self.depth >= MAX_DEPTH:
            raise ThriftError(f"the struct nests deeper than {MAX_DEPTH} levels at byte {self.pos}")
        self.depth += 1
        try:
            return read()
        finally:
            self.depth -= 1

    def struct(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return out
            delta = head >> 4
            last = last + delta if delta else self.value(_I16)
            out[last] = self.value(kind)


def read_struct(data: bytes | memoryview, pos: int = 0) -> tuple[dict[int, Any], int]:
    """The struct whose encoding starts at ``data[pos]``, and the position after its end."""
    reader = _Reader(data, pos)
    return reader.struct(), reader.pos
