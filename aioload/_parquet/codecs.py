"""A page's body decompressed to exactly the size its header claims, or :class:`CodecError`.

pyarrow's ``pa.decompress(body, decompressed_size=n)`` allocates ``n`` bytes and returns them
all, however few the codec wrote (snappy, gzip, brotli, LZ4_RAW and zstd alike), so a header
that claims more than its page holds would hand out the rest of a reused buffer as values.
pyarrow's own reader refuses such a page ("Page didn't decompress to expected size"); so does
:func:`decompress`, at the lowest cost each codec allows:

* uncompressed: the body's length is the size;
* snappy: its stream starts with the decompressed length (a varint) and snappy's decoder
  checks the stream against it; a zstd frame usually carries its content size, which zstd
  checks likewise: both are compared before anything is allocated;
* gzip: decompressed with ``zlib``, stopping one byte past the claim; brotli and a zstd frame
  without its size: streamed (pyarrow's ``CompressedInputStream``) a MiB at a time, stopping
  one byte past the claim, so that a false claim allocates nothing;
* LZ4_RAW (no stream format): decompressed into the claimed size, then the same bytes into one
  byte less, which the codec must refuse (it would have had to write past the end): such a
  page costs twice its decompression. LZ4 cannot grow a block more than 255 times, so a larger
  claim is refused before anything is allocated.

Every claim is a Thrift i32 (at most 2 GiB), checked before use.
"""

from __future__ import annotations

import zlib
from typing import Any

I32_MAX = (1 << 31) - 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class CodecError(ValueError):
    """A page body that does not decompress to the size its header claims."""


def decompress(body: Any, codec: str | None, size: int) -> memoryview:
    """``body`` decompressed with ``codec`` (``None``: stored as is), which must give exactly
    ``size`` bytes."""
    view = memoryview(body)
    if not 0 <= size <= I32_MAX:
        raise CodecError(f"the page claims {size} bytes decompressed, outside [0, {I32_MAX}]")
    if codec is None:
        if len(view) != size:
            raise CodecError(f"the page is stored uncompressed in {len(view)} bytes and claims {size}")
        return view
    if codec == "gzip":
        return _gzip(view, size)
    known = _snappy_size(view) if codec == "snappy" else _zstd_size(view) if codec == "zstd" else None
    if known is not None and known != size:
        raise CodecError(f"the {codec} page decompresses to {known} bytes and its header claims {size}")
    if codec == "brotli" or codec == "zstd" and known is None:
        return _streamed(view, codec, size)
    if codec == "lz4_raw" and size > 255 * len(view) + 16:
        raise CodecError(f"the lz4_raw page of {len(view)} bytes claims {size} decompressed, more than LZ4 can "
                         "expand it")
    out = _pyarrow(view, codec, size)
    if known is None and size and _fits(view, codec, size - 1):
        raise CodecError(f"the {codec} page decompresses to fewer bytes than the {size} its header claims")
    return out


def _pyarrow(view: memoryview, codec: str, size: int) -> memoryview:
    import pyarrow as pa

    try:
        return memoryview(pa.decompress(view, decompressed_size=size, codec=codec))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CodecError(f"the {codec} page cannot be decompressed ({exc})") from None


def _fits(view: memoryview, codec: str, size: int) -> bool:
    """Whether the body decompresses into ``size`` bytes."""
    try:
        _pyarrow(view, codec, size)
    except CodecError:
        return False
    return True


STREAM_STEP = 1 << 20


def _streamed(view: memoryview, codec: str, size: int) -> memoryview:
    import pyarrow as pa

    out = bytearray()
    try:
        stream = pa.CompressedInputStream(pa.py_buffer(view), codec)
        while len(out) <= size:
            piece = stream.read(min(STREAM_STEP, size + 1 - len(out)))
            if not piece:
                break
            out += piece
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CodecError(f"the {codec} page cannot be decompressed ({exc})") from None
    if len(out) != size:
        got = f"{len(out)} bytes" if len(out) <= size else "more bytes"
        raise CodecError(f"the {codec} page decompresses to {got} and its header claims {size}")
    return memoryview(out)


def _gzip(view: memoryview, size: int) -> memoryview:
    inflate = zlib.decompressobj(wbits=47)  # a gzip or zlib header, as pyarrow accepts
    try:
        out = inflate.decompress(view, size + 1)
    except zlib.error as exc:
        raise CodecError(f"the gzip page cannot be decompressed ({exc})") from None
    if len(out) != size or not inflate.eof:
        got = f"{len(out)} bytes" if len(out) <= size else "more bytes"
        raise CodecError(f"the gzip page decompresses to {got} and its header claims {size}")
    return memoryview(out)


def _varint(view: memoryview, pos: int, most: int) -> tuple[int, int] | None:
    out = 0
    for shift in range(0, 7 * most, 7):
        if pos >= len(view):
            return None
        b = view[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
    return None


def _snappy_size(view: memoryview) -> int:
    found = _varint(view, 0, 5)
    if found is None:
        raise CodecError("the snappy page does not start with its decompressed length")
    return found[0]


def _zstd_size(view: memoryview) -> int | None:
    """The content size a zstd frame's header gives, or ``None`` where it gives none."""
    if len(view) < 6 or bytes(view[:4]) != _ZSTD_MAGIC:
        return None
    fhd = view[4]
    single, dict_flag, fcs_flag = fhd >> 5 & 1, fhd & 3, fhd >> 6
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if not width or at + width > len(view):
        return None
    n = int.from_bytes(view[at:at + width], "little")
    return n + 256 if width == 2 else n
