"""Tar headers, read without :mod:`tarfile`: where each member's data starts and ends.

A WebDataset shard is a plain tar. Every member has a 512-byte header; its data follows,
padded to a multiple of 512 bytes; two zero blocks end the archive. Long names and large
sizes are carried by headers of their own before the member they describe:

* POSIX PAX (``x``): ``"<len> path=<name>\\n"`` records, and ``size`` for members of 8 GiB and
  more. Python's ``tarfile`` (so ``webdataset.TarWriter`` with ``format="pax"``) writes one
  before a member whose name or mtime does not fit the plain header. ``g`` (global) headers
  are skipped.
* GNU (``L``): the next member's long name as data (``tar`` and ``tarfile``'s GNU format).
* POSIX ustar: a 155-byte ``prefix`` joined to the 100-byte name.

:func:`members` walks an archive given a ``read_at(offset, n)`` function (a local file, or the
bytes of a whole shard); :func:`members_of` walks the bytes of one sample's range. Headers
are checked (checksum, numbers); a header that fails raises :class:`TarError` with the
offset, and :func:`resync` finds the next good one.

Members are grouped into samples by WebDataset's rule (:func:`split_name`): the key is the
path up to the first dot of the file name, the extension the rest, lower-cased; members in a
row with the same key form one sample; names without a dot and ``__...__`` names are not
part of any sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)

_REGULAR = (b"0", b"\0", b"7")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos: size is not data
_PAX, _GLOBAL_PAX, _GNU_NAME, _GNU_LINK = b"x", b"g", b"L", b"K"
_MAX_META = 1 << 20  # the longest PAX or GNU long-name payload read: a name, not data
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


class TarError(ValueError):
    """A header that is not a tar header (bad checksum, a number that does not parse), or an
    archive that ends inside one. ``offset`` is where, in the archive or the range read."""

    def __init__(self, message: str, offset: int | None = None):
        super().__init__(message)
        self.offset = offset

    def __reduce__(self):
        return (type(self), (str(self), self.offset), self.__dict__)


@dataclass(frozen=True)
class Member:
    """One member: ``start`` is its first header block (a PAX or long-name header before the
    member's own, where there is one), ``offset`` its data, ``size`` the data's length."""

    name: str
    regular: bool
    start: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _number(field: bytes, what: str, at: int) -> int:
    if field and field[0] in (0x80, 0xFF):  # base-256 (GNU, star): big-endian after a flag byte, 0xff negative
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0xFF else value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarError(f"the tar header at byte {at} has an unreadable {what} {field!r}", at) from None


def _checksum_ok(block: bytes, at: int) -> bool:
    stored = _number(block[148:156], "checksum", at)
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if stored == unsigned:
        return True
    # some old writers summed signed bytes
    return stored == unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b > 127)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _header(block: bytes, at: int) -> tuple[str, bytes, int]:
    """``(name, typeflag, size)`` of the header ``block`` found at byte ``at``."""
    if not _checksum_ok(block, at):
        raise TarError(f"the tar header at byte {at} has a bad checksum (not a tar header, or a corrupt one)", at)
    name = _text(block[0:100])
    if block[257:263] == b"ustar\0":  # POSIX: a prefix may hold the name's directories
        prefix = _text(block[345:500])
        if prefix:
            name = f"{prefix}/{name}"
    kind = block[156:157]
    size = _number(block[124:136], "size", at)
    if size < 0:  # it would send the walk backwards, for ever
        raise TarError(f"the tar header at byte {at} has a negative size ({size}): a corrupt header", at)
    return name, kind, size


def _pax(payload: bytes, at: int) -> dict[str, str]:
    """The records of a PAX extended header: ``"<len> <key>=<value>\\n"``, ``len`` counting all."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(payload) and payload[pos:pos + 1] not in (b"\0", b""):
        space = payload.find(b" ", pos)
        try:
            length = int(payload[pos:space])
        except ValueError:
            raise TarError(f"the PAX header at byte {at} has a malformed record", at) from None
        if space < 0 or length <= space - pos or pos + length > len(payload):
            raise TarError(f"the PAX header at byte {at} has a malformed record", at)
        record = payload[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def members(read_at: Callable[[int, int], bytes], start: int = 0, stop: int | None = None) -> Iterator[Member]:
    """The members of an archive from byte ``start``, in order, until the end-of-archive block,
    the end of the data, or ``stop`` (where one sample's range ends: the range holds its
    members' data unpadded, so the walk ends there).

    A member whose data runs past the end is yielded all the same (its ``end`` is past what
    ``read_at`` returns): the caller tells a truncated archive by it. A header cut short
    raises :class:`TarError`.
    """
    pos = start
    first: int | None = None
    long_name: str | None = None
    pax: dict[str, str] = {}
    while stop is None or pos < stop:
        block = bytes(read_at(pos, BLOCK))
        if not block or block == ZERO_BLOCK:
            return
        if len(block) < BLOCK:
            raise TarError(f"the archive ends inside the tar header at byte {pos} "
                           f"({len(block)} of {BLOCK} bytes)", pos)
        name, kind, size = _header(block, pos)
        if first is None:
            first = pos
        data = pos + BLOCK
        if kind in (_PAX, _GLOBAL_PAX, _GNU_NAME, _GNU_LINK):
            if size > _MAX_META:
                raise TarError(f"the tar header at byte {pos} announces {size} bytes of metadata", pos)
            payload = bytes(read_at(data, size))
            if len(payload) < size:
                raise TarError(f"the archive ends inside the metadata of the tar header at byte {pos}", pos)
            if kind == _PAX:
                pax.update(_pax(payload, pos))
            elif kind == _GNU_NAME:
                long_name = payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == _GLOBAL_PAX:
                first = None  # describes the archive, not the member after it
            pos = data + padded(size)
            continue
        if "path" in pax:
            name = pax["path"]
        elif long_name is not None:
            name = long_name
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise TarError(f"the PAX header before byte {pos} has an unreadable size", pos) from None
            if size < 0:
                raise TarError(f"the PAX header before byte {pos} has a negative size ({size}): a corrupt header",
                               pos)
        if kind in _NO_DATA:
            size = 0
        yield Member(name, kind in _REGULAR, first, data, size)
        pos = data + padded(size)
        first, long_name, pax = None, None, {}


def members_of(data: bytes | memoryview, base: int = 0) -> Iterator[Member]:
    """The members in the bytes of one sample's range, which starts at byte ``base`` of the
    archive: offsets (the members' and the errors') are the archive's."""
    view = memoryview(data)
    return members(lambda offset, n: view[offset - base:offset - base + n], base, base + len(view))


def resync(read_at: Callable[[int, int], bytes], after: int, size: int) -> int | None:
    """The offset of the next good ustar header after byte ``after`` (on a 512-byte
    boundary), or ``None`` when there is none before ``size``: where reading goes on past a
    corrupt header."""
    pos = (after // BLOCK + 1) * BLOCK
    while pos + BLOCK <= size:
        block = bytes(read_at(pos, BLOCK))
        if block[257:262] == b"ustar":
            try:
                if _checksum_ok(block, pos):
                    return pos
            except TarError:
                pass
        pos += BLOCK
    return None


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` by WebDataset's rule, or ``None`` for a name that is part of no
    sample (no dot in the file name, or a ``__...__`` metadata name)."""
    if _META.match(name):
        return None
    match = _KEY_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()
