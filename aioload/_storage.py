"""Reading bytes from storage, for ``Dataset.read`` implementations.

Local files are read with one call into a thread (``aiofiles``' executor wrapper): open, read
and close together cost one hand-off instead of three.
"""

from __future__ import annotations

import os

import aiofiles.os


def _read_local(path, offset: int = 0, length: int | None = None) -> bytes:
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read() if length is None else f.read(length)


_read_local_async = aiofiles.os.wrap(_read_local)


async def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole content of ``path``."""
    return await _read_local_async(os.fspath(path))


async def read_range(path: str | os.PathLike, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` starting at ``offset`` (fewer at the end of the file)."""
    if offset < 0 or length < 0:
        raise ValueError(f"offset and length must be >= 0, got offset={offset}, length={length}")
    return await _read_local_async(os.fspath(path), offset, length)


def read_bytes_blocking(path: str | os.PathLike) -> bytes:
    return _read_local(os.fspath(path))
