"""Where a loader's memory goes: each process's proportional share (PSS) and private memory,
read from ``/proc/<pid>/smaps_rollup``, and copy-on-read named by the dataset's attribute.

Workers started with ``fork`` share the training process's pages until one is written, and
reading a Python object writes it (its reference count): a dataset holding a list of
millions of strings is copied, page by page, into every worker as an epoch visits it.
:class:`MemoryWindow` measures each worker's private memory at each epoch's first batch and at
its end (in the training process, one small read of ``/proc`` per worker: see
``docs/stats.md`` for its cost); when a worker grew by more than :data:`GROWTH_WARNING` bytes,
:func:`large_containers` walks the dataset's attributes for the culprits and the loader warns
once with an :class:`aioload.CopyOnReadWarning` (:func:`copy_on_read_warning`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from aioload._base.errors import CopyOnReadWarning
from aioload._base.walk import CONTAINERS, walk

GROWTH_WARNING = 64 * 2**20
"""A worker whose private memory grew by more than this over one epoch, in a loader whose dataset
holds large Python containers, makes the loader warn (once). The 3,000,000 paths of a list copy
336 MB into every worker over a shuffled epoch; decoding JPEGs grows a worker by a few MB."""

LARGE = 100_000
"""A list, dict, tuple or set with at least this many items is "large" (its reference counts
cost a worker about 2.5 MB of copied pages per 100,000 strings)."""

WALK_OBJECTS = 2_000
"""At most this many objects are looked at in a walk of the dataset's attributes."""

WALK_DEPTH = 3
"""... down to this many attributes, items or values below the dataset."""


OPEN_AFTER_S = 1.0
"""An epoch's baseline is taken at the first batch this long into it or later: an epoch shorter
than this is not measured (its copy-on-read, a few MB at most, is not worth its measurement)."""

BUDGET = 0.01
"""An epoch is measured only while the measurements so far took at most this share of the time
since the loader began: ``aioload bench``'s one-second epochs cost the training process 0.05 ms
an image when every epoch was measured (twice torch's main-process CPU), and a long run is
measured about once every ten seconds of its time at least."""

FRESH_S = 5.0
"""``stats()`` starts a new measurement when the last one is older than this: a log line every
10 ms (``log_every=0.01``) must not walk every process's page tables each time."""


class Rollup(NamedTuple):
    """One process's memory, from ``/proc/<pid>/smaps_rollup``, in bytes."""

    pss: int  # its proportional share: private pages, plus each shared page over its sharers
    private: int  # pages only it maps (USS: Private_Clean + Private_Dirty)


def rollup(pid: int | str = "self") -> Rollup | None:
    """Process ``pid``'s :class:`Rollup`; ``None`` where it is gone or the kernel has no
    ``smaps_rollup`` (Linux < 4.14, not Linux)."""
    pss = private = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    private += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return Rollup(pss, private)


@dataclass
class WorkerMemory:
    """What the loader knows of one worker's memory (the pid it was measured under)."""

    pid: int
    pss: int = 0  # at the last measurement
    peak_pss: int = 0  # the highest measured
    private: int = 0  # at the last measurement
    base: int | None = None  # private memory at the epoch's first batch
    growth: int = 0  # private memory gained over the last epoch measured from its first batch


class MemoryWindow:
    """Each process's memory, measured at an epoch's first batch :data:`OPEN_AFTER_S` into it
    while the measurements cost at most :data:`BUDGET` of the time (:meth:`open`, on a thread of
    its own), at its end (:meth:`close`, the workers only, in the caller's thread: the
    copy-on-read warning is given there) and, on a thread of its own, when statistics are asked
    and the last measurement is older than :data:`FRESH_S` (:meth:`figures`). Reading
    ``smaps_rollup`` makes the kernel walk a process's page tables, tens of milliseconds for a
    few hundred MB mapped; ``/proc`` reads let go of the GIL, so a thread's measurement costs the
    training loop next to nothing. ``workers()`` gives the worker pids in worker order (``None``
    for one not started)."""

    def __init__(self, workers: Callable[[], list[int | None]]):
        self.workers = workers
        self.known: list[WorkerMemory | None] = []
        self.process_pss = 0
        self.process_peak = 0
        self._measured_at: float | None = None
        self._lock = threading.Lock()  # one measurement at a time
        self._thread: threading.Thread | None = None
        self._born = time.monotonic()
        self._spent = 0.0  # seconds the measurements took (BUDGET)

    def affordable(self) -> bool:
        """Whether the measurements so far took at most :data:`BUDGET` of the loader's time."""
        return self._spent <= BUDGET * (time.monotonic() - self._born)

    def measure(self, process: bool = False) -> list[WorkerMemory | None]:
        """Measure every worker now (and this process, with ``process``); a worker replaced by
        another pid starts afresh."""
        with self._lock:
            started = time.monotonic()
            known = self._measure()
            if process:
                found = rollup()
                self.process_pss = found.pss if found is not None else 0
                self.process_peak = max(self.process_peak, self.process_pss)
                self._measured_at = time.monotonic()
            self._spent += time.monotonic() - started
            return known

    def _measure(self) -> list[WorkerMemory | None]:
        pids = list(self.workers())
        known = self.known[:len(pids)] + [None] * (len(pids) - len(self.known))
        for wid, pid in enumerate(pids):
            found = rollup(pid) if pid is not None else None
            if found is None:
                known[wid] = None
                continue
            memory = known[wid]
            if memory is None or memory.pid != pid:
                memory = known[wid] = WorkerMemory(pid)
            memory.pss, memory.private = found.pss, found.private
            memory.peak_pss = max(memory.peak_pss, found.pss)
        self.known = known
        return known

    def _start(self, target: Callable[[], None]) -> None:
        self._join()
        self._thread = threading.Thread(target=target, name="aioload-memory")
        self._thread.start()

    def join(self) -> None:
        """Wait for the measurement under way, if any (the loader's ``close()``)."""
        self._join()

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def open(self) -> None:
        """The epoch's first batch: each worker's private memory from here."""
        self._start(self._open)

    def _open(self) -> None:
        for memory in self.measure(process=True):
            if memory is not None:
                memory.base = memory.private

    def close(self) -> int:
        """The epoch ended: each worker's growth since :meth:`open`; the largest, in bytes (0,
        measuring nothing, where the epoch had no baseline)."""
        self._join()
        if not any(memory is not None and memory.base is not None for memory in self.known):
            return 0
        largest = 0
        for memory in self.measure():
            if memory is not None and memory.base is not None:
                memory.growth = memory.private - memory.base
                memory.base = None
                largest = max(largest, memory.growth)
        return largest

    def figures(self) -> dict[str, Any]:
        """The memory statistics (``docs/stats.md``) as last measured, of the workers running
        now; a measurement older than :data:`FRESH_S` starts a new one (for the next call)."""
        stale = self._measured_at is None or time.monotonic() - self._measured_at >= FRESH_S
        if stale and (self._thread is None or not self._thread.is_alive()):
            self._start(lambda: self.measure(process=True))
        if self._measured_at is None:  # the first figures are waited for
            self._join()
        pids = list(self.workers())
        workers = [m if m is not None and wid < len(pids) and m.pid == pids[wid] else None
                   for wid, m in enumerate(self.known[:len(pids)])]
        return dict(
            process_pss_bytes=self.process_pss, process_peak_pss_bytes=self.process_peak,
            worker_pss_bytes=tuple(m.pss if m else 0 for m in workers),
            worker_peak_pss_bytes=tuple(m.peak_pss if m else 0 for m in workers),
            worker_private_bytes=tuple(m.private if m else 0 for m in workers),
            worker_growth_bytes=tuple(m.growth if m else 0 for m in workers),
        )


def large_containers(dataset: Any) -> list[tuple[str, str, int]]:
    """``(path, kind, items)`` of each list, dict, tuple or set of at least :data:`LARGE` items
    reachable from ``dataset`` through attributes and the values of small containers
    (``dataset.paths``, ``dataset.meta["files"]``, ``subset.dataset.labels``), largest first.
    Bounded: :data:`WALK_DEPTH` levels, :data:`WALK_OBJECTS` objects; a large container is
    reported, not looked into."""
    def large(obj) -> bool:
        return isinstance(obj, CONTAINERS) and len(obj) >= LARGE

    found = [(path, type(obj).__name__, len(obj))
             for path, obj in walk(dataset, "dataset", WALK_DEPTH, WALK_OBJECTS, lambda obj: not large(obj))
             if large(obj)]
    return sorted(found, key=lambda item: -item[2])


def copy_on_read_warning(found: list[tuple[str, str, int]], worker: int, pid: int, growth: int,
                         epoch: int) -> CopyOnReadWarning:
    """The warning for worker ``worker`` (``pid``) that grew ``growth`` bytes over ``epoch``."""
    named = "; ".join(f"{path} (a {kind} of {items:,} items)" for path, kind, items in found)
    return CopyOnReadWarning(
        f"aioload worker {worker} (pid {pid}) gained {growth / 1e6:.0f} MB of private memory over epoch {epoch}, "
        f"and the dataset holds large Python containers: {named}. Every worker copies such a container page by "
        "page as it reads it (each read changes its items' reference counts): hold strings in an "
        "aioload.StringList, numbers in a numpy array, records in an Arrow table (or numpy arrays per field). "
        "See docs/troubleshooting.md (\"Memory\")."
    )
