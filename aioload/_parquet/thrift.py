"""Thrift's compact protocol, read: how Parquet writes its footer, its page index and each
page's header.

:func:`read_struct` turns the bytes of one struct into ``{field id: value}``: integers as ints,
binary and strings as bytes, lists as lists, nested structs as dicts of their own. The
Parquet modules name the field ids they use (``parquet.thrift``'s numbering); fields they do
not know are read past and kept, unused. A struct that runs past its bytes, or a type this
reader does not know, raises :class:`ThriftError`.
"""

from __future__ import annotations

import struct
from typing import Any

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)


class ThriftError(ValueError):
    """Bytes that are not the compact encoding of a Thrift struct."""


class _Reader:
    def __init__(self, data: bytes | memoryview, pos: int = 0):
        self.data, self.pos = memoryview(data), pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ThriftError(f"the struct runs past its {len(self.data)} bytes")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7

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
            return self.zigzag()
        if kind == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if kind == _BINARY:
            return self.take(self.varint())
        if kind in (_LIST, _SET):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if element in (_TRUE, _FALSE):  # a list's booleans are one byte each
                return [self.byte() == 1 for _ in range(size)]
            return [self.value(element) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            if not size:
                return {}
            kinds = self.byte()
            return {self.value(kinds >> 4): self.value(kinds & 0x0F) for _ in range(size)}
        if kind == _STRUCT:
            return self.struct()
        raise ThriftError(f"unknown compact type {kind} at byte {self.pos}")

    def struct(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return out
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            out[last] = self.value(kind)


def read_struct(data: bytes | memoryview, pos: int = 0) -> tuple[dict[int, Any], int]:
    """The struct whose encoding starts at ``data[pos]``, and the position after its end."""
    reader = _Reader(data, pos)
    return reader.struct(), reader.pos
