"""Bytes received into shared memory, handed to the workers as ``(segment, offset, length)``.

A read that fetches one large object for many samples (window mode's shards,
:mod:`aioload._shards.window`) receives it straight into a :class:`SharedBytes` (a memfd, as
the batch slots are: :mod:`aioload._handoff.shm`; recycled by a :class:`SharedPool`; see
``aioload._storage.storage.read_into``) and hands each sample over as a :class:`SharedRange` of
it. A shard a worker received (:mod:`aioload._workers.fetches`) arrives as its memfd, which
:func:`adopt` makes shared bytes of this process, as if it had been received here.
Inside a task (:mod:`aioload._workers.pool`), a range pickles as its segment's id, offset and
length: the pool sends the segment's file descriptor on the worker's control socket just
before the task, once per task and segment (:func:`collecting` says which), and the worker
maps it while it unpickles the task (:func:`attach`). The training process thus never copies
nor pickles a sample's bytes.

Lifetimes, with nothing to clean up by hand:

* in the training process, a :class:`SharedBytes` lives while its holder (the window) keeps it
  and while any range of it is alive (the items of tasks not answered yet); the last
  reference gone, its memfd goes back to its pool (kept for the next object, or closed) and
  the pool's ``on_release`` is told;
* in a worker, a task's mapping lives as long as the task's items, which the worker drops
  before it replies (:meth:`aioload._workers.worker._Worker.serve`); the descriptor itself is
  closed as soon as it is mapped.

So a segment's memory is freed when the reply to the last task that uses it arrives, and a
closed loader, a dead worker or a killed process leaves nothing behind: a memfd does not
outlive the processes that hold it. Pickled anywhere else (the read stage's check that a
result pickles, a user's own ``pickle.dumps``), a range is its bytes, a copy.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from typing import Callable

import numpy as np

from aioload._handoff.shm import anonymous_fd

FIRST_ID = -1024
"""Ids of shared bytes on a worker's control socket: -1024, -1025, ... (slots are >= 0)."""

_ids = itertools.count()


def is_shared(segment_id: int) -> bool:
    """Whether an id on the control socket is that of shared bytes (not a slot's)."""
    return segment_id <= FIRST_ID


class Memory:
    """One memfd of ``size`` bytes and this process's read-write mapping of it."""

    __slots__ = ("fd", "size", "map")

    def __init__(self, size: int, name: str, fd: int | None = None):
        self.size = max(size, 1)
        self.fd = anonymous_fd(self.size, name) if fd is None else fd  # fd: one received, now this one's
        self.map: mmap.mmap | None = mmap.mmap(self.fd, self.size)

    def grow(self, size: int) -> None:
        """At least ``size`` bytes (the pages already there are kept)."""
        if size > self.size:
            try:
                self.map.close()
            except BufferError:  # a view of the old mapping is still alive: unmapped when it goes
                pass
            os.ftruncate(self.fd, size)
            self.size = size
            self.map = mmap.mmap(self.fd, size)

    def close(self) -> None:
        held, self.map = self.map, None
        if held is not None:
            try:
                held.close()
            except BufferError:  # a view of it is still alive: unmapped when that goes
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedBytes:
    """``size`` bytes in a :class:`Memory`, given out by a :class:`SharedPool`; when the last
    reference to them goes (from whichever thread), the memory goes back to its pool."""

    __slots__ = ("id", "memory", "size", "__weakref__")

    def __init__(self, memory: Memory, size: int, release: Callable[[Memory, int], None]):
        self.id = FIRST_ID - next(_ids)
        self.memory, self.size = memory, size
        weakref.finalize(self, release, memory, size)

    @property
    def fd(self) -> int:
        return self.memory.fd

    def view(self) -> memoryview:
        return memoryview(self.memory.map)[: self.size]

    def range(self, offset: int, length: int) -> "SharedRange":
        return SharedRange(self, offset, length)

    def __len__(self) -> int:
        return self.size

    def __reduce__(self):
        found = getattr(_collecting, "found", None)
        if found is None:
            raise TypeError("SharedBytes pickle only inside a task for an aioload worker")
        found.append(self)  # once per task: the pickler's memo reduces each object once
        return attach, (self.id, self.size)


class SharedPool:
    """Where :class:`SharedBytes` come from: memfds recycled, so that each new object's bytes
    are written into pages that exist already (making and freeing the pages of a fresh memfd
    costs several times the writing). At most ``spare`` freed memfds wait for the next object;
    ``close()`` frees those, and every one returned after it. ``on_release(size)`` is told when
    shared bytes are let go."""

    def __init__(self, spare: int, name: str = "aioload-shared", on_release: Callable[[int], None] | None = None):
        self.spare = spare
        self.name = name
        self.on_release = on_release
        self._free: list[Memory] = []
        self._lock = threading.Lock()  # memory comes back from the thread that drops the last reference
        self.closed = False

    def take(self, size: int) -> SharedBytes:
        """Shared bytes of ``size`` (to receive into through :meth:`SharedBytes.view`, or to fill
        with :meth:`fill`)."""
        with self._lock:
            memory = self._free.pop() if self._free else None
        if memory is None:
            memory = Memory(size, self.name)
        else:
            memory.grow(size)
        return SharedBytes(memory, size, self._returned)

    @staticmethod
    def fill(shared: SharedBytes, data) -> None:
        """Copy ``data`` (``shared.size`` bytes) in."""
        source = np.frombuffer(data, dtype=np.uint8)
        if source.size != shared.size:
            raise ValueError(f"{source.size} bytes for shared bytes of {shared.size}")
        np.copyto(np.frombuffer(shared.memory.map, dtype=np.uint8, count=shared.size), source)

    def _returned(self, memory: Memory, size: int) -> None:
        with self._lock:
            keep = not self.closed and len(self._free) < self.spare
            if keep:
                self._free.append(memory)
        if not keep:
            memory.close()
        if self.on_release is not None:
            self.on_release(size)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
        for memory in free:
            memory.close()


def adopt(fd: int, size: int) -> SharedBytes:
    """Shared bytes from the memfd ``fd`` of ``size`` bytes that another process filled and
    sent here (a shard a worker fetched: :mod:`aioload._workers.fetches`): they are this
    process's from now on, and their descriptor is closed when their last reference goes."""
    try:
        memory = Memory(size, "", fd)
    except BaseException:
        os.close(fd)
        raise
    return SharedBytes(memory, size, _close)


def _close(memory: Memory, size: int) -> None:
    memory.close()


class SharedRange:
    """``length`` bytes from ``offset`` of shared bytes (``owner``: a :class:`SharedBytes`
    here, an :class:`Attached` mapping in a worker)."""

    __slots__ = ("owner", "offset", "length")

    def __init__(self, owner, offset: int, length: int):
        self.owner, self.offset, self.length = owner, offset, length

    def __len__(self) -> int:
        return self.length

    def view(self) -> memoryview:
        """The bytes, in place (a read-only view of the shared memory)."""
        return self.owner.view()[self.offset:self.offset + self.length]

    def __reduce__(self):
        if getattr(_collecting, "found", None) is None:
            return bytes, (self.view().tobytes(),)
        return SharedRange, (self.owner, self.offset, self.length)


class Attached:
    """A worker's read-only mapping of shared bytes; unmapped when no range of it remains."""

    __slots__ = ("id", "map", "size")

    def __init__(self, segment_id: int, fd: int, size: int):
        self.id, self.size = segment_id, size
        self.map = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ)

    def view(self) -> memoryview:
        return memoryview(self.map)[: self.size]


_collecting = threading.local()
_receiver: Callable[[int], int] | None = None


@contextlib.contextmanager
def collecting():
    """Within: the :class:`SharedBytes` that pickling reaches are listed in the list this
    yields, each once per ``pickle.dumps`` call, in the order a worker's unpickling meets them;
    the caller sends their file descriptors, in that order, before the pickle itself."""
    found: list[SharedBytes] = []
    _collecting.found = found
    try:
        yield found
    finally:
        _collecting.found = None


def receive_with(receiver: Callable[[int], int] | None) -> None:
    """Set this process's way of receiving the descriptor of shared bytes by id (a worker's
    control socket; :func:`attach` closes what it returns)."""
    global _receiver
    _receiver = receiver


def attach(segment_id: int, size: int) -> Attached:
    """Shared bytes, met while unpickling a task: their descriptor, sent just before the
    task, received now and mapped."""
    if _receiver is None:
        raise RuntimeError("shared bytes can be unpickled only in an aioload worker, from the task they came with")
    fd = _receiver(segment_id)
    try:
        return Attached(segment_id, fd, size)
    finally:
        os.close(fd)
