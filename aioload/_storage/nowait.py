"""Local reads that need no wait: bytes already in the page cache, read in the calling thread.

A local read goes through a thread (:mod:`aioload._storage.storage`), because a file on a slow
disk or a network file system can block for milliseconds. But most reads of a dataset that fits
in memory need no wait: the bytes are in the kernel's page cache, and the trip through a thread
and back to the event loop costs more CPU than the read (tens of microseconds against a few).
:class:`NoWait` reads with ``preadv2(RWF_NOWAIT)``, which the kernel answers from the page
cache or refuses (``EAGAIN``) without blocking; a refused or short read returns ``None`` and
the caller reads the usual way (which also reports a file cut short). Where the kernel or the
file system does not support the flag (not Linux, or ``EOPNOTSUPP``), it is not tried again.

File descriptors are kept open, at most :data:`MAX_OPEN` per reader (the least recently used
closed first), and closed with the reader; a copy of a reader (a spawned worker's) starts with
none. The bytes are read into buffers the reader takes again once nothing else holds them
(:class:`~aioload._storage.buffers.Buffers`). A file replaced on disk (written again and
renamed) is read as it was when first opened, which for a Parquet file is the file its footer
was read from.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

from aioload._storage.buffers import Buffers
from aioload._storage.storage import Storage, locate

MAX_OPEN = 64
_FLAG = getattr(os, "RWF_NOWAIT", None)


def _close(fds: OrderedDict) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class NoWait:
    """Page-cache reads of local files for one reader (see the module docstring)."""

    def __init__(self):
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._buffers = Buffers()  # taken under the lock
        self.supported = _FLAG is not None and hasattr(os, "preadv")
        self._finalizer = weakref.finalize(self, _close, self._fds)

    def __getstate__(self):  # a copy starts with no descriptor open
        return {}

    def __setstate__(self, state):
        self.__init__()

    def close(self) -> None:
        with self._lock:
            _close(self._fds)

    def read(self, storage: Storage, target: str, offset: int, length: int) -> bytearray | None:
        """``length`` bytes of ``target`` from ``offset`` where it is a local file (read
        through ``storage``, which caches no local read) whose bytes are all in the page cache;
        else ``None``."""
        if not self.supported or length <= 0:
            return None
        kind, path = locate(target)
        if kind != "local" or storage._cache_for(kind) is not None:
            return None
        with self._lock:
            fd = self._fd(path)
            if fd is None:
                return None
            buffer = self._buffers.take(length)
            try:
                got = os.preadv(fd, [buffer], offset, _FLAG)
            except BlockingIOError:
                return None
            except OSError:  # the flag is not supported here (EOPNOTSUPP, EINVAL): the usual way from now on
                self.supported = False
                return None
        return buffer if got == length else None

    def _fd(self, path) -> int | None:
        key = os.fsdecode(path)
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # the usual read says why
        self._fds[key] = fd
        while len(self._fds) > MAX_OPEN:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd
