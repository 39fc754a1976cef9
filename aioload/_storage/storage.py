"""Reading bytes from storage, for ``Dataset.read`` implementations.

One entry point for every place data lives, chosen by the URL's scheme:

* a local path (or ``file://`` URL): one call into a thread (``aiofiles``' executor wrapper),
  open, read and close together, one hand-off instead of three;
* ``http://`` and ``https://``: aioload's own HTTP/1.1 client (``_http`` over ``h1``), one
  keep-alive pool per event loop and origin, retried per :class:`RetryPolicy`, bounded by
  ``max_bytes``, redirects followed within the URL's origin;
* any other ``scheme://`` (``s3://``, ``gs://``, ``memory://``, ...): fsspec, when it and the
  backend are installed (see ``_fsspec``), retried the same way.

A :class:`Storage` carries the options (retries, timeouts, connections, a cache); the
module-level :func:`read_bytes` and :func:`read_range` use a default one.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

import aiofiles.os

from aioload._storage import fsspec as _fsspec

from aioload._storage import http as _http

from aioload._storage import scope as _scope
from aioload._storage.cache import MemoryCache, range_key
from aioload._storage.diskcache import DiskCache
from aioload._storage.retry import RetryPolicy, retrying

__all__ = ["Storage", "read_bytes", "read_range"]

DEFAULT_MAX_BYTES = 1 << 30
"""The largest object a remote read returns unless ``Storage(max_bytes=...)`` says otherwise."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def _read_local(path, offset: int = 0, length: int | None = None) -> bytes:
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read() if length is None else f.read(length)


_read_local_async = aiofiles.os.wrap(_read_local)


def locate(target: str | bytes) -> tuple[str, Any]:
    """``("local", path)``, ``("http", url)`` or ``("fsspec", url)``."""
    if isinstance(target, bytes):
        return "local", target
    match = _SCHEME.match(target)
    if match is None:
        return "local", target
    scheme = match.group(1).lower()
    if scheme == "file":
        return "local", unquote(urlsplit(target).path)
    if scheme in ("http", "https"):
        return "http", target
    return "fsspec", target


def is_url(target: str) -> bool:
    """Whether ``target`` names something other than a local file."""
    return locate(target)[0] != "local"


def _check_range(offset, length) -> None:
    for name, value in (("offset", offset), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    if offset < 0 or length < 0:
        raise ValueError(f"offset and length must be >= 0, got offset={offset}, length={length}")


class Storage:
    """How reads reach local files, HTTP servers and object stores.

    * ``retry`` -- a :class:`aioload.RetryPolicy`: per-attempt timeout, attempts, backoff.
    * ``cache`` -- a :class:`aioload.MemoryCache` or :class:`aioload.DiskCache`, or None.
    * ``connections_per_host`` -- open HTTP connections per host, per event loop. Reads
      beyond it wait for a free connection (the loader's ``io_concurrency`` bounds reads in
      flight overall; keep this at or above it for one host).
    * ``headers`` -- sent with every HTTP request to the URL's own origin (for instance
      ``Authorization``); never sent to another origin a redirect leads to.
    * ``storage_options`` -- keyword arguments for the fsspec filesystem
      (``{"anon": True}``, ``{"endpoint_url": ...}``, credentials).
    * ``max_bytes`` -- the largest object a remote read returns (1 GiB by default). An HTTP
      body is checked against it from its ``Content-Length`` and while it streams, so a larger
      or endless body fails before it fills memory; an fsspec object is checked once read.
      Such a read fails at once with a :class:`RemoteReadError` (not retried). Local files
      are not limited.
    * ``decompress`` -- False (the default): HTTP bodies are kept as the server sent them,
      and ``Accept-Encoding: identity`` asks for them unencoded. True: whole reads accept
      gzip and deflate and return the decoded bytes, ``max_bytes`` bounding the decoded size.
    * ``redirects`` -- ``"same-origin"`` (the default): HTTP redirects are followed only to
      the same scheme, host and port; ``"any"``: to any http(s) URL, without ``headers``
      beyond the URL's own origin; ``"none"``: never. A redirect from https to http is never
      followed; at most 10 are followed per read.

    A Storage is cheap and picklable (its cache travels without its contents); sessions and
    clients are made per event loop on first use and closed when that loop ends, or by
    ``await storage.aclose()`` / ``async with storage:`` on a loop of your own.
    """

    def __init__(self, *, retry: RetryPolicy | None = None, cache: MemoryCache | DiskCache | None = None,
                 connections_per_host: int = 64, headers: Mapping[str, str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 decompress: bool = False, redirects: str = "same-origin"):
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be an aioload.RetryPolicy, got {type(retry).__name__}")
        if cache is not None and not isinstance(cache, (MemoryCache, DiskCache)):
            raise TypeError(f"cache must be an aioload.MemoryCache or aioload.DiskCache, got {type(cache).__name__}")
        if isinstance(connections_per_host, bool) or not isinstance(connections_per_host, int):
            raise TypeError(f"connections_per_host must be an int >= 1, got {connections_per_host!r}")
        if connections_per_host < 1:
            raise ValueError(f"connections_per_host must be >= 1, got {connections_per_host}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not isinstance(decompress, bool):
            raise TypeError(f"decompress must be True or False, got {decompress!r}")
        if headers is not None:
            _http.check_headers(headers)
        if redirects not in _http.REDIRECTS:
            raise ValueError(f"redirects must be 'same-origin', 'any' or 'none', got {redirects!r}")
        self.retry = retry if retry is not None else RetryPolicy()
        self.cache = cache
        self.connections_per_host = connections_per_host
        self.headers = dict(headers) if headers else None
        self.storage_options = dict(storage_options) if storage_options else {}
        self.max_bytes = max_bytes
        self.decompress = decompress
        self.redirects = redirects
        self._rng = random.Random()

    # -- reads -----------------------------------------------------------------------------
    async def read_bytes(self, target: str | os.PathLike) -> bytes:
        """The whole content of a local path or URL."""
        return _frozen(await self._read(os.fspath(target), None, None))

    async def read_range(self, target: str | os.PathLike, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the object)."""
        _check_range(offset, length)
        if length == 0:
            return b""
        return _frozen(await self._read(os.fspath(target), offset, length))

    def read_bytes_blocking(self, target: str | os.PathLike) -> bytes:
        """:meth:`read_bytes` for synchronous code (``__getitem__``, torch's DataLoader)."""
        target = os.fspath(target)
        kind, where = locate(target)
        cache = self._cache_for(kind)
        if cache is not None:
            data = cache.get(target)
            if data is not None:
                return data
        if kind == "local":
            data = _read_local(where)
        else:
            data = _frozen(_scope.run_blocking(lambda: self._fetch(kind, where, None, None)))
        if cache is not None:
            cache.put(target, data)
        return data

    async def _read(self, target, offset: int | None, length: int | None) -> bytes | bytearray:
        kind, where = locate(target)
        cache = self._cache_for(kind)
        if cache is None:
            return await self._fetch(kind, where, offset, length)
        key = target if offset is None else range_key(target, offset, length)
        data = await _cache_call(cache, cache.get, key)
        if data is not None:
            return data
        # a cached object is shared: never a buffer that can change
        data = _frozen(await self._fetch(kind, where, offset, length))
        await _cache_call(cache, cache.put, key, data)
        return data

    async def _fetch(self, kind: str, where, offset: int | None, length: int | None) -> bytes | bytearray:
        if kind == "local":
            return await _read_local_async(where, offset or 0, length)
        policy = self.retry
        if kind == "http":
            client = _http.existing(self) or await _http.client(self, self.connections_per_host, self.headers)
            attempt = lambda: _http.get(client, where, policy.timeout, offset, length,  # noqa: E731
                                        max_bytes=self.max_bytes, decompress=self.decompress,
                                        redirects=self.redirects)
        else:
            end = None if offset is None or length is None else offset + length
            attempt = lambda: _fsspec.read(self, where, self.storage_options, policy.timeout, offset, end,  # noqa: E731
                                           max_bytes=self.max_bytes)
        return await retrying(policy, where, attempt, self._rng)

    def _cache_for(self, kind: str):
        cache = self.cache
        if cache is None or (cache.remote_only and kind == "local"):
            return None
        return cache

    # -- lifetime --------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close this storage's sessions on the running loop now (they are otherwise closed
        when the loop ends). Reading again opens new ones."""
        await _scope.release(self)

    async def __aenter__(self) -> "Storage":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (f"Storage(retry={self.retry!r}, cache={self.cache!r}, "
                f"connections_per_host={self.connections_per_host}, max_bytes={self.max_bytes}, "
                f"decompress={self.decompress}, redirects={self.redirects!r})")


def _frozen(data: bytes | bytearray) -> bytes:
    """``bytes`` of what a transport returned (an HTTP body comes as the bytearray it was
    received into)."""
    return bytes(data) if type(data) is not bytes else data


async def read_buffer(storage: Storage, target: str | os.PathLike, offset: int | None = None,
                      length: int | None = None) -> bytes | bytearray:
    """:meth:`Storage.read_bytes` (or, given ``offset`` and ``length``, :meth:`Storage.read_range`)
    without its last copy: an HTTP body comes back as the ``bytearray`` it was received into.
    For callers that take the bytes apart themselves (a shard's members, a whole shard); the
    caller owns the buffer and must not hand it on where ``bytes`` are promised."""
    if offset is None:
        return await storage._read(os.fspath(target), None, None)
    _check_range(offset, length)
    if length == 0:
        return b""
    return await storage._read(os.fspath(target), offset, length)


async def read_into(storage: Storage, target: str | os.PathLike, into: Callable[[int], memoryview]) -> int:
    """The whole content of ``target`` received into the buffer ``into(size)`` returns (a
    writable byte ``memoryview`` of exactly ``size`` bytes, which this releases once it is
    written), without a buffer of its own in between: a local file is ``readinto`` it, an
    HTTP body of known length is received there from the socket. Returns the size. A retry
    asks ``into`` for a buffer again and writes it from its start, so the caller keeps the
    last one it gave (earlier ones hold a failed attempt's bytes). An HTTP body without a
    ``Content-Length`` (chunked, or decoded with ``decompress=True``), a cached read and an
    fsspec read are gathered first and copied in. A local file that changes size while it is
    read raises ``OSError``."""
    target = os.fspath(target)
    kind, where = locate(target)
    if kind == "local" and storage._cache_for(kind) is None:
        return await asyncio.to_thread(_read_local_into, where, into)
    if kind == "http" and storage._cache_for(kind) is None:
        policy = storage.retry
        client = _http.existing(storage) or await _http.client(storage, storage.connections_per_host, storage.headers)
        attempt = lambda: _http.get_into(client, where, policy.timeout, into, max_bytes=storage.max_bytes,  # noqa: E731
                                         decompress=storage.decompress, redirects=storage.redirects)
        return await retrying(policy, where, attempt, storage._rng)
    data = await storage._read(target, None, None)
    with into(len(data)) as view:
        view[:] = data
    return len(data)


def _read_local_into(path, into: Callable[[int], memoryview]) -> int:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        with into(size) as view:
            have = 0
            while have < size:
                got = f.readinto(view[have:])
                if not got:
                    raise OSError(f"{os.fsdecode(path)}: the file ended after {have} of its {size} bytes: it "
                                  "changed while it was read; read it again once it is no longer written to")
                have += got
        if f.read(1):
            raise OSError(f"{os.fsdecode(path)}: the file grew beyond its {size} bytes while it was read; "
                          "read it again once it is no longer written to")
    return size


async def _cache_call(cache, method, *args):
    if cache.blocking:
        return await asyncio.get_running_loop().run_in_executor(None, method, *args)
    return method(*args)


_DEFAULT = Storage()


async def read_bytes(target: str | os.PathLike, *, storage: Storage | None = None) -> bytes:
    """The whole content of a local path, ``http(s)://`` URL or fsspec URL (``s3://...``).

    ``storage``: the options to read with (retries, timeouts, cache, ``max_bytes``,
    ``decompress``, ``redirects``); a default :class:`Storage` otherwise.
    """
    return await (storage or _DEFAULT).read_bytes(target)


async def read_range(target: str | os.PathLike, offset: int, length: int, *,
                     storage: Storage | None = None) -> bytes:
    """``length`` bytes of ``target`` starting at ``offset`` (fewer at the end of the object)."""
    return await (storage or _DEFAULT).read_range(target, offset, length)


def read_bytes_blocking(target: str | os.PathLike, storage: Storage | None = None) -> bytes:
    """:func:`read_bytes` for synchronous code."""
    return (storage or _DEFAULT).read_bytes_blocking(target)
