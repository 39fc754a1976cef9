"""Autotuning of ``io_concurrency="auto"`` and ``queue_depth="auto"`` while the loader runs.

:class:`Controller` is the policy, a pure function of measurements (feed it :class:`Window`
values and it moves its two numbers); :class:`Tuner` samples a running engine a few times a
second and hands the controller's numbers to the engine, which applies them to its limits.
Neither knows the engine: what they need of it (the bound on batches in flight, the size of
a slot, where to apply a change) is given to them.

Where the workers read their samples, ``io_concurrency="auto"`` is not tuned here: each
worker adapts its own reads in flight (:func:`aioload._data.reads.next_limit`), and only
``queue_depth`` is this tuner's.

The policy, in words:

* Reads are the bottleneck when the consumer waits and reads in flight (by Little's law,
  ``sum of read latencies / window``) sit near the limit. Then ``io_concurrency`` doubles. The
  next window must show throughput (reads, or decoded items where nothing is read) up by
  ``GAIN``; if not (storage saturated, or the bottleneck was elsewhere), the previous value
  comes back and becomes a ceiling.
* When the consumer waits but neither reads nor decode are saturated, ``queue_depth`` grows by
  one (more batches in flight absorb jitter), under the same must-help rule.
* Only the memory budget lowers a limit below its start: raw reads and batch slots held in
  flight must fit in it. Otherwise limits only grow, and a raise that did not help is undone
  and caps its knob, so the controller settles instead of oscillating.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Callable

from aioload._data.reads import MAX_IO, START_IO

TICK_S = 0.25
"""How often the tuner samples the pipeline."""

MIN_WINDOW_S = 0.5
MIN_BATCHES = 6
MAX_WINDOW_S = 4.0
"""A window closes after ``MIN_WINDOW_S`` once it saw ``MIN_BATCHES`` batches, or after
``MAX_WINDOW_S`` whatever it saw."""

START_DEPTH = 2
MAX_DEPTH = 16
# START_IO (where io_concurrency="auto" starts: limits only grow from there, the memory budget
# aside) and MAX_IO are aioload._data.reads', shared with the workers' own policy.

WAITING = 0.02
"""The consumer waited more than this share of a window: the pipeline is short of something."""

READS_SATURATED = 0.7
DECODE_SATURATED = 0.85
GAIN = 1.15
"""A raised limit must lift throughput by this factor to be kept."""

SETTLED_WINDOWS = 8


def default_memory_budget() -> int:
    """Bytes "auto" may hold in flight: an eighth of physical memory, at most 4 GiB."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not on Linux/macOS
        physical = 8 << 30
    return int(min(4 << 30, physical // 8))


@dataclass(frozen=True)
class Window:
    """What the pipeline did during one measurement window."""

    seconds: float
    batches: int
    wait_fraction: float
    reads: int
    read_s: float
    bytes_read: int
    decode_busy: float
    slot_bytes: int = 0
    decoded: int = 0

    @property
    def rate(self) -> float:
        """Throughput: reads per second, or decoded items per second where nothing is read
        (an IterableDataset, a plain dataset)."""
        return max(self.reads, self.decoded) / self.seconds


class Controller:
    """Moves ``io`` and ``depth`` from measured windows; a knob given as an int stays fixed.

    ``in_flight(io, quick)`` is the bound on batches being made for ``io`` reads in flight
    (the loader's :class:`~aioload._engine.spec.BatchBound`, given each epoch by
    :meth:`follow`); ``depth`` ready batches come on top."""

    def __init__(self, *, batch_size: int, num_workers: int, in_flight: Callable[[int, bool], int],
                 io: int | None = None, depth: int | None = None, memory_budget: int | None = None,
                 start_io: int = START_IO, start_depth: int = START_DEPTH, max_io: int = MAX_IO,
                 max_depth: int = MAX_DEPTH):
        self.batch_size = max(1, batch_size)
        self.num_workers = max(1, num_workers)
        self.in_flight = in_flight
        self.io_given = io is not None
        self.tune_io, self.tune_depth = io is None, depth is None
        self.io = start_io if io is None else io
        self.depth = start_depth if depth is None else depth
        self.quick = False  # batches are quick: more of them in flight (set by the engine)
        self._min_depth = self.depth
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self._io_ceiling = max_io
        self._depth_ceiling = max_depth
        self._trial: tuple[str, int, float] | None = None  # (knob, value before, rate before)
        self._read_bytes = 0.0
        self._slot_bytes = 0
        self.windows = 0
        self.quiet = 0  # windows since the last change

    def follow(self, in_flight: Callable[[int, bool], int], tune_io: bool) -> None:
        """An epoch begins with this bound on batches in flight; ``tune_io``: its reads run on
        the engine's loop, whose limit is this controller's to move (where the workers read,
        each adapts its own)."""
        self.in_flight = in_flight
        self.tune_io = tune_io and not self.io_given

    @property
    def permits(self) -> int:
        """Batches in flight: enough to keep ``io`` reads busy, plus ``depth`` ready ones."""
        return self._permits(self.io, self.depth)

    def _permits(self, io: int, depth: int) -> int:
        return self.in_flight(io, self.quick) + depth

    @property
    def settled(self) -> bool:
        return self._trial is None and self.quiet >= SETTLED_WINDOWS

    def memory(self, io: int | None = None, depth: int | None = None) -> int:
        """Upper bound of the bytes held in flight: raw bytes of every sample of every batch in
        flight, and one slot per batch in flight."""
        permits = self._permits(io or self.io, depth or self.depth)
        return int(permits * (self.batch_size * self._read_bytes + self._slot_bytes))

    def update(self, w: Window) -> bool:
        """Learn from one window; ``True`` when ``io`` or ``depth`` changed."""
        if w.seconds <= 0 or w.batches <= 0:
            return False
        self.windows += 1
        if w.reads:
            self._read_bytes = w.bytes_read / w.reads
        self._slot_bytes = max(self._slot_bytes, w.slot_bytes)
        changed = self._fit_budget() or self._judge_trial(w) or self._raise(w)
        self.quiet = 0 if changed else self.quiet + 1
        return changed

    # -- the rules --------------------------------------------------------------------------
    def _fit_budget(self) -> bool:
        """Shrink tuned knobs until what they hold in flight fits the memory budget."""
        changed = False
        while self.memory() > self.memory_budget:
            if self.tune_depth and self.depth > min(self._min_depth, START_DEPTH):
                self.depth -= 1
                self._depth_ceiling = self.depth
            elif self.tune_io and self.io > 1:
                self.io = max(1, self.io // 2)
                self._io_ceiling = self.io
            else:
                break
            changed = True
        if changed:
            self._trial = None
        return changed

    def _judge_trial(self, w: Window) -> bool:
        """Keep the last raise if throughput rose enough, else undo it and cap the knob."""
        if self._trial is None:
            return False
        knob, before, rate_before = self._trial
        self._trial = None
        if rate_before > 0 and w.rate >= rate_before * GAIN:
            return False
        if knob == "io":
            self.io = self._io_ceiling = before
        else:
            self.depth = self._depth_ceiling = before
        return True

    def _raise(self, w: Window) -> bool:
        if w.wait_fraction <= WAITING:
            return False
        rate = w.rate
        in_flight = w.read_s / w.seconds
        # (where the workers read, their reads are theirs to adapt: not a reason to hold depth)
        reads_saturated = in_flight >= READS_SATURATED * self.io and (self.tune_io or self.io_given)
        if reads_saturated:
            if not self.tune_io or self.io >= self._io_ceiling:
                return False
            new = min(2 * self.io, self._io_ceiling)
            while new > self.io and self.memory(io=new) > self.memory_budget:
                new = (new + self.io) // 2
            if new <= self.io:
                return False
            self._trial = ("io", self.io, rate)
            self.io = new
            return True
        if self.tune_depth and w.decode_busy < DECODE_SATURATED and self.depth < self._depth_ceiling:
            if self.memory(depth=self.depth + 1) > self.memory_budget:
                return False
            self._trial = ("depth", self.depth, rate)
            self.depth += 1
            return True
        return False


class Tuner:
    """Drives a :class:`Controller` from one running engine per epoch; outlives epochs."""

    def __init__(self, controller: Controller):
        self.controller = controller

    async def run(self, stats, apply: Callable[[int, int], None], slot_bytes: Callable[[], int]) -> None:
        """Sample ``stats`` (a StatsRecorder) until cancelled; each change of the controller's
        numbers goes to ``apply(io, permits)``; ``slot_bytes()`` is one slot's size (for the
        memory budget)."""
        while stats.first_batch_pending:  # the pipeline is still filling: nothing to learn
            await asyncio.sleep(TICK_S)
        start, base = time.perf_counter(), stats.totals()
        while True:
            await asyncio.sleep(TICK_S)
            now, totals = time.perf_counter(), stats.totals()
            seconds = now - start
            batches = totals[0] - base[0]
            if seconds < MIN_WINDOW_S or (batches < MIN_BATCHES and seconds < MAX_WINDOW_S):
                continue
            window = _window(seconds, base, totals, self.controller.num_workers, slot_bytes())
            start, base = now, totals
            if self.controller.update(window):
                apply(self.controller.io, self.controller.permits)


def _window(seconds: float, base: tuple, totals: tuple, workers: int, slot_bytes: int) -> Window:
    d = [b - a for a, b in zip(base, totals, strict=True)]
    batches, wait_s, reads, read_s, bytes_read, decode_s, decoded = d
    return Window(
        seconds=seconds, batches=batches, wait_fraction=min(1.0, wait_s / seconds), reads=reads,
        read_s=read_s, bytes_read=bytes_read, decode_busy=min(1.0, decode_s / (seconds * workers)),
        slot_bytes=slot_bytes, decoded=decoded,
    )


def is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def check_knob(name: str, value) -> None:
    """A knob is ``"auto"`` or an int >= 1 (ints are checked by the loader's own rule)."""
    if isinstance(value, str) and not is_auto(value):
        raise ValueError(f"{name} must be an int >= 1 or 'auto', got {value!r}")


def make_tuner(io_concurrency, queue_depth, batch_size: int | None, num_workers: int,
               in_flight: Callable[[int, bool], int], default_depth: int = START_DEPTH) -> Tuner | None:
    """A tuner for a loader whose ``io_concurrency`` or ``queue_depth`` is ``"auto"``, else None.
    Tuned knobs start from the fixed defaults (``default_depth`` is the loader's);
    ``in_flight`` is the bound on batches in flight until the first epoch says otherwise."""
    tune_io, tune_depth = is_auto(io_concurrency), is_auto(queue_depth)
    if not (tune_io or tune_depth):
        return None
    return Tuner(Controller(
        batch_size=batch_size or 1, num_workers=num_workers, in_flight=in_flight,
        io=None if tune_io else io_concurrency, depth=None if tune_depth else queue_depth,
        start_depth=default_depth,
    ))
