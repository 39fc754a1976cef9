"""Files kept in a local folder, one per version of a file elsewhere (its URL, size and tag:
an ETag or mtime), so that what was learnt from it once is not read again: a shard's index
(``_shards/index.py``), a Parquet file's footer (``_parquet/footer.py``).

Each is written whole under a temporary name and renamed, so no reader sees half of one; a
folder that cannot be written costs the work again next time and a warning, nothing more.
:func:`for_each_file` learns it for many files at once, all or none.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import Awaitable, Callable, Protocol, TypeVar

T = TypeVar("T")

logger = logging.getLogger("aioload")


async def for_each_file(urls: list[str], one: Callable[[str], Awaitable[T]], concurrency: int) -> list[T]:
    """``one(url)`` for every URL, ``concurrency`` at a time, the results in the order of
    ``urls``; the first failure cancels the others and is raised once they have all ended (no
    task outlives the call)."""
    slots = asyncio.Semaphore(concurrency)

    async def bounded(url: str) -> T:
        async with slots:
            return await one(url)

    tasks = [asyncio.ensure_future(bounded(url)) for url in urls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Version(Protocol):
    """What tells one version of a file from another (``aioload._shards.probe.Version``)."""

    @property
    def size(self) -> int: ...

    @property
    def tag(self) -> str: ...


class VersionedFiles:
    """One file per (URL, version) in ``folder``, named by a hash of both, ending in ``suffix``."""

    def __init__(self, folder: str | os.PathLike, suffix: str):
        self.folder = Path(folder)
        self.suffix = suffix

    def path(self, url: str, version: Version) -> Path:
        digest = hashlib.sha256(f"{url}\n{version.size}\n{version.tag}".encode("utf-8", "surrogateescape"))
        return self.folder / f"{digest.hexdigest()[:40]}{self.suffix}"

    def read(self, url: str, version: Version) -> bytes | None:
        """The bytes kept for this version, or None where none are."""
        try:
            return self.path(url, version).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, url: str, version: Version, data: bytes, what: str) -> None:
        """Keep ``data`` for this version; ``what`` names it in the warning where it cannot be kept."""
        path = self.path(url, version)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("could not keep %s in %s: %s", what, self.folder, exc)
