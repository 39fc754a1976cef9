"""Reading a batch's samples: the one core through which every ``dataset.read`` runs.

Three places read, each on an event loop of its own: the engine's loop in the training process
(:mod:`aioload._engine.reads`), a worker process's loop (:mod:`aioload._workers.reads`) and an
executor's task (:mod:`aioload._engine.executor`). Each hands :class:`BatchReads` a batch's
indices and gets back one raw item per index, in order, read the same way everywhere:

1. ``dataset.read_nowait`` first: what the dataset has at hand skips the loop;
2. the rest awaited together, at most ``bound`` at once (any async context manager: a
   semaphore, the engine's resizable limiter), each within ``read_timeout``;
3. a read that fails becomes a :class:`FailedRead`, its exception noted once with the index and
   the path (``while reading dataset index i (path)``, and where it ran);
4. the real reads' latencies and bytes counted, for ``loader.stats()``;
5. every step of ``read`` (the code between two awaits) timed by a :class:`StallMeter`, which
   finds a ``read`` that blocks its event loop (see :data:`STALL_STEP`).

What each place wants to know of a read on the way (the stuck report's "waiting for a read
slot", the statistics of reads in flight) it learns through a :class:`Watch`. This module
imports nothing of the engine's or the workers': both import it.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any, NamedTuple

from aioload._data.dataset import NOT_READY, Dataset
from aioload._base.errors import DataLoaderTimeoutError, where
from aioload._storage import arrived

STALL_STEP = 0.05
"""Seconds one step of ``dataset.read`` (the code between two awaits) may run before it counts
as blocking its event loop: every other read in flight, and ``read_timeout``, wait meanwhile."""

STALL_SECONDS = 1.0
"""Blocking steps adding up to this many seconds (and to at least half of the time since the
first read began, in at least :data:`STALL_READS` reads) make a stall: warned about once. A
step that blocks once -- a module imported on first use, a client set up -- is not one."""

STALL_READS = 3
"""Reads that must each have blocked before a stall is reported."""

STALL_ALONE = 0.25
"""Seconds from which one step that also outlasts ``read_timeout`` is a stall by itself: the
timeout could not fire while it ran (a preempted step on a loaded machine does not run so long)."""

STALL_SAMPLE = 16
"""After its first :data:`STALL_SAMPLE` ** 2 reads, a meter times one read in this many (each
standing for as many): driving a read step by step costs a few microseconds a read on a busy
loop (measured: 4.5 us on the engine's loop, 1-2 us alone), which a habit of blocking, seen in
every read, does not need paid for each one."""


# ----------------------------------------------------------------------------- the reads in flight

START_IO = 64
"""Reads in flight that ``io_concurrency="auto"`` starts with, over all the places that read
(each worker starts with its share)."""

MAX_IO = 1024
"""The bound ``io_concurrency="auto"`` never goes beyond, over all the places that read."""

GROW_WAIT_S = 0.002
"""A worker's decoding that waited at least this long for a task's reads may grow the limit."""

GROW_WHEN_LIMITED = 0.5
"""... when reads were queued behind the limit for at least this share of that wait."""


def next_limit(limit: int, ceiling: int, waited_s: float, limited_s: float) -> int:
    """A worker's reads-in-flight limit after one task, from what its decoding measured (the
    policy of ``io_concurrency="auto"`` where the workers read).

    The decoding waited ``waited_s`` for the task's reads, and during ``limited_s`` of that
    wait reads were queued behind ``limit``: then the limit was what held it up, and it
    doubles, up to ``ceiling`` (the worker's share of the global bound). A wait with reads
    below the limit is the storage's latency or the CPU, which more reads would not shorten;
    no wait is nothing to fix. The limit never shrinks: what a worker reads is bounded by the
    tasks it holds (``prefetch_factor`` batches), so a high limit holds no more memory than
    those tasks' samples."""
    if limit >= ceiling or waited_s < GROW_WAIT_S or limited_s < GROW_WHEN_LIMITED * waited_s:
        return limit
    return min(ceiling, 2 * limit)


class FailedRead:
    """What a sample holds in place of its raw item when its read failed."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class Stall(NamedTuple):
    """What a :class:`StallMeter` found: plain values, sent from a worker or an executor."""

    index: Any  # the read whose step blocked longest
    longest_s: float  # that step's seconds
    blocked_s: float  # the blocking steps' seconds together
    elapsed_s: float  # seconds since the first read began
    reads: int  # reads that blocked
    overran: float | None = None  # the read_timeout that ``index``'s longest step outlasted


class StallMeter:
    """The steps of ``dataset.read`` that held their event loop (see :data:`STALL_STEP`).
    One per place that reads (an epoch's engine loop, a worker, an executor process); used
    from that loop's thread only."""

    __slots__ = ("blocked_s", "longest", "first", "blockers", "found", "reported", "reads", "timeout")

    def __init__(self):
        self.timeout: float | None = None  # read_timeout where it reads (BatchReads sets it): see step()
        self.blocked_s = 0.0  # the blocking steps' seconds, a timed read counted for those it stands for
        self.longest: tuple[float, Any] = (0.0, None)
        self.first: float | None = None  # when the first read began
        self.blockers: set = set()  # indices (their first STALL_READS) whose read blocked
        self.found: Stall | None = None
        self.reported = False
        self.reads = 0

    def begin(self) -> int:
        """A read begins: how many reads it stands for if it is to be timed, else 0 (see
        :data:`STALL_SAMPLE`)."""
        if self.first is None:
            self.first = time.perf_counter()
        self.reads += 1
        if self.found is not None:
            return 0
        if self.reads <= STALL_SAMPLE * STALL_SAMPLE:
            return 1
        return STALL_SAMPLE if self.reads % STALL_SAMPLE == 0 else 0

    def step(self, seconds: float, index, weight: int = 1) -> None:
        """One step of ``read(index)``, timed for ``weight`` reads, ran ``seconds`` without awaiting."""
        if seconds < STALL_STEP or self.found is not None:
            return
        self.blocked_s += seconds * weight
        if seconds > self.longest[0]:
            self.longest = (seconds, index)
        if len(self.blockers) < STALL_READS:
            self.blockers.add(repr(index))
        elapsed = time.perf_counter() - (self.first or 0.0)
        if self.timeout is not None and seconds > self.timeout and seconds >= STALL_ALONE:
            # read_timeout could not fire while this step ran: the limit the loader was asked to
            # keep was broken by one read, which is enough (a read that returns at the end of such
            # a step is not even failed by it)
            self.found = Stall(index, seconds, self.blocked_s, elapsed, len(self.blockers), self.timeout)
            return
        if (self.blocked_s >= STALL_SECONDS and len(self.blockers) >= STALL_READS
                and self.blocked_s >= 0.5 * elapsed):
            self.found = Stall(self.longest[1], self.longest[0], self.blocked_s, elapsed, len(self.blockers))

    def take(self) -> Stall | None:
        """The stall found, the first time it is asked for (``None`` before and after)."""
        if self.found is None or self.reported:
            return None
        self.reported = True
        return self.found


def stall_message(stall: Stall, dataset, place: str) -> str:
    """The warning for ``stall``: which ``read`` blocks, how much, where, and the fix."""
    kind = type(dataset)
    name = f"{kind.__module__}.{kind.__qualname__}.read"
    if stall.overran is not None:
        what = (f"a step of read({stall.index!r}) ran {stall.longest_s:.1f} s without awaiting, longer than "
                f"read_timeout={stall.overran}, which could not fire meanwhile, and no other read in flight "
                "moved either")
    else:
        what = (f"steps of it that ran without awaiting held the loop {stall.blocked_s:.1f} s of the first "
                f"{stall.elapsed_s:.1f} s of reading (the longest {stall.longest_s:.2f} s, in "
                f"read({stall.index!r})), and meanwhile no other read in flight moved and read_timeout "
                "could not fire")
    return (
        f"{name} blocks its event loop {place}: {what}. A blocking call inside 'async def read' (time.sleep, a "
        "synchronous HTTP client such as requests, open().read() on slow storage) does this: await it "
        "in a thread (await asyncio.to_thread(f, ...)) or use an async client (aiohttp, aiofiles, "
        "aioload.read_bytes). aioload says this once per loader (BlockingReadWarning)"
    )


class Watch:
    """What a place that reads learns of each read on its way; every method here does nothing."""

    def at_hand(self, index) -> None:
        """``read_nowait`` had ``index`` at hand."""

    def waiting(self, index) -> None:
        """``index`` waits for a place under the bound."""

    def started(self, index) -> None:
        """``read(index)`` began."""

    def finished(self, index, seconds: float, nbytes: int) -> None:
        """``read(index)`` returned (or failed: ``nbytes`` is 0) after ``seconds``."""

    def ended(self, index) -> None:
        """``index`` is no longer being read (also when its read was cancelled)."""


_NO_WATCH = Watch()


class BatchReads:
    """``dataset.read`` for batches of indices, as the module docstring says. ``bound``: an
    async context manager held by each read (the reads in flight); ``place``: where the
    reads run, for the note of a failed read (``" in an aioload worker"``; ``""`` on the
    loader's own loop). Lives on one event loop; :meth:`at_hand` may run in any thread."""

    def __init__(self, dataset, *, bound, read_timeout: float | None, place: str = "",
                 watch: Watch | None = None, meter: StallMeter | None = None):
        self.dataset = dataset
        self.bound = bound
        self.read_timeout = read_timeout
        self.place = place
        self.watch = watch or _NO_WATCH
        self.meter = meter if meter is not None else StallMeter()
        self.meter.timeout = read_timeout
        self.describe = getattr(dataset, "describe", None)
        nowait = getattr(dataset, "read_nowait", None)
        # None unless the dataset overrides read_nowait (the base class's has nothing at hand)
        self.nowait = None if getattr(nowait, "__func__", None) is Dataset.read_nowait else nowait
        self.running: set[asyncio.Task] = set()  # the reads in flight, for cancel()

    def note(self, index) -> str:
        return f"while reading dataset index {index}{where(self.describe, index)}{self.place}"

    def failed(self, index, exc: Exception) -> FailedRead:
        exc.add_note(self.note(index))
        return FailedRead(exc)

    def at_hand(self, indices) -> list:
        """What ``read_nowait`` has for each index: the raw item, a :class:`FailedRead`, or
        ``NOT_READY`` (to be read)."""
        nowait = self.nowait
        if nowait is None:
            return [NOT_READY] * len(indices)
        out = []
        for index in indices:
            try:
                raw = nowait(index)
            except Exception as exc:  # noqa: BLE001 - reported like a failed read
                raw = self.failed(index, exc)
            if raw is not NOT_READY:
                self.watch.at_hand(index)
            out.append(raw)
        return out

    async def read(self, indices, at_hand: list | None = None) -> tuple[list, list[float], int]:
        """``(raws, latencies, nbytes)``: every index's raw item in order (a
        :class:`FailedRead` where it failed; ``at_hand``, from :meth:`at_hand`, is filled in
        and returned), the seconds each real read took and the bytes they returned."""
        raws = self.at_hand(indices) if at_hand is None else at_hand
        waiting = [pos for pos, raw in enumerate(raws) if raw is NOT_READY]
        latencies: list[float] = []
        nbytes = 0
        if not waiting:
            return raws, latencies, nbytes
        tasks = [asyncio.ensure_future(self.one(indices[pos])) for pos in waiting]
        self.running.update(tasks)
        try:
            done = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.running.difference_update(tasks)
        for pos, result in zip(waiting, done):
            if isinstance(result, BaseException):  # a read cancelled alone (cancel()), or worse
                if not isinstance(result, asyncio.CancelledError):
                    raise result
                result = (self.failed(indices[pos], _cancelled(indices[pos])), 0.0, 0)
            raws[pos], seconds, size = result
            latencies.append(seconds)
            nbytes += size
        return raws, latencies, nbytes

    async def one(self, index) -> tuple[Any, float, int]:
        """``(raw or FailedRead, seconds, nbytes)`` of ``read(index)`` under the bound."""
        watch = self.watch
        watch.waiting(index)
        try:
            async with self.bound:
                watch.started(index)
                weight = self.meter.begin()
                # With read_timeout every read is timed (beyond the sample with weight 0: it adds
                # nothing to a habit), so that a step that outlasts the timeout is seen wherever it is.
                timed = weight or (self.read_timeout is not None and self.meter.found is None)
                started = time.perf_counter()
                dropped, token = arrived.tally()  # what arrived and was not returned (a Range ignored)
                try:
                    raw = await read_within(self.dataset, index, self.read_timeout, self.meter if timed else None,
                                            weight)
                except Exception as exc:  # noqa: BLE001 - the sample's failure, reported with it
                    seconds = time.perf_counter() - started
                    watch.finished(index, seconds, 0)
                    return self.failed(index, exc), seconds, 0
                finally:
                    arrived.close(token)
                seconds = time.perf_counter() - started
                size = raw_nbytes(raw) + dropped[0]
                watch.finished(index, seconds, size)
                return raw, seconds, size
        finally:
            watch.ended(index)

    def abandon(self, indices, at_hand: list) -> tuple[list, list[float], int]:
        """What :meth:`read` returns when its reads are cancelled before they begin."""
        raws = [self.failed(index, _cancelled(index)) if raw is NOT_READY else raw
                for index, raw in zip(indices, at_hand)]
        return raws, [], 0

    def cancel(self) -> int:
        """Cancel every read in flight (on this loop's thread): each becomes a
        :class:`FailedRead`; how many there were."""
        running = [task for task in self.running if not task.done()]
        for task in running:
            task.cancel()
        return len(running)


def _cancelled(index) -> RuntimeError:
    return RuntimeError(f"dataset.read({index!r}) was cancelled: the epoch ended before it returned")


async def read_within(dataset, index, limit: float | None, meter: StallMeter | None = None, weight: int = 1):
    """``await dataset.read(index)``, failing with :class:`DataLoaderTimeoutError` after
    ``limit`` seconds (``read_timeout``; ``None``: no limit); ``meter`` times its steps, for
    ``weight`` reads."""
    reading = dataset.read(index)
    if meter is not None and asyncio.iscoroutine(reading):
        reading = _Stepped(reading, meter, index, weight)
    if limit is None:
        return await reading
    try:
        async with asyncio.timeout(limit):
            return await reading
    except TimeoutError:
        raise DataLoaderTimeoutError(
            f"dataset.read({index!r}) did not return within read_timeout={limit} seconds; "
            "raise read_timeout if the storage is just slow, or use on_error='skip' to leave "
            "such samples out",
            stuck=[(index, "read")],
        ) from None


class _Stepped:
    """A coroutine driven step by step, each step timed (``yield from`` by hand): two clock
    reads and a generator hop a step, which is why only a sample of reads is driven so."""

    __slots__ = ("coro", "meter", "index", "weight")

    def __init__(self, coro, meter: StallMeter, index, weight: int):
        self.coro, self.meter, self.index, self.weight = coro, meter, index, weight

    def __await__(self):
        coro, meter, index, weight = self.coro, self.meter, self.index, self.weight
        value: Any = None
        error: BaseException | None = None
        clock = time.perf_counter
        while True:
            started = clock()
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                meter.step(clock() - started, index, weight)
                return stop.value
            except BaseException:
                meter.step(clock() - started, index, weight)
                raise
            took = clock() - started
            if took >= STALL_STEP:
                meter.step(took, index, weight)
            value, error = None, None
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the task (cancellation): passed on
                error = exc


# ----------------------------------------------------------------------------- a read's result on its way


_PICKLES: set[type] = {bytes, bytearray, str, int, float, bool, complex, type(None)}
"""Types known to pickle: the plain ones, and each type a value of which has pickled here."""

_LOOK_INTO = 32
"""Values :func:`unpicklable` looks at in one container before it trusts the rest: a read
that returns thousands of numbers must not pay a check per number."""


def unpicklable(value: object) -> tuple[object, Exception] | None:
    """``None`` when ``value`` can travel to another process (a worker that decodes it); else the part of it that cannot be
    pickled, and the error. Tuples, lists and dicts are looked into (up to ``_LOOK_INTO``
    values); a value of any other type is pickled once, its buffers left out of band (an
    array's data is not copied), and a type whose value pickled is not tried again. A value
    that slips through (past the look-into bound, or a type that pickles only sometimes)
    fails when its task is sent, as the error of its batch."""
    budget = [_LOOK_INTO]
    return _unpicklable(value, budget)


def _unpicklable(value, budget: list) -> tuple[object, Exception] | None:
    # Not aioload._handoff.tree's walk: this one is a search, not a map. It stops at the first value
    # that fails and after _LOOK_INTO values whatever it found, counts the containers against
    # that budget too, and looks into a dict's keys as well as its values. Only the built-in
    # containers are opened: a value of any other type (a namedtuple, a Mapping) is simply
    # pickled whole, which answers the question for everything inside it at once.
    kind = type(value)
    budget[0] -= 1
    if kind in _PICKLES or budget[0] < 0:
        return None
    if kind is tuple or kind is list or kind is dict:
        for item in (value.items() if kind is dict else value):
            if budget[0] <= 0:
                return None
            found = _unpicklable(item, budget)
            if found is not None:
                return found
        return None
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=_out_of_band)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raised is the answer
        return value, exc
    _PICKLES.add(kind)
    return None


def _out_of_band(buffer) -> bool:
    return False  # keep the buffer out of the pickle: only whether it pickles is asked


class BufferPart:
    """What a read returns when one request served several reads: its bytes
    ``buffer[lo:hi]``, left in the request's buffer (:meth:`view`, no copy) until they are
    taken apart. Pickled (a read on the loader's loop, sent to a worker) it becomes ``bytes``."""

    __slots__ = ("buffer", "lo", "hi")

    def __init__(self, buffer, lo: int, hi: int):
        self.buffer, self.lo, self.hi = buffer, lo, hi

    def view(self) -> memoryview:
        return memoryview(self.buffer)[self.lo:self.hi]

    def __len__(self) -> int:
        return self.hi - self.lo

    def __reduce__(self):
        return bytes, (bytes(self.view()),)


_BYTES = (bytes, bytearray, memoryview, BufferPart)


def raw_nbytes(raw) -> int:
    if isinstance(raw, _BYTES):
        return len(raw)
    if isinstance(raw, tuple) and raw and isinstance(raw[0], _BYTES):
        return len(raw[0])
    return 0
