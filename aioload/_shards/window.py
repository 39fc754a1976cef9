"""Window mode's fetcher: whole shards, each fetched once, ahead of need, freed after their
last sample is read.

It lives where the reads run in window mode, on the loader's event loop in the training
process (one fetcher for every worker, so a shard is fetched once, not once per worker). It
learns what comes next from the loader's plan: ``plan(indices)`` (the dataset's
``will_read``) gives this rank's reads of the epoch in order, from which it knows each shard's
first read and how many reads it has. Then:

* shards are fetched in the order of their first read, as long as fewer than
  ``k + ahead`` are held or being fetched (``k``: the window of the order, see
  :mod:`aioload._shards.order`; ``ahead``: shards fetched before any of their samples is due);
* a shard is freed when its last planned read has been served;
* a read whose shard is neither held nor on its way starts that fetch at once, whatever the
  count: the count never holds back a read the loader is waiting for, so it cannot deadlock
  (reads in flight, not the fetcher, decide how far ahead the loader is).

A fetched shard is held in shared memory (:class:`~aioload._handoff.shared.SharedBytes`, a
memfd), received straight into it (``_storage.storage.read_into``: the socket's or the file's
bytes land in its mapping, with no buffer in between); a read hands over where its sample is in it
(:class:`~aioload._handoff.shared.SharedRange`): the worker that decodes the sample maps the
shard and reads the sample in place, so the training process neither copies nor pickles a
sample's bytes. A shard's memory is freed when its last planned read has been served *and*
the tasks holding its samples have been answered (its last sample decoded), and at the latest
when the epoch's loop ends (``break``, an error, ``close()``): the fetcher's hold on an epoch's
shards is a resource of that loop (:mod:`aioload._storage.scope`).

Memory: at every point of a window order exactly ``k`` shards have begun and not ended, so
the fetcher holds ``k + ahead`` shards, plus the shards whose first sample lies among the
reads the loader has in flight beyond them (about ``reads in flight / samples per shard``),
plus the shards whose last samples are still being decoded (those of the tasks in the
workers). ``figures()`` reports the bytes held now and at the peak, until each is freed.

Without a plan (``dataset[i]``, a sampler that is not the dataset's order) every read still
works: its shard is fetched on demand and kept among the ``k`` most recently used.

With a ``folder`` (``WebDataset(window_dir=...)``) a fetched shard is written there and its
bytes leave this process's memory: a read hands over where the sample is in that file
(:class:`Staged`), and the worker that decodes it reads it there, so the training process
neither copies nor sends the sample's bytes. A freed shard's file is deleted once ``grace``
more shards have been freed (the samples of a freed shard may still be on their way to a
worker); a worker that finds the file gone all the same reads the sample from the shard's URL
(one range request), so the grace is a matter of requests, never of correctness. Disk:
``k + ahead + grace`` shards.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np

from aioload._handoff.shared import SharedBytes, SharedPool
from aioload._storage import scope as _scope
from aioload._storage.storage import Storage, read_buffer, read_into
from aioload._workers import fetches as _fetches



class Held:
    """A fetched shard's bytes as they were received, on their way to ``window_dir``."""

    __slots__ = ("_view",)

    def __init__(self, data: bytes | bytearray):
        self._view = memoryview(data).toreadonly()

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, part: slice) -> bytes:
        return self._view[part].tobytes()

    def write_to(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self._view)


class Staged:
    """A fetched shard written to ``path`` (``size`` bytes), instead of held in memory."""

    __slots__ = ("path", "size")

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size

    def __len__(self) -> int:
        return self.size


def _remove_folder(path: str, owner: int) -> None:
    """Remove the staging folder, in the process that made it only (forked workers hold a copy
    of the fetcher, and its finalizer with it)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


class _Plan:
    """This rank's reads of an epoch: which indices (``planned``), how many reads each shard
    has left (``left``), the shards in the order of their first read (``queue``)."""

    def __init__(self, indices: Sequence[int], shard_of: Callable[[np.ndarray], np.ndarray], n: int, shards: int):
        order = np.asarray(indices, dtype=np.int64).reshape(-1)
        if order.size and (order.min() < 0 or order.max() >= n):
            bad = order[(order < 0) | (order >= n)][0]
            raise IndexError(f"will_read was given index {int(bad)}, outside range({n})")
        self.planned = np.zeros(n, dtype=np.bool_)
        self.planned[order] = True
        owners = shard_of(order)
        self.left = np.bincount(shard_of(np.flatnonzero(self.planned)), minlength=shards).astype(np.int64)
        _, firsts = np.unique(owners, return_index=True)
        self.queue: list[int] = owners[np.sort(firsts)].tolist()


class Window:
    """Whole-shard fetches for one dataset (see the module's docstring). ``urls[s]`` and
    ``sizes[s]`` (bytes) of shard ``s``; ``shard_of(indices)`` the shard of each index."""

    def __init__(self, urls: Sequence[str], shard_of: Callable[[np.ndarray], np.ndarray], n: int,
                 storage: Storage, k: int, ahead: int, folder: str | None = None, grace: int = 0):
        self.urls = list(urls)
        self.folder = folder  # where fetched shards go (None: kept in memory)
        self.grace = grace
        self._staging: str | None = None  # this process's own subfolder of it, made on first use
        self._finalizer = None
        self.shard_of = shard_of
        self.n = n
        self.storage = storage
        self.k = k
        self.ahead = ahead
        self._pending: _Plan | None = None  # set by plan() in the training thread, taken on the loop
        self._lock = threading.Lock()  # held_bytes: shared bytes are freed from any thread
        self.held_bytes = 0
        self._reset(None)
        # counters over the fetcher's life (read by stats() in the training thread)
        self.fetches = 0
        self.fetch_bytes = 0
        self.window_reads = 0
        self.wait_s = 0.0
        self.peak_bytes = 0

    def _reset(self, loop) -> None:
        self._loop = loop
        self._plan: _Plan | None = None
        self._next = 0  # position in the plan's queue of the next shard to fetch ahead
        self._fetching: dict[int, asyncio.Task] = {}
        self._failed: dict[int, BaseException] = {}
        for data in getattr(self, "_held", {}).values():
            if isinstance(data, Staged):
                self._count(-len(data))
        self._held: dict[int, SharedBytes | Staged] = {}  # shared bytes freed when no range of them remains
        self._loose: collections.OrderedDict[int, None] = collections.OrderedDict()  # fetched without a plan
        for path in getattr(self, "_trash", ()):
            _unlink(path)
        for held in getattr(self, "_held_files", ()):
            _unlink(held)
        self._trash: collections.deque[str] = collections.deque()  # freed staged files, deleted after the grace
        self._held_files: set[str] = set()
        if getattr(self, "_memory", None) is not None:
            self._memory.close()  # the freed memfds kept for the next shards
        self._memory: SharedPool | None = None  # made on the first fetch

    def _count(self, nbytes: int) -> None:
        """``nbytes`` more (or fewer) bytes held; from any thread (shared bytes are freed where
        their last reference goes)."""
        with self._lock:
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_loop=None, _plan=None, _pending=None, _held={}, _fetching={}, _failed={},
                     _loose=collections.OrderedDict(), held_bytes=0, _next=0, _staging=None, _finalizer=None,
                     _trash=collections.deque(), _held_files=set(), _lock=None, _memory=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the training thread ---------------------------------------------------------------
    def plan(self, indices: Sequence[int]) -> None:
        """This rank's reads of the next epoch (or of what is left of it), in order."""
        self._pending = _Plan(indices, self.shard_of, self.n, len(self.urls))

    def figures(self) -> dict:
        return dict(shard_fetches=self.fetches, shard_fetch_bytes=self.fetch_bytes,
                    shard_window_reads=self.window_reads, shard_fetch_wait_s=self.wait_s,
                    shard_window_bytes=self.held_bytes, shard_window_peak_bytes=self.peak_bytes)

    # -- the loop ----------------------------------------------------------------------------
    def _here(self) -> None:
        """Take a new plan, or a new loop (each epoch runs on a loop of its own), and start
        the fetches it calls for."""
        loop = asyncio.get_running_loop()
        pending, self._pending = self._pending, None
        if loop is not self._loop or pending is not None:
            self._reset(loop)
            self._plan = pending
            with self._lock:
                self.peak_bytes = self.held_bytes  # the peak of each epoch
            self._pump()

    def _ended(self, loop) -> None:
        """The epoch's loop is ending (its last step, after its tasks were cancelled): let go
        of every shard it held, whatever stopped the epoch."""
        if loop is self._loop:
            self._reset(None)

    def at_hand(self, shard: int) -> SharedBytes | Staged | None:
        """The shard's bytes when it is held (nothing is fetched for it here); ``None`` also
        off the loop (a worker's receiving thread, when a loader makes the workers read)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        self._here()
        return self._held.get(shard)

    async def fetched(self, shard: int) -> SharedBytes | Staged:
        """The shard's bytes, fetched now if need be (a failed fetch raises its error for every
        read of that shard in this epoch, without asking again)."""
        self._here()
        data = self._held.get(shard)
        if data is not None:
            return data
        if shard in self._failed:
            raise _again(self._failed[shard])
        task = self._fetching.get(shard)
        if task is None:
            task = self._start(shard)
        started = time.perf_counter()
        try:
            await asyncio.shield(task)
        finally:
            self.wait_s += time.perf_counter() - started
        if shard in self._failed:
            raise _again(self._failed[shard])
        data = self._held.get(shard)
        if data is None:  # freed meanwhile by reads that the plan counted (a read served twice)
            return task.result()
        return data

    def served(self, index: int, shard: int) -> None:
        """A read of ``index`` is done (or failed): free its shard after its last planned read."""
        self.window_reads += 1
        plan = self._plan
        if plan is not None and plan.planned[index]:
            plan.planned[index] = False
            plan.left[shard] -= 1
            if plan.left[shard] <= 0:
                self._free(shard)
                self._pump()
            return
        if shard in self._held and (plan is None or plan.left[shard] <= 0):
            self._loose[shard] = None
            self._loose.move_to_end(shard)
            while len(self._loose) > self.k:
                self._free(self._loose.popitem(last=False)[0])

    def _free(self, shard: int) -> None:
        data = self._held.pop(shard, None)  # shared bytes are freed once the ranges handed out are gone too
        if data is not None:
            if isinstance(data, Staged):
                self._count(-len(data))
                self._held_files.discard(data.path)
                self._trash.append(data.path)
                while len(self._trash) > self.grace:
                    _unlink(self._trash.popleft())
        self._loose.pop(shard, None)

    def _pump(self) -> None:
        """Start the next fetches of the plan while fewer than ``k + ahead`` shards are held
        or on their way."""
        plan = self._plan
        if plan is None:
            return
        queue = plan.queue
        while self._next < len(queue) and len(self._held) + len(self._fetching) < self.k + self.ahead:
            shard = queue[self._next]
            self._next += 1
            if shard in self._held or shard in self._fetching or shard in self._failed or plan.left[shard] <= 0:
                continue
            self._start(shard)

    def _start(self, shard: int) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._fetch(shard), name=f"aioload-shard-fetch-{shard}")
        self._fetching[shard] = task
        return task

    async def _fetch(self, shard: int) -> SharedBytes | Staged | None:
        url = self.urls[shard]
        try:
            # this loop's end lets go of what the fetcher holds for it (see _ended)
            await _scope.get(("aioload-window", self), lambda: self, _loop_ended)
            if self.folder is not None:
                kept = await self._stage(shard, Held(await read_buffer(self.storage, url)))
                self._count(len(kept))
            else:
                kept = await self._receive(url)
        except Exception as exc:
            self._failed[shard] = exc  # its message names the shard's URL; each read adds its sample
            self._fetching.pop(shard, None)
            return None
        except BaseException:
            self._fetching.pop(shard, None)
            raise
        self._fetching.pop(shard, None)
        self.fetches += 1
        self.fetch_bytes += len(kept)
        self._held[shard] = kept
        self._pump()
        return kept

    async def _receive(self, url: str) -> SharedBytes:
        """The shard received straight into shared memory: the socket's bytes (or the file's)
        land in a memfd's mapping, with no buffer in between and no copy. A retry takes a
        memfd of its own (the failed attempt's goes back to the pool). Where the loader's
        workers fetch (:mod:`aioload._workers.fetches`), one of them receives it and hands over
        its memfd; else this loop does."""
        fetch = _fetches.offered()
        if fetch is not None:
            kept = await fetch(url, self.storage)
        else:
            kept = await self._receive_here(url)
        # counted once received, until its last reference goes (from whichever thread)
        self._count(kept.size)
        weakref.finalize(kept, self._count, -kept.size)
        return kept

    async def _receive_here(self, url: str) -> SharedBytes:
        if self._memory is None:
            # freed shards' memfds, up to k + ahead, wait for the next shards until the loop
            # ends: writing into pages that exist costs a fraction of making new ones, and the
            # memfds never outnumber the shards held at the epoch's peak
            self._memory = SharedPool(self.k + self.ahead, "aioload-shard")
        memory = self._memory
        taken: list[SharedBytes] = []

        def into(size: int) -> memoryview:
            taken.clear()  # a retry's buffer: the failed attempt's memfd goes back to the pool
            shared = memory.take(size)
            taken.append(shared)
            return shared.view()

        try:
            await read_into(self.storage, url, into)
        except BaseException:
            taken.clear()  # not kept alive by the error's traceback (this frame's locals)
            raise
        return taken[0]

    async def _stage(self, shard: int, data: Held) -> Staged:
        """Write a fetched shard into this process's staging folder (made on first use)."""
        if self._staging is None:
            os.makedirs(self.folder, exist_ok=True)
            self._staging = tempfile.mkdtemp(prefix=f"aioload-window-{os.getpid()}-", dir=self.folder)
            self._finalizer = weakref.finalize(self, _remove_folder, self._staging, os.getpid())
        path = os.path.join(self._staging, f"{shard:06d}-{self.fetches:08d}.tar")
        await asyncio.to_thread(data.write_to, path)
        self._held_files.add(path)
        return Staged(path, len(data))

    def close(self) -> None:
        """Delete what is staged on disk (also done when the fetcher is garbage collected)."""
        if self._finalizer is not None:
            self._finalizer()


async def _loop_ended(window: Window) -> None:
    window._ended(asyncio.get_running_loop())


def _again(exc: BaseException) -> BaseException:
    """The failed fetch's error for one more read: a copy, so that the note each read adds
    (which sample it was) is its own."""
    clone = copy.copy(exc)
    clone.__notes__ = list(getattr(exc, "__notes__", []))
    clone.__cause__, clone.__traceback__ = exc.__cause__, exc.__traceback__
    return clone


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
