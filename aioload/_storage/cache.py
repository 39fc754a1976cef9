"""Caches of raw bytes, so that later epochs skip the storage: in memory here, in a directory
in ``_diskcache``.

Both are bounded in bytes. Pass one as ``cache=`` to :class:`aioload.ImageFolder`,
:class:`aioload.ImageFiles` or :class:`aioload.Storage` (for your own datasets' reads).

Sizing: a :class:`MemoryCache` holds raw (encoded) bytes, about 110 KB per ImageNet JPEG, in
the loader's main process; give it what RAM you can spare. A :class:`DiskCache` suits remote
objects on a fast local disk, and survives restarts; size it to the local disk you can spare.

Keys: a whole object is cached under its path or URL as given, a byte range under
:func:`range_key`, a tuple, so that no path or URL (``a#bytes=0+4`` is a valid file name) can
ever get another object's range.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass
from typing import Union

__all__ = ["CacheKey", "CacheStats", "LoaderShare", "MemoryCache", "check_budget", "loader_cache_bytes", "range_key"]

CacheKey = Union[str, bytes, tuple]  # a path or URL (whole objects), or a range_key()


def range_key(target: str | bytes, offset: int, length: int | None) -> tuple[str, str, int, int | None]:
    """The cache key of ``length`` bytes from ``offset`` of ``target``."""
    return ("range", os.fsdecode(target), offset, length)


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a cache's counters (``cache.stats()``)."""

    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int
    evictions: int
    rejected: int  # objects not stored: larger than the budget, or the cache was full

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


def check_budget(max_bytes) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int number of bytes, got {max_bytes!r}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")


class Counters:
    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.rejected = 0


class MemoryCache:
    """Raw bytes in the loader's process, at most ``max_bytes`` of them.

    ``eviction="none"`` (the default) keeps the first objects that fit and stores no more
    once the budget is used: with a dataset larger than the budget, every epoch still reads
    ``max_bytes`` worth from RAM. ``"lru"`` evicts the least recently used object instead,
    which suits reads that return to recent objects but thrashes on epoch-long scans (a
    sequential epoch over a dataset larger than the budget then never hits).
    """

    blocking = False  # get/put never wait on I/O: called on the event loop directly
    remote_only = False

    def __init__(self, max_bytes: int, *, eviction: str = "none"):
        check_budget(max_bytes)
        if eviction not in ("none", "lru"):
            raise ValueError(f"eviction must be 'none' or 'lru', got {eviction!r}")
        self.max_bytes = max_bytes
        self.eviction = eviction
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[CacheKey, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._n = Counters()

    cache_kind = "memory_cache"  # its bytes in loader.stats()

    def held_bytes(self) -> int:
        return self._bytes if self._pid == os.getpid() else 0

    def _own(self) -> None:
        if self._pid != os.getpid():  # a forked child starts empty, with a fresh lock
            self._reset()

    def get(self, key: CacheKey) -> bytes | None:
        self._own()
        with self._lock:
            data = self._items.get(key)
            if data is None:
                self._n.misses += 1
                return None
            self._n.hits += 1
            if self.eviction == "lru":
                self._items.move_to_end(key)
            return data

    def put(self, key: CacheKey, data: bytes) -> None:
        self._own()
        data = bytes(data)
        size = len(data)
        with self._lock:
            if key in self._items:
                return
            if size > self.max_bytes:
                self._n.rejected += 1
                return
            if self.eviction == "lru":
                while self._bytes + size > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= len(old)
                    self._n.evictions += 1
            elif self._bytes + size > self.max_bytes:
                self._n.rejected += 1
                return
            self._items[key] = data
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        self._own()
        with self._lock:
            n = self._n
            return CacheStats(n.hits, n.misses, len(self._items), self._bytes, self.max_bytes, n.evictions, n.rejected)

    def __getstate__(self):
        # Worker processes get the budget, never the contents (reads happen in the main process).
        return {"max_bytes": self.max_bytes, "eviction": self.eviction}

    def __setstate__(self, state) -> None:
        self.max_bytes = state["max_bytes"]
        self.eviction = state["eviction"]
        self._reset()

    def __repr__(self) -> str:
        return f"MemoryCache(max_bytes={self.max_bytes}, eviction={self.eviction!r})"


def entries_bytes(entries: collections.OrderedDict | None) -> int:
    """What an index of ``name -> (size, time)`` entries weighs in memory (the dict, its names
    and its tuples; the ints of a tuple with it)."""
    if not entries:
        return 0
    return sys.getsizeof(entries) + sum(sys.getsizeof(name) + 120 for name in entries)


# -- one bound for a loader's processes together ------------------------------------------------

LOADER_CACHE_BYTES = 1 << 30
"""The default bound on what the caches of one loader's processes hold together (Parquet's row
groups and pages): 1 GiB, or an eighth of the memory this process may use if that is less.
Per-process defaults multiplied with ``num_workers`` (512 MiB of row groups plus 512 MiB of
pages per worker: 8 GiB at 8 workers, kept across epochs); this one does not."""


def memory_limit(cgroup: str = "/sys/fs/cgroup") -> int | None:
    """The bytes this process may use: its cgroup's limit (v2 ``memory.max``, v1
    ``memory/memory.limit_in_bytes``) where one is set, else the machine's memory
    (``/proc/meminfo``); ``None`` where neither can be read."""
    for path in (f"{cgroup}/memory.max", f"{cgroup}/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def loader_cache_bytes(cgroup: str = "/sys/fs/cgroup") -> int:
    """The default loader-wide cache bound: :data:`LOADER_CACHE_BYTES`, or an eighth of
    :func:`memory_limit` where that is less."""
    limit = memory_limit(cgroup)
    return LOADER_CACHE_BYTES if limit is None else min(LOADER_CACHE_BYTES, limit // 8)


class LoaderShare:
    """A cache bound that a loader's processes share: ``int(share)`` is this process's part,
    ``total * fraction`` split evenly among the loader's workers in a worker (torch's
    ``get_worker_info()``), all of it in the training process (``num_workers=0``). Decided in
    the process that uses it, once per process (a forked worker's copy decides again).
    ``total`` ``None``: :func:`loader_cache_bytes`."""

    def __init__(self, total: int | None = None, fraction: float = 1.0):
        self.total, self.fraction = total, fraction
        self._mine: tuple[int, int] | None = None  # (pid, bytes)

    def __int__(self) -> int:
        pid = os.getpid()
        if self._mine is None or self._mine[0] != pid:
            import torch.utils.data

            info = torch.utils.data.get_worker_info()
            total = loader_cache_bytes() if self.total is None else self.total
            self._mine = (pid, int(total * self.fraction) // (info.num_workers if info is not None else 1))
        return self._mine[1]

    def __getstate__(self):  # a spawned worker decides its own part
        return {"total": self.total, "fraction": self.fraction, "_mine": None}

    def __repr__(self) -> str:
        total = "loader_cache_bytes()" if self.total is None else self.total
        return f"LoaderShare({total} x {self.fraction} over the workers)"
