"""A cache of remote objects in a local directory: bounded in bytes, least recently used
evicted first, atomic writes, and checked reads, so that it survives crashes and restarts.

Layout: ``directory/ab/abcdef...`` where the name is the SHA-256 of the key (the URL); each
file is a 16-byte header (magic, length) followed by the object. Recency is the file's
modification time, set at full resolution on every write and hit.
"""

from __future__ import annotations

import collections
import hashlib
import os
import struct
import threading
import time

from aioload._cache import CacheStats, Counters, check_budget

__all__ = ["DiskCache"]

_MAGIC = b"aioload\x01"
_HEADER = struct.Struct("<8sQ")
_STALE_TMP_S = 3600.0


class DiskCache:
    """Remote objects kept in ``directory``, at most ``max_bytes`` of files, least recently
    used evicted first. Local paths are never copied into it.

    Writes go to a temporary file renamed into place, so a crash never leaves a partial
    object; each file carries its length and is checked on read. The cache survives
    restarts and can be shared by several loaders; the budget is kept by each process for
    the files it knows of (processes sharing one directory should share one budget in mind).
    """

    blocking = True  # get/put touch the disk: called in the loop's executor
    remote_only = True

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        check_budget(max_bytes)
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = max_bytes
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] | None = None  # name -> file size, LRU first
        self._bytes = 0
        self._n = Counters()

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name[:2], name)

    def _loaded(self) -> collections.OrderedDict[str, int]:
        """The index, scanned from the directory on first use (called with the lock held)."""
        if self._index is None:
            found = []
            now = time.time()
            os.makedirs(self.directory, exist_ok=True)
            for sub in os.scandir(self.directory):
                if not sub.is_dir() or len(sub.name) != 2:
                    continue
                for entry in os.scandir(sub.path):
                    st = entry.stat()
                    if entry.name.startswith("."):
                        if now - st.st_mtime > _STALE_TMP_S:  # left by a crashed writer
                            _unlink(entry.path)
                        continue
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
            found.sort()
            self._index = collections.OrderedDict((name, size) for _, name, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._evict(0)
        return self._index

    def _evict(self, room: int) -> None:
        while self._index and self._bytes + room > self.max_bytes:
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            self._n.evictions += 1
            _unlink(self._path(name))

    def get(self, key: str) -> bytes | None:
        self._own()
        name = _name(key)
        path = self._path(name)
        with self._lock:
            self._loaded()
        data = _read_checked(path)
        with self._lock:
            index = self._loaded()
            if data is None:
                self._n.misses += 1
                if name in index:
                    self._bytes -= index.pop(name)
                return None
            self._n.hits += 1
            if name not in index:  # written by another process sharing the directory
                index[name] = _HEADER.size + len(data)
                self._bytes += index[name]
            index.move_to_end(name)
        try:
            _touch(path)  # recency survives a restart
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        self._own()
        size = _HEADER.size + len(data)
        name = _name(key)
        if size > self.max_bytes:
            with self._lock:
                self._n.rejected += 1
            return
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, len(data)))
            f.write(data)
        _touch(tmp)
        with self._lock:
            index = self._loaded()
            if name in index:
                self._bytes -= index.pop(name)
            self._evict(size)
            os.replace(tmp, path)
            index[name] = size
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            index = self._loaded()
            for name in list(index):
                _unlink(self._path(name))
            index.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        self._own()
        with self._lock:
            index = self._loaded()
            n = self._n
            return CacheStats(n.hits, n.misses, len(index), self._bytes, self.max_bytes, n.evictions, n.rejected)

    def __getstate__(self):
        return {"directory": self.directory, "max_bytes": self.max_bytes}

    def __setstate__(self, state) -> None:
        self.directory = state["directory"]
        self.max_bytes = state["max_bytes"]
        self._reset()

    def __repr__(self) -> str:
        return f"DiskCache({self.directory!r}, max_bytes={self.max_bytes})"


def _name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _read_checked(path: str) -> bytes | None:
    """The object stored at ``path``, or None when it is missing or damaged (then removed)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    if len(blob) >= _HEADER.size:
        magic, length = _HEADER.unpack_from(blob)
        if magic == _MAGIC and length == len(blob) - _HEADER.size:
            return blob[_HEADER.size:]
    _unlink(path)
    return None


def _touch(path: str) -> None:
    """Set the access and modification time to now, at full resolution (the kernel stamps
    writes with a coarse clock, too coarse to order objects used a millisecond apart)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
