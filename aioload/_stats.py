"""Counters the pipeline updates as it runs, and the frozen snapshot users read.

What the consumer's clock measures (per epoch, summed over epochs):

* ``elapsed_s`` runs from ``iter(loader)`` to the last batch handed over (or to the end of the
  epoch); time between epochs, or after an abandoned epoch's last batch, is not counted.
* ``first_batch_s`` is the part of it spent before each epoch's first batch: starting workers
  and filling the pipeline.
* ``wait_s`` is the time, after an epoch's first batch, that the consumer spent *inside*
  ``__next__`` / ``__anext__``: blocked on the ready queue, plus any hand-off work done there
  (decoding with ``num_workers=0``, pinning). The time *between* calls is the training step.
* ``wait_fraction = wait_s / (elapsed_s - first_batch_s)``: the share of the steady state in
  which training stood still for want of data.

Cost: reads update plain counters from the engine thread, which is their only writer (no
lock); batches take one uncontended lock in the consumer's thread. Snapshots sort at most
``StatsRecorder.RING`` recent read latencies.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

DATA_BOUND = 0.10
"""Waiting at least this share of the steady state makes a loop "data-bound"."""

SATURATED = 0.8
"""A stage busy at least this share of its capacity is "saturated"."""

OFF_CPU = 0.6
"""Decode that got less than this share of a CPU while it ran was mostly waiting for one."""


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one loader's pipeline (``loader.stats()``); ``str()`` formats it.

    Counters are cumulative over the loader's life; ``later.since(earlier)`` gives the figures
    of the interval between two snapshots. Derived figures (rates, fractions, the verdict) are
    computed from the counters. See ``docs/stats.md`` for what each one means.
    """

    batches: int = 0
    samples: int = 0
    epochs: int = 0
    elapsed_s: float = 0.0
    first_batch_s: float = 0.0
    wait_s: float = 0.0
    reads: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    read_p50_ms: float = 0.0
    read_p99_ms: float = 0.0
    decoded: int = 0
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0
    reads_in_flight: int = 0
    queue_occupancy: int = 0
    io_concurrency: int = 0
    queue_depth: int = 0
    num_workers: int = 0
    skipped: tuple = ()
    skipped_total: int = 0
    worker_restarts: int = 0
    shm_bytes: int = 0
    executor: str = ""  # with executor=: which one (a Dask cluster's scheduler address)
    executor_tasks: int = 0  # batches the executor made
    executor_bytes: int = 0  # bytes of the tensors those batches brought back
    task_p50_ms: float = 0.0  # a task's round trip: sent, decoded there, its batch back
    task_p99_ms: float = 0.0
    samples_per_s: float = field(init=False)
    wait_fraction: float = field(init=False)
    decode_ms_per_sample: float = field(init=False)
    mean_reads_in_flight: float = field(init=False)
    decode_busy: float = field(init=False)
    decode_cpu_share: float = field(init=False)
    verdict: str = field(init=False)

    def __post_init__(self):
        steady = self.elapsed_s - self.first_batch_s
        workers = max(1, self.num_workers)
        derived = {
            "samples_per_s": self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "wait_fraction": min(1.0, self.wait_s / steady) if steady > 0 else 0.0,
            "decode_ms_per_sample": self.decode_s / self.decoded * 1e3 if self.decoded else 0.0,
            "mean_reads_in_flight": self.read_s / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "decode_busy": min(1.0, self.decode_s / (self.elapsed_s * workers)) if self.elapsed_s > 0 else 0.0,
            "decode_cpu_share": min(1.0, self.decode_cpu_s / self.decode_s) if self.decode_s > 0 else 1.0,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "verdict", diagnose(self))

    def since(self, earlier: "LoaderStats") -> "LoaderStats":
        """The figures of the interval from ``earlier`` to this snapshot. Gauges (reads in
        flight, queue occupancy, limits) and read percentiles are this snapshot's own; read
        percentiles cover the most recent reads."""
        counters = {}
        for f in fields(self):
            if f.init and f.name in _COUNTERS:
                counters[f.name] = getattr(self, f.name) - getattr(earlier, f.name)
        counters["skipped"] = self.skipped[len(earlier.skipped):]
        return replace(self, **counters)

    def __str__(self) -> str:
        return format_stats(self)


_COUNTERS = frozenset({
    "batches", "samples", "epochs", "elapsed_s", "first_batch_s", "wait_s", "reads", "bytes_read",
    "read_s", "decoded", "decode_s", "decode_cpu_s", "worker_restarts", "skipped_total", "executor_tasks",
    "executor_bytes",
})


def diagnose(s: LoaderStats) -> str:
    """A one-line verdict: is training waiting for data, and which stage to fix."""
    if s.batches == 0:
        return "no batches delivered yet"
    if s.elapsed_s - s.first_batch_s <= 0:
        return f"only the first batch so far ({s.first_batch_s:.2f} s to start)"
    if s.wait_fraction < DATA_BOUND:
        return f"not data-bound (waiting {s.wait_fraction:.0%} of the time)"
    head = f"data-bound {s.wait_fraction:.0%} of the time: "
    if s.num_workers == 0:
        return head + "loading runs in the training process (num_workers=0), set num_workers"
    if s.executor:
        return head + _executor_bound(s)
    if s.decode_busy >= SATURATED / 2 and s.decode_cpu_share < OFF_CPU:
        return head + _off_cpu(s)
    if s.decode_busy >= SATURATED:
        return head + (f"decode is saturated ({s.num_workers} workers {s.decode_busy:.0%} busy), "
                       "raise num_workers")
    if s.io_concurrency and s.mean_reads_in_flight >= SATURATED * s.io_concurrency:
        return head + (f"reads are saturated ({s.mean_reads_in_flight:.0f} of {s.io_concurrency} in "
                       f"flight, p50 {s.read_p50_ms:.1f} ms), raise io_concurrency")
    return head + (f"neither reads ({s.mean_reads_in_flight:.0f} of {s.io_concurrency} in flight) nor "
                   f"decode ({s.decode_busy:.0%} busy) is saturated: raise queue_depth, or free CPU "
                   "for the training process")


def _executor_bound(s: LoaderStats) -> str:
    """With executor=: a task reads and decodes a whole batch over there; its round trip is the
    figure, and the fix is more tasks in flight or more workers."""
    trip = f"{s.num_workers} tasks in flight, {s.decode_busy:.0%} busy, round trip p50 {s.task_p50_ms:.0f} ms"
    if s.decode_busy >= SATURATED:
        return f"the executor's tasks are saturated ({trip}): add workers to {s.executor}, then raise num_workers"
    return f"the executor is not kept busy ({trip}): raise num_workers (tasks in flight) or queue_depth"


def _off_cpu(s: LoaderStats) -> str:
    share = f"{s.decode_cpu_share:.0%} of a CPU"
    if not s.reads:  # a plain dataset: __getitem__ also does the I/O
        return (f"workers ran __getitem__ at {share} (waiting on I/O or for a CPU): give the dataset an "
                "async read() (aioload.Dataset) for its I/O, or raise num_workers")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fix = "lower num_workers" if s.num_workers >= cpus else "other work is competing for them"
    return f"the CPUs are oversubscribed: decode ran at {share} ({s.num_workers} workers, {cpus} CPUs), {fix}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def format_stats(stats: LoaderStats) -> str:
    """A few aligned lines for people: throughput, waiting, each stage, memory, the verdict."""
    s = stats
    skipped = f"{s.skipped_total}"
    if s.skipped:
        shown = ", ".join(str(i) for i in s.skipped[:8])
        skipped += f" (indices {shown}{', ...' if s.skipped_total > 8 else ''})"
    rows = [
        ("throughput", f"{s.samples_per_s:.1f} samples/s ({s.samples} samples, {s.batches} batches, "
                       f"{s.epochs} epoch{'' if s.epochs == 1 else 's'}, {s.elapsed_s:.2f} s)"),
        ("waiting", f"{s.wait_fraction:.1%} of the time after the first batch "
                    f"({s.wait_s:.2f} s; first batches took {s.first_batch_s:.2f} s)"),
        ("reads", f"{s.reads} ({_bytes(s.bytes_read)} on the event loop), p50 {s.read_p50_ms:.2f} ms, "
                  f"p99 {s.read_p99_ms:.2f} ms, {s.mean_reads_in_flight:.1f} in flight on average, "
                  f"{s.reads_in_flight} now, limit {s.io_concurrency}"),
        ("decode", f"{s.decode_ms_per_sample:.3f} ms/sample, {s.num_workers} workers {s.decode_busy:.0%} busy, "
                   f"on a CPU {s.decode_cpu_share:.0%} of that time"),
        ("queue", f"{s.queue_occupancy} batches ready, queue_depth {s.queue_depth}"),
        *([("executor", f"{s.executor}: {s.executor_tasks} tasks, round trip p50 {s.task_p50_ms:.1f} ms, "
                        f"p99 {s.task_p99_ms:.1f} ms, {_bytes(s.executor_bytes / max(1, s.executor_tasks))} "
                        "back per batch")] if s.executor else []),
        ("skipped", skipped),
        ("worker restarts", f"{s.worker_restarts}"),
        ("shared memory", _bytes(s.shm_bytes)),
        ("verdict", s.verdict),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {text}" for label, text in rows)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[pos]


SKIPPED_KEPT = 10_000
"""How many skipped indices ``stats().skipped`` lists; ``skipped_total`` counts them all."""


class StatsRecorder:
    """Cheap counters; read latencies are kept in a fixed-size ring for percentiles.

    Writers: the engine thread (reads, decode replies, skipped indices) and the consumer's
    thread (epochs and delivered batches; decode with ``num_workers=0``).
    """

    RING = 2048

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.batches = 0
            self.samples = 0
            self.epochs = 0
            self.wait_s = 0.0
            self.first_batch_s = 0.0
            self.reads = 0
            self.bytes_read = 0
            self.read_s = 0.0
            self._latencies: list[float] = []
            self._ring_pos = 0
            self.decode_s = 0.0
            self.decode_cpu_s = 0.0
            self.decoded = 0
            self.reads_in_flight = 0
            self.queue_occupancy = 0
            self.skipped: list = []  # the first SKIPPED_KEPT indices
            self.skipped_total = 0
            self.worker_restarts = 0
            self.shm_bytes = 0
            self._closed_s = 0.0
            self._epoch_start: float | None = None
            self._epoch_last = 0.0
            self._first_pending = False

    # -- engine thread (one writer, no lock) ------------------------------------------------
    def skip(self, indices) -> None:
        """Samples left out with ``on_error="skip"``: all are counted, the first
        :data:`SKIPPED_KEPT` indices kept (a corrupt shard must not grow memory for ever)."""
        indices = list(indices)
        self.skipped_total += len(indices)
        room = SKIPPED_KEPT - len(self.skipped)
        if room > 0:
            self.skipped.extend(indices[:room])

    def read_started(self) -> None:
        self.reads_in_flight += 1

    def read_done(self, seconds: float, nbytes: int) -> None:
        self.reads_in_flight -= 1
        self.reads += 1
        self.bytes_read += nbytes
        self.read_s += seconds
        latencies = self._latencies
        if len(latencies) < self.RING:
            latencies.append(seconds)
        else:
            latencies[self._ring_pos] = seconds
            self._ring_pos = (self._ring_pos + 1) % self.RING

    def decoded_batch(self, samples: int, seconds: float, cpu_s: float | None = None) -> None:
        """``samples`` decoded in ``seconds`` of wall time, of which ``cpu_s`` on a CPU."""
        with self._lock:
            self.decoded += samples
            self.decode_s += seconds
            self.decode_cpu_s += seconds if cpu_s is None else cpu_s

    # -- the consumer's thread ----------------------------------------------------------------
    def begin_epoch(self) -> None:
        """``iter(loader)`` was called: the consumer's clock starts (again)."""
        now = time.perf_counter()
        with self._lock:
            self._close_epoch()
            self.epochs += 1
            self._epoch_start = self._epoch_last = now
            self._first_pending = True

    def delivered(self, samples: int, waited: float) -> None:
        """A batch was handed over after ``waited`` seconds inside ``__next__``."""
        now = time.perf_counter()
        with self._lock:
            if self._epoch_start is None:
                self._epoch_start = now - waited
                self.epochs += 1
                self._first_pending = True
            self._account_wait(now, waited)
            self.batches += 1
            self.samples += samples

    def end_epoch(self, waited: float) -> None:
        """``__next__`` found the end of the epoch after ``waited`` seconds."""
        now = time.perf_counter()
        with self._lock:
            if self._epoch_start is None:
                return
            self._account_wait(now, waited)
            self._close_epoch()

    def _account_wait(self, now: float, waited: float) -> None:
        """Charge ``waited`` to the epoch's start-up (first batch) or to waiting (with the lock)."""
        if self._first_pending:
            started = self._epoch_start if self._epoch_start is not None else now
            self.first_batch_s += now - started
            self._first_pending = False
        else:
            self.wait_s += waited
        self._epoch_last = now

    def _close_epoch(self) -> None:
        if self._epoch_start is not None:
            self._closed_s += self._epoch_last - self._epoch_start
            self._epoch_start = None

    def _elapsed(self) -> float:
        if self._epoch_start is None:
            return self._closed_s
        return self._closed_s + self._epoch_last - self._epoch_start

    @property
    def first_batch_pending(self) -> bool:
        """The current epoch has not delivered its first batch yet."""
        return self._first_pending

    def totals(self) -> tuple:
        """``(batches, wait_s, reads, read_s, bytes_read, decode_s, decoded)``, without sorting
        latencies: what the autotuner samples a few times a second."""
        with self._lock:
            return (self.batches, self.wait_s, self.reads, self.read_s, self.bytes_read,
                    self.decode_s, self.decoded)

    def snapshot(self, **gauges) -> LoaderStats:
        """Freeze the counters; ``gauges`` are the live figures only the loader knows
        (``queue_occupancy``, ``io_concurrency``, ``queue_depth``, ``num_workers``, ...)."""
        with self._lock:
            latencies = list(self._latencies)
            values: dict[str, Any] = dict(
                batches=self.batches, samples=self.samples, epochs=self.epochs,
                elapsed_s=self._elapsed(), first_batch_s=self.first_batch_s, wait_s=self.wait_s,
                reads=self.reads, bytes_read=self.bytes_read, read_s=self.read_s,
                decoded=self.decoded, decode_s=self.decode_s, decode_cpu_s=self.decode_cpu_s,
                reads_in_flight=max(0, self.reads_in_flight), queue_occupancy=self.queue_occupancy,
                skipped=tuple(self.skipped), skipped_total=self.skipped_total, worker_restarts=self.worker_restarts,
                shm_bytes=self.shm_bytes,
            )
        values["read_p50_ms"] = _percentile(latencies, 0.5) * 1e3
        values["read_p99_ms"] = _percentile(latencies, 0.99) * 1e3
        values.update(gauges)
        return LoaderStats(**values)
