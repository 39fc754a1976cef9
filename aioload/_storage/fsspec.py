"""Reads and listings through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``, ...).

fsspec and its backends are optional. An async filesystem (s3fs, gcsfs, adlfs, ...) gets one
instance per event loop and :class:`aioload.Storage`, created with ``asynchronous=True``
and closed when the loop ends; a synchronous one (``memory://``, ``sftp://``, ...) is called
in the loop's executor, one hop per read.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aioload._storage import scope as _scope
from aioload._storage.retry import Permanent, Transient


def _filesystem_class(protocol: str):
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"reading {protocol}:// URLs needs fsspec and its backend: "
                          f"pip install 'aioload[fsspec]' (and s3fs, gcsfs, adlfs, ... for object stores)") from None
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ImportError(f"reading {protocol}:// URLs needs fsspec's backend for it: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"no storage reads {protocol}:// URLs: {exc}") from exc


def split(url: str) -> tuple[str, str]:
    protocol, _, _ = url.partition("://")
    return protocol, _filesystem_class(protocol)._strip_protocol(url)


async def _close(fs) -> None:
    creator = getattr(fs, "_s3creator", None)  # s3fs: closes every client it made, per region
    if creator is not None:
        await creator.__aexit__(None, None, None)
        return
    session = getattr(fs, "_session", None)
    if session is not None and hasattr(session, "close"):
        result = session.close()
        if asyncio.iscoroutine(result):
            await result


async def _filesystem(owner, protocol: str, options: dict[str, Any]):
    cls = _filesystem_class(protocol)
    if not getattr(cls, "async_impl", False):
        import fsspec

        return fsspec.filesystem(protocol, **options)
    make = functools.partial(cls, asynchronous=True, skip_instance_cache=True, **options)
    return await _scope.get(("fsspec", owner, protocol), make, _close)


async def read(owner, url: str, options: dict[str, Any], timeout: float, start: int | None = None,
               end: int | None = None, max_bytes: int | None = None) -> bytes:
    """One attempt at reading ``url`` (bytes ``start:end``), classified for the retry loop.

    More than ``max_bytes`` fails as an HTTP body would, once the bytes have arrived (the
    filesystem's own client reads them)."""
    protocol, path = split(url)
    fs = await _filesystem(owner, protocol, options)
    try:
        async with asyncio.timeout(timeout):
            if getattr(fs, "async_impl", False):
                data = await fs._cat_file(path, start=start, end=end)
            else:
                call = functools.partial(fs.cat_file, path, start=start, end=end)
                data = await asyncio.get_running_loop().run_in_executor(None, call)
    except FileNotFoundError as exc:
        raise Permanent(f"not found: {exc}", missing=True) from exc
    except (PermissionError, IsADirectoryError, NotADirectoryError, ValueError) as exc:
        raise Permanent(f"{type(exc).__name__}: {exc}") from exc
    except TimeoutError as exc:
        raise Transient(f"no complete response within timeout={timeout:g} s") from exc
    except OSError as exc:
        raise Transient(f"{type(exc).__name__}: {exc}") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise Permanent(f"the object of {len(data)} bytes is larger than max_bytes={max_bytes}",
                        remedy="not retried: pass Storage(max_bytes=...) to read larger objects")
    return data


def find(url: str, options: dict[str, Any]) -> dict[str, str]:
    """Everything under ``url``: ``{path relative to url: "file" or "directory"}``."""
    protocol, root = split(url)
    root = root.rstrip("/")

    async def listing():
        fs = await _filesystem(listing, protocol, options)
        if getattr(fs, "async_impl", False):
            return await fs._find(root, withdirs=True, detail=True)
        return fs.find(root, withdirs=True, detail=True)

    found = _scope.run_blocking(listing)
    prefix = root + "/"
    return {path[len(prefix):]: info.get("type", "file") for path, info in found.items()
            if path.startswith(prefix)}
