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

The verdict also weighs CPU counters read at the start and end of each epoch: the machine's
(``/proc/stat``), this process's and its workers' (``/proc/<pid>/stat``), and the time the
workers spent waiting for a CPU (``/proc/<pid>/task/*/schedstat``), so that "this loader has
too many workers" is told apart from "other programs are using these CPUs".

Cost: reads update plain counters from the engine thread, which is their only writer (no
lock); batches take one uncontended lock in the consumer's thread. Snapshots sort at most
``StatsRecorder.RING`` recent read latencies.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field, fields, replace
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from aioload._observe import memory as _memory
from aioload._base.walk import caches_of, held_bytes

DATA_BOUND = 0.10
"""Waiting at least this share of the steady state makes a loop "data-bound"."""

SATURATED = 0.8
"""A stage busy at least this share of its capacity is "saturated"."""

OFF_CPU = 0.6
"""Decode that was on a CPU less than this share of the time it ran was mostly off one:
waiting for a CPU, or blocked (on I/O, a sleep, a lock)."""

CPU_WAIT = 0.5
"""Off-CPU decode is "waiting for a CPU" when at least this share of its off-CPU time was
spent runnable in the scheduler's queue (the workers' ``/proc/<pid>/task/*/schedstat``)."""

OTHERS_CPUS = 0.5
"""Other programs that used at least this many CPUs' worth of time are "competing"."""

SPARE_CPUS = 0.75
"""At least this many CPUs' worth of idle time means there is room for another worker."""

CATEGORIES = (
    "no-batches", "starting", "copy-on-read", "not-data-bound", "in-process", "decode-bound", "too-many-workers",
    "cpu-contention", "decode-blocked", "shard-bound", "read-bound", "read-latency-bound", "executor-saturated",
    "executor-underused", "unexplained",
)
"""Every value of :attr:`LoaderStats.verdict_category` (see ``docs/stats.md``)."""


COUNTER, GAUGE, DERIVED = "counter", "gauge", "derived"
"""The kinds of statistic. A counter is cumulative over the loader's life (``since`` subtracts
it; a tuple counter such as ``skipped`` keeps the later entries); a gauge is the value at the
snapshot (``since`` keeps the later one); a derived figure is computed from the others."""


@dataclass(frozen=True)
class Stat:
    """How one field of :class:`LoaderStats` is declared: its kind, what it means, its unit and
    where a snapshot takes it from. The field's name, type and default are the dataclass's."""

    kind: str
    doc: str
    unit: str = ""
    source: str = ""
    """``"recorder"``: a :class:`StatsRecorder` attribute of the same name (``reset`` sets it
    to the field's default); ``"clock"``: the recorder's epoch clock; ``"cpu"``: the
    :class:`CpuWindow` totals; ``"memory"``: the
    :class:`~aioload._observe.memory.MemoryWindow`'s figures; ``"latency"``: the
    read latency ring; ``"loader"``: a live figure the loader passes to ``snapshot``;
    ``""`` for a derived figure."""
    formula: Callable[[Any], Any] | None = None
    """A derived figure's value, from the snapshot's other fields (``None``: the verdict)."""


def _stat(kind: str, doc: str, unit: str = "", source: str = "", formula=None) -> dict:
    return {"stat": Stat(kind, doc, unit, source, formula)}


def _steady(s) -> float:
    return s.elapsed_s - s.first_batch_s


def _worker_window(s) -> float:
    """Seconds each worker could have spent decoding: the steady state after each epoch's first
    batch, plus the decoding of those first batches; not the start-up before them (starting the
    workers, filling the pipeline), which would read as idle decode in a short run."""
    first = s.first_batch_samples * s.decode_s / s.decoded if s.decoded else 0.0
    return min(s.elapsed_s, _steady(s) + first)


def _worker_share(seconds: float, s) -> float:
    window = _worker_window(s) * max(1, s.num_workers)
    return min(1.0, seconds / window) if window > 0 else 0.0


def _per_window(value: float, s) -> float:
    return value / s.cpu_window_s if s.cpu_window_s > 0 else 0.0


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one loader's pipeline (``loader.stats()``); ``str()`` formats it.

    Counters are cumulative over the loader's life; ``later.since(earlier)`` gives the figures
    of the interval between two snapshots. Derived figures (rates, fractions, the verdict) are
    computed from the counters. Each field is declared once, here, with its kind, meaning and
    unit (:data:`STATS`); ``docs/stats.md`` lists them.
    """

    batches: int = field(default=0, metadata=_stat(
        COUNTER, "batches delivered to the consumer", "batches", "recorder"))
    samples: int = field(default=0, metadata=_stat(
        COUNTER, "samples delivered to the consumer (exact count)", "samples", "recorder"))
    epochs: int = field(default=0, metadata=_stat(
        COUNTER, "epochs begun (an iterator's first `next()`)", "epochs", "recorder"))
    elapsed_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "the consumer's clock: from each epoch's start to its last batch handed over (or its end)",
        "s", "clock"))
    first_batch_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "the part of `elapsed_s` before each epoch's first batch: starting workers, filling the pipeline",
        "s", "recorder"))
    wait_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "time after each epoch's first batch spent inside `__next__`/`__anext__`", "s", "recorder"))
    reads: int = field(default=0, metadata=_stat(
        COUNTER, "`Dataset.read` calls finished (on the event loop, or in the workers); a local file that a "
                 "worker opens itself (`read_in=\"auto\"`) counts as a read of 0 bytes on the event loop, and "
                 "not at all where the workers read (then `str()` says `none`)", "reads", "recorder"))
    bytes_read: int = field(default=0, metadata=_stat(
        COUNTER, "the bytes those reads returned (`bytes`, or the first item of a tuple), and those that arrived for "
                 "them and were dropped (the start of an object whose server ignored `Range`)", "bytes", "recorder"))
    read_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "sum of read latencies", "s", "recorder"))
    read_p50_ms: float = field(default=0.0, metadata=_stat(
        GAUGE, "median read latency over the most recent 2048 reads", "ms", "latency"))
    read_p99_ms: float = field(default=0.0, metadata=_stat(
        GAUGE, "99th percentile read latency over the most recent 2048 reads", "ms", "latency"))
    decoded: int = field(default=0, metadata=_stat(
        COUNTER, "samples decoded (decode, transform, writing into shared memory; `__getitem__` for a plain "
                 "dataset)", "samples", "recorder"))
    decode_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "wall time spent decoding those samples", "s", "recorder"))
    decode_cpu_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "CPU time of the same work", "s", "recorder"))
    reads_in_flight: int = field(default=0, metadata=_stat(
        GAUGE, "reads running right now (on the event loop)", "reads", "recorder"))
    read_wait_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "where the workers read: seconds their decoding waited for its task's reads, summed over "
                 "workers", "s", "recorder"))
    read_limited_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "the part of `read_wait_s` during which reads were queued behind the worker's reads-in-flight "
                 "limit", "s", "recorder"))
    queue_occupancy: int = field(default=0, metadata=_stat(
        GAUGE, "finished batches waiting in the ready queue right now", "batches", "loader"))
    io_concurrency: int = field(default=0, metadata=_stat(
        GAUGE, "the reads-in-flight limit in force now (as tuned so far, with `\"auto\"`; where the workers "
               "read, their limits together)", "reads", "loader"))
    io_auto: bool = field(default=False, metadata=_stat(
        GAUGE, "whether `io_concurrency` is `\"auto\"`", "", "loader"))
    io_ceiling: int = field(default=0, metadata=_stat(
        GAUGE, "how far `io_concurrency` may go (`\"auto\"`: its bound; else the limit itself)", "reads",
        "loader"))
    queue_depth: int = field(default=0, metadata=_stat(
        GAUGE, "the ready-queue limit in force now (as tuned so far, with `\"auto\"`)", "batches", "loader"))
    num_workers: int = field(default=0, metadata=_stat(
        GAUGE, "worker processes (with `executor=`: tasks in flight)", "workers", "loader"))
    skipped: tuple = field(default=(), metadata=_stat(
        COUNTER, "dataset indices left out with `on_error=\"skip\"`, in the order they failed (the first 10,000)",
        "indices", "recorder"))
    skipped_total: int = field(default=0, metadata=_stat(
        COUNTER, "how many samples were left out with `on_error=\"skip\"`", "samples", "recorder"))
    worker_restarts: int = field(default=0, metadata=_stat(
        COUNTER, "worker pools replaced after a crash", "pools", "recorder"))
    worker_start: str = field(default="", metadata=_stat(
        GAUGE, "how the workers started: the start method, and whether each was forked from one process that "
        "unpickled the dataset once or unpickled its own copy (and why)", "", "loader"))
    per_source: dict = field(default_factory=dict, metadata=_stat(
        COUNTER, "with an `aioload.Mix`: samples delivered from each source, by name", "samples", "loader"))
    shm_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "shared memory held by batch slots (memfds)", "bytes", "recorder"))
    process_pss_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "the training process's proportional set size (`/proc/self/smaps_rollup`: its private pages, "
               "plus each shared page divided among the processes that map it), as last measured (see Memory "
               "below)", "bytes", "memory"))
    process_peak_pss_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "the highest `process_pss_bytes` measured", "bytes", "memory"))
    worker_pss_bytes: tuple = field(default=(), metadata=_stat(
        GAUGE, "each running worker's proportional set size as last measured, by worker id", "bytes",
        "memory"))
    worker_peak_pss_bytes: tuple = field(default=(), metadata=_stat(
        GAUGE, "each worker's highest PSS measured (in an epoch measured for copy-on-read, and by `stats()`)",
        "bytes", "memory"))
    worker_private_bytes: tuple = field(default=(), metadata=_stat(
        GAUGE, "each worker's private memory as last measured (USS: pages no other process maps)", "bytes",
        "memory"))
    worker_growth_bytes: tuple = field(default=(), metadata=_stat(
        GAUGE, "how much each worker's private memory grew over the last epoch that ended, from its first "
               "batch (copy-on-read shows here)", "bytes", "memory"))
    parquet_row_group_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "what `aioload.Parquet`'s row group caches hold, over the loader's processes (each worker's as "
               "its last task reported it)", "bytes", "memory"))
    parquet_page_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "what `aioload.Parquet`'s page caches hold (uniform mode: pages and page indexes), over the "
               "loader's processes", "bytes", "memory"))
    memory_cache_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "what `aioload.MemoryCache`s hold, over the loader's processes", "bytes", "memory"))
    disk_cache_index_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "what a `aioload.DiskCache`'s index of its folder weighs in memory (estimated from its entries), "
               "over the loader's processes", "bytes", "memory"))
    copy_on_read: str = field(default="", metadata=_stat(
        GAUGE, "the dataset's large Python containers (100,000 items or more), named by attribute, once a worker "
               "grew more than 64 MB over an epoch (the `CopyOnReadWarning`); empty otherwise", "", "recorder"))
    executor: str = field(default="", metadata=_stat(
        GAUGE, "with `executor=`: which one (a Dask cluster by its scheduler's address)", "", "loader"))
    executor_tasks: int = field(default=0, metadata=_stat(
        COUNTER, "with `executor=`: the batches it made", "tasks", "loader"))
    executor_bytes: int = field(default=0, metadata=_stat(
        COUNTER, "with `executor=`: the bytes of the tensors those batches brought back", "bytes", "loader"))
    task_p50_ms: float = field(default=0.0, metadata=_stat(
        GAUGE, "with `executor=`: a task's median round trip (sent, read and decoded there, its batch back)",
        "ms", "loader"))
    task_p99_ms: float = field(default=0.0, metadata=_stat(
        GAUGE, "with `executor=`: a task's 99th percentile round trip", "ms", "loader"))
    shard_mode: str = field(default="", metadata=_stat(
        GAUGE, "with `aioload.WebDataset`: how it reads, `\"uniform\"` (a range request per sample) or "
               "`\"window\"` (whole shards)", "", "loader"))
    shard_range_ignored: str = field(default="", metadata=_stat(
        GAUGE, "uniform mode: the servers (`scheme://host:port`) that answer range requests with whole shards (they "
               "ignore `Range`); empty when none does", "", "loader"))
    shard_fetches: int = field(default=0, metadata=_stat(
        COUNTER, "window mode: whole shards fetched", "shards", "loader"))
    shard_fetch_bytes: int = field(default=0, metadata=_stat(
        COUNTER, "window mode: the bytes of those shards", "bytes", "loader"))
    shard_window_reads: int = field(default=0, metadata=_stat(
        COUNTER, "window mode: reads served from a fetched shard (no request of their own)", "reads", "loader"))
    shard_fetch_wait_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "window mode: seconds reads spent waiting for their shard to arrive, summed over reads", "s",
        "loader"))
    shard_window_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "window mode: the bytes of the shards held now", "bytes", "loader"))
    shard_window_peak_bytes: int = field(default=0, metadata=_stat(
        GAUGE, "window mode: the most bytes of shards held at once in the epoch in progress (or the last one)",
        "bytes", "loader"))
    first_batch_samples: int = field(default=0, metadata=_stat(
        COUNTER, "the samples of each epoch's first batch", "samples", "recorder"))
    cpu_window_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "wall seconds the CPU counters cover (the epochs, like `elapsed_s`)", "s", "cpu"))
    machine_busy_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "CPU-seconds the whole machine was busy in that window: every program's, the kernel's and the "
                 "hypervisor's steal (`/proc/stat`)", "CPU-s", "cpu"))
    program_cpu_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "CPU-seconds of this process (loader and training loop) plus its workers (`/proc/<pid>/stat`)",
        "CPU-s", "cpu"))
    worker_cpu_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "CPU-seconds of the workers alone", "CPU-s", "cpu"))
    worker_cpu_wait_s: float = field(default=0.0, metadata=_stat(
        COUNTER, "seconds the workers' threads were runnable but waiting for a CPU "
                 "(`/proc/<pid>/task/*/schedstat`)", "s", "cpu"))
    cpus: int = field(default=0, metadata=_stat(
        GAUGE, "the machine's CPUs (`/proc/stat`)", "CPUs", "cpu"))
    cpu_wait_measured: bool = field(default=False, metadata=_stat(
        GAUGE, "whether the kernel reported the workers' scheduler waits", "", "cpu"))
    samples_per_s: float = field(init=False, metadata=_stat(
        DERIVED, "`samples / elapsed_s`: what the training loop received from `iter(loader)` on, start-up "
                 "included", "samples/s",
        formula=lambda s: s.samples / s.elapsed_s if s.elapsed_s > 0 else 0.0))
    steady_samples_per_s: float = field(init=False, metadata=_stat(
        DERIVED, "`(samples - first_batch_samples) / (elapsed_s - first_batch_s)`: after each epoch's first "
                 "batch (what `aioload bench` prints)", "samples/s",
        formula=lambda s: ((s.samples - s.first_batch_samples) / _steady(s)
                           if _steady(s) > 0 and s.samples - s.first_batch_samples > 0 else 0.0)))
    wait_fraction: float = field(init=False, metadata=_stat(
        DERIVED, "`wait_s / (elapsed_s - first_batch_s)`: the share of the steady state in which training stood "
                 "still for want of data", "",
        formula=lambda s: min(1.0, s.wait_s / _steady(s)) if _steady(s) > 0 else 0.0))
    decode_ms_per_sample: float = field(init=False, metadata=_stat(
        DERIVED, "`decode_s / decoded`", "ms",
        formula=lambda s: s.decode_s / s.decoded * 1e3 if s.decoded else 0.0))
    requests_per_sample: float = field(init=False, metadata=_stat(
        DERIVED, "storage requests per sample delivered: `shard_fetches / samples` in window mode, else "
                 "`reads / samples` (uniform mode's reads that shared one request count one each)", "requests",
        formula=lambda s: (s.shard_fetches if s.shard_mode == "window" else s.reads) / s.samples if s.samples else 0.0))
    bytes_per_sample: float = field(init=False, metadata=_stat(
        DERIVED, "bytes from storage per sample delivered: `shard_fetch_bytes / samples` in window mode, else "
                 "`bytes_read / samples`", "bytes",
        formula=lambda s: ((s.shard_fetch_bytes if s.shard_mode == "window" else s.bytes_read) / s.samples
                           if s.samples else 0.0)))
    mean_reads_in_flight: float = field(init=False, metadata=_stat(
        DERIVED, "`read_s / elapsed_s` (Little's law)", "reads",
        formula=lambda s: s.read_s / s.elapsed_s if s.elapsed_s > 0 else 0.0))
    decode_busy: float = field(init=False, metadata=_stat(
        DERIVED, "`decode_s / (window * num_workers)`: the share of the workers' time spent decoding, where "
                 "`window` is `elapsed_s - first_batch_s` plus the decoding of the first batches "
                 "(`first_batch_samples * decode_s / decoded`): start-up is not idle decode", "",
        formula=lambda s: _worker_share(s.decode_s, s)))
    read_wait_share: float = field(init=False, metadata=_stat(
        DERIVED, "`read_wait_s / (window * num_workers)`: the share of the workers' time their decoding "
                 "stood waiting for reads (`window` as for `decode_busy`)", "",
        formula=lambda s: _worker_share(s.read_wait_s, s)))
    decode_cpu_share: float = field(init=False, metadata=_stat(
        DERIVED, "`decode_cpu_s / decode_s`: near 100% for CPU-bound decoding on free cores; low when workers "
                 "wait for a CPU or on I/O", "",
        formula=lambda s: min(1.0, s.decode_cpu_s / s.decode_s) if s.decode_s > 0 else 1.0))
    others_cpus: float = field(init=False, metadata=_stat(
        DERIVED, "CPUs used by other programs per second of the window (`machine_busy_s - program_cpu_s`)",
        "CPUs", formula=lambda s: _per_window(max(0.0, s.machine_busy_s - s.program_cpu_s), s)))
    idle_cpus: float = field(init=False, metadata=_stat(
        DERIVED, "CPUs left idle per second of the window", "CPUs",
        formula=lambda s: _per_window(max(0.0, s.cpus * s.cpu_window_s - s.machine_busy_s), s)))
    program_cpus: float = field(init=False, metadata=_stat(
        DERIVED, "CPUs used by this program per second of the window; `cpu_evidence` says these three in words",
        "CPUs", formula=lambda s: _per_window(s.program_cpu_s, s)))
    verdict_category: str = field(init=False, metadata=_stat(
        DERIVED, "what the verdict found, one of the names below: for programs and tests, which should not "
                 "parse the sentence"))
    verdict: str = field(init=False, metadata=_stat(
        DERIVED, "one line, below"))

    def __post_init__(self):
        for name, stat in _FORMULAS:
            object.__setattr__(self, name, stat.formula(self))
        category, sentence = diagnose(self)
        object.__setattr__(self, "verdict_category", category)
        object.__setattr__(self, "verdict", sentence)

    def since(self, earlier: "LoaderStats") -> "LoaderStats":
        """The figures of the interval from ``earlier`` to this snapshot. Gauges (reads in
        flight, queue occupancy, limits) and read percentiles are this snapshot's own; read
        percentiles cover the most recent reads."""
        counters: dict[str, Any] = {}
        for name in _COUNTERS:
            later, before = getattr(self, name), getattr(earlier, name)
            if isinstance(later, dict):
                counters[name] = {key: n - before.get(key, 0) for key, n in later.items()}
            else:
                counters[name] = later[len(before):] if isinstance(later, tuple) else later - before
        return replace(self, **counters)

    @property
    def cpu_evidence(self) -> str:
        """What the CPU figures measured, in words (part of every verdict that uses them)."""
        if self.cpu_window_s <= 0:
            return "no CPU counters measured"
        wait = (f", {self.worker_cpu_wait_s / self.cpu_window_s:.2f} workers waiting for a CPU on average"
                if self.cpu_wait_measured else "")
        return (f"over {self.cpu_window_s:.1f} s: this process and its {_workers(self.num_workers)} used "
                f"{self.program_cpus:.2f} of {self.cpus} CPUs, other programs {self.others_cpus:.2f}, "
                f"idle {self.idle_cpus:.2f}{wait}")

    def __str__(self) -> str:
        return format_stats(self)


STATS: dict[str, Stat] = {f.name: f.metadata["stat"] for f in fields(LoaderStats)}
"""Every statistic, by name, in the order of :class:`LoaderStats`'s fields."""
_FORMULAS = tuple((name, s) for name, s in STATS.items() if s.formula is not None)
_COUNTERS = tuple(name for name, s in STATS.items() if s.kind == COUNTER)
_RECORDED = {f.name: f.default for f in fields(LoaderStats) if STATS[f.name].source == "recorder"}
"""What :class:`StatsRecorder` keeps, with the value :meth:`StatsRecorder.reset` gives it."""
_CPU = tuple(name for name, s in STATS.items() if s.source == "cpu")


def stats_table() -> str:
    """The table of every statistic in ``docs/stats.md`` (a test keeps the two equal)."""
    rows = ["| field | kind | unit | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {s.kind} | {s.unit} | {s.doc} |" for name, s in STATS.items()]
    return "\n".join(rows)


def diagnose(s: LoaderStats) -> tuple[str, str]:
    """``(category, sentence)``: is training waiting for data, why, and what to change.

    A change is advised only where the figures support it: more workers only when decode is
    saturated on a CPU and the machine has idle CPUs; fewer only when the workers waited for
    CPUs that this program itself was using. When other programs took the CPUs, the verdict
    says so and advises no loader change. The categories are :data:`CATEGORIES`.
    """
    if s.batches == 0:
        return "no-batches", "no batches delivered yet"
    if s.elapsed_s - s.first_batch_s <= 0:
        return "starting", f"only the first batch so far ({s.first_batch_s:.2f} s to start)"
    if s.copy_on_read:
        grown = max(s.worker_growth_bytes, default=0)
        return "copy-on-read", (f"memory: the workers copy the dataset's large Python containers as they read them "
                                f"({s.copy_on_read}; up to {_bytes(grown)} a worker over the last epoch): hold them "
                                "in aioload.StringList, numpy arrays or Arrow tables")
    if s.wait_fraction < DATA_BOUND:
        return "not-data-bound", (f"not data-bound (waiting {s.wait_fraction:.0%} of the time): the training "
                                  "step sets the pace")
    head = f"data-bound {s.wait_fraction:.0%} of the time: "
    if s.num_workers == 0:
        return "in-process", head + "loading runs in the training process (num_workers=0), set num_workers"
    if s.executor:
        category, text = _executor_bound(s)
        return category, head + text
    if s.decode_busy >= SATURATED / 2 and s.decode_cpu_share < OFF_CPU:
        category, text = _off_cpu(s)
        return category, head + text
    if s.decode_busy >= SATURATED:
        return "decode-bound", head + _decode_bound(s)
    shard = _shard_bound(s)
    if shard is not None:
        return "shard-bound", head + shard
    if s.io_concurrency and s.mean_reads_in_flight >= SATURATED * s.io_concurrency:
        return "read-bound", head + (f"reads are saturated ({s.mean_reads_in_flight:.0f} of {s.io_concurrency} in "
                                     f"flight, p50 {s.read_p50_ms:.1f} ms), raise io_concurrency")
    worker_reads = _worker_read_bound(s)
    if worker_reads is not None:
        category, text = worker_reads
        return category, head + text
    text = (f"neither reads ({s.mean_reads_in_flight:.0f} of {s.io_concurrency} in flight) nor decode "
            f"({s.decode_busy:.0%} busy) is saturated")
    if s.cpu_window_s > 0 and s.others_cpus >= OTHERS_CPUS:
        text += f"; other programs used {s.others_cpus:.2f} CPUs ({s.cpu_evidence})"
    return "unexplained", head + text + ": no setting is advised from these figures"


READ_WAITING = 0.1
"""Where the workers read, their decoding waiting for reads this share of their time or more
makes the reads the limit."""

LIMIT_BINDS = 0.5
"""... the reads-in-flight limit, when reads were queued behind it this share of that wait."""


def _worker_read_bound(s: LoaderStats) -> tuple[str, str] | None:
    """Where the workers read their samples: the verdict when their decoding waited for
    reads, naming the reads-in-flight limit when it held the reads back."""
    if s.read_wait_share < READ_WAITING:
        return None
    waited = (f"the workers' decoding waited for its reads {s.read_wait_share:.0%} of the time "
              f"(read p50 {s.read_p50_ms:.1f} ms")
    per_worker = -(-s.io_concurrency // max(1, s.num_workers))
    if s.read_limited_s >= LIMIT_BINDS * s.read_wait_s:
        held = f"reads queued behind the reads-in-flight limit {s.read_limited_s / s.read_wait_s:.0%} of that wait"
        if s.io_auto and s.io_concurrency >= s.io_ceiling:
            fix = (f"io_concurrency='auto' has reached its bound ({s.io_ceiling}, {per_worker} per worker): "
                   "the storage needs more reads in flight than that; set io_concurrency above it")
        elif s.io_auto:
            fix = (f"io_concurrency='auto' is raising the limit ({s.io_concurrency} now, {per_worker} per worker); "
                   "a longer run settles it")
        else:
            fix = (f"the limit is io_concurrency={s.io_concurrency} ({per_worker} per worker): raise it, or use "
                   "io_concurrency='auto'")
        return "read-bound", f"{waited}, {held}): {fix}"
    return "read-latency-bound", (
        f"{waited}; reads below the reads-in-flight limit of {s.io_concurrency}, {per_worker} per worker): each "
        "worker reads the samples of the tasks it holds (prefetch_factor of them), and the storage's latency is "
        "longer than decoding one task: raise prefetch_factor so that each worker reads further ahead")


SHARD_WAITING = 1.0
"""Window mode is "shard-bound" when at least this many reads waited for a shard on average."""


def _shard_bound(s: LoaderStats) -> str | None:
    """With an ``aioload.WebDataset``: the shard stage's sentence when it is the limit."""
    if s.shard_mode == "window" and s.elapsed_s > 0 and s.shard_fetch_wait_s / s.elapsed_s >= SHARD_WAITING:
        each = _bytes(s.shard_fetch_bytes / s.shard_fetches) if s.shard_fetches else "?"
        return (f"reads waited for whole-shard fetches ({s.shard_fetch_wait_s / s.elapsed_s:.1f} reads waiting on "
                f"average; {s.shard_fetches} shards fetched, {each} each): fetch more shards ahead "
                "(WebDataset(fetch_ahead=...)), or read samples by range (window=None) if the store is slow per byte")
    if s.shard_mode == "uniform" and s.shard_range_ignored:
        return (f"the server {s.shard_range_ignored} ignores Range: each sample's read downloads its shard from the "
                f"start ({_bytes(s.bytes_per_sample)} from storage per sample): fetch whole shards, once each "
                "(WebDataset(window=k)), or serve the shards from a server that honours Range")
    if (s.shard_mode == "uniform" and s.io_concurrency
            and s.mean_reads_in_flight >= SATURATED * s.io_concurrency):
        return (f"range reads of shard samples are saturated ({s.mean_reads_in_flight:.0f} of {s.io_concurrency} in "
                f"flight, p50 {s.read_p50_ms:.1f} ms, {s.requests_per_sample:.2f} requests per sample): raise "
                "io_concurrency, or fetch whole shards (WebDataset(window=k): one request per shard)")
    return None


def dataset_figures(dataset, since: dict | None = None) -> dict:
    """The statistics a dataset reports of its own I/O (``aioload.WebDataset.io_figures``),
    its counters less those in ``since`` (what it had counted when the loader was made: a
    dataset may feed several loaders in turn)."""
    figures = getattr(dataset, "io_figures", None)
    found = dict(figures()) if callable(figures) else {}
    if since:
        for name, value in found.items():
            stat = STATS.get(name)
            if stat is not None and stat.kind == COUNTER and name in since:
                found[name] = value - since[name]
    return found


def _executor_bound(s: LoaderStats) -> tuple[str, str]:
    """With executor=: a task reads and decodes a whole batch over there; its round trip is the
    figure, and the fix is more tasks in flight or more workers."""
    trip = f"{s.num_workers} tasks in flight, {s.decode_busy:.0%} busy, round trip p50 {s.task_p50_ms:.0f} ms"
    if s.decode_busy >= SATURATED:
        return "executor-saturated", (f"the executor's tasks are saturated ({trip}): add workers to {s.executor}, "
                                      "then raise num_workers")
    return "executor-underused", f"the executor is not kept busy ({trip}): raise num_workers (tasks in flight)"


def _decode_bound(s: LoaderStats) -> str:
    text = f"decode is saturated ({_workers(s.num_workers)} {s.decode_busy:.0%} busy, on a CPU {s.decode_cpu_share:.0%})"
    if s.cpu_window_s <= 0:
        return text + ", raise num_workers if the machine has idle CPUs"
    if s.idle_cpus >= SPARE_CPUS:
        return text + f" and {_cpus(s.idle_cpus)} idle: raise num_workers ({s.cpu_evidence})"
    return text + (f" and {_cpus(s.idle_cpus)} idle, too few for another worker: more workers would not help; "
                   f"make decode cheaper or use more CPUs ({s.cpu_evidence})")


def _cpus(n: float) -> str:
    """``n`` CPUs with its verb, as the figures print it: ``0.21 CPUs were``, ``no CPU was``."""
    return "no CPU was" if f"{n:.2f}" == "0.00" else f"{n:.2f} CPUs were"


def _off_cpu(s: LoaderStats) -> tuple[str, str]:
    """Decode ran, but was on a CPU less than :data:`OFF_CPU` of that time: waiting for a CPU
    (whose?) or blocked (on what?)."""
    share = f"decode was on a CPU {s.decode_cpu_share:.0%} of the time it ran"
    if s.cpu_window_s <= 0:
        return "unexplained", (f"{share}; whether it waited for a CPU or was blocked is not known (no CPU "
                               "counters measured): no setting is advised from these figures")
    off = s.decode_s - s.decode_cpu_s
    if s.cpu_wait_measured:
        waited = s.worker_cpu_wait_s / off if off > 0 else 0.0
        waiting = waited >= CPU_WAIT
        evidence = f"it waited for a CPU {min(1.0, waited):.0%} of its off-CPU time"
    else:  # no scheduler figures: a machine without an idle CPU is the evidence of waiting
        waiting = s.idle_cpus < SPARE_CPUS / 2
        evidence = f"{_cpus(s.idle_cpus)} idle"
    if not waiting:
        if not s.reads:  # a plain dataset: __getitem__ also does the I/O
            fix = "give the dataset an async read() (aioload.Dataset) for its I/O"
        else:
            fix = "move the I/O or waiting out of decode() into read()"
        return "decode-blocked", f"{share}, blocked, not waiting for a CPU ({evidence}): {fix}"
    evidence = s.cpu_evidence
    main_cpus = max(0.0, s.program_cpu_s - s.worker_cpu_s) / s.cpu_window_s  # the training process's own
    demand = s.num_workers + main_cpus
    if s.num_workers > s.cpus or (demand > s.cpus + SPARE_CPUS and s.others_cpus < OTHERS_CPUS):
        fewer = max(1, round(s.cpus - main_cpus))
        extra = f"; other programs also used {s.others_cpus:.2f} CPUs" if s.others_cpus >= OTHERS_CPUS else ""
        return "too-many-workers", (f"{share}, waiting for CPUs that this program's own processes hold "
                                    f"({s.num_workers} workers on {s.cpus} CPUs{extra}; {evidence}): lower "
                                    f"num_workers to {fewer}")
    if s.others_cpus >= OTHERS_CPUS:
        return "cpu-contention", (f"{share}, waiting for CPUs that other programs used ({evidence}): the cause is "
                                  "outside the loader; changing num_workers would not help")
    return "unexplained", (f"{share}, waiting for a CPU, yet neither this program nor others used the CPUs "
                           f"({evidence}): no setting is advised from these figures")


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
        ("throughput", f"{s.samples_per_s:.1f} samples/s from iter() on, start-up included; "
                       f"{s.steady_samples_per_s:.1f} after the first batch ({s.samples} samples, {s.batches} "
                       f"batches, {s.epochs} epoch{'' if s.epochs == 1 else 's'}, {s.elapsed_s:.2f} s)"),
        ("waiting", f"{s.wait_fraction:.1%} of the time after the first batch "
                    f"({s.wait_s:.2f} s; first batches took {s.first_batch_s:.2f} s)"),
        ("reads", _reads_row(s)),
        ("decode", f"{s.decode_ms_per_sample:.3f} ms/sample, {_workers(s.num_workers)} {s.decode_busy:.0%} busy, "
                   f"on a CPU {s.decode_cpu_share:.0%} of that time"),
        *([("shards", _shard_row(s))] if s.shard_mode else []),
        ("queue", f"{s.queue_occupancy} batches ready, queue_depth {s.queue_depth}"),
        *([("executor", f"{s.executor}: {s.executor_tasks} tasks, round trip p50 {s.task_p50_ms:.1f} ms, "
                        f"p99 {s.task_p99_ms:.1f} ms, {_bytes(s.executor_bytes / max(1, s.executor_tasks))} "
                        "back per batch")] if s.executor else []),
        ("skipped", skipped),
        ("worker restarts", f"{s.worker_restarts}"),
        ("memory", _memory_row(s)),
        ("CPUs", s.cpu_evidence),
        ("verdict", f"[{s.verdict_category}] {s.verdict}"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {text}" for label, text in rows)


_CACHE_KINDS = {"parquet_row_groups": "parquet_row_group_bytes", "parquet_pages": "parquet_page_bytes",
                "memory_cache": "memory_cache_bytes", "disk_cache_index": "disk_cache_index_bytes"}
"""A kind of cache (``aioload._storage.cache.hold``) -> its statistic."""


def _memory_row(s: LoaderStats) -> str:
    workers = ""
    if s.worker_pss_bytes:
        workers = (f"; workers {', '.join(_bytes(n) for n in s.worker_pss_bytes)} (peak "
                   f"{_bytes(max(s.worker_peak_pss_bytes))}), of which private "
                   f"{', '.join(_bytes(n) for n in s.worker_private_bytes)}, grown "
                   f"{', '.join(_bytes(n) for n in s.worker_growth_bytes)} over the last epoch")
    caches = [(name, getattr(s, field)) for name, field in (
        ("Parquet row groups", "parquet_row_group_bytes"), ("Parquet pages", "parquet_page_bytes"),
        ("memory cache", "memory_cache_bytes"), ("disk cache index", "disk_cache_index_bytes"))]
    held = "".join(f"; {name} {_bytes(nbytes)}" for name, nbytes in caches if nbytes)
    return (f"PSS: this process {_bytes(s.process_pss_bytes)}{workers}; batch slots {_bytes(s.shm_bytes)} "
            f"shared{held}")


def _reads_row(s: LoaderStats) -> str:
    if not s.reads:  # not a row of zeros: a local folder's workers open their files, a plain dataset has no read()
        return "none: each sample was loaded by the worker that decoded it (a local file it opened itself, or __getitem__)"
    return (f"{s.reads} ({_bytes(s.bytes_read)} on the event loop), p50 {s.read_p50_ms:.2f} ms, "
            f"p99 {s.read_p99_ms:.2f} ms, {s.mean_reads_in_flight:.1f} in flight on average, "
            f"{s.reads_in_flight} now, limit {s.io_concurrency}{' (auto)' if s.io_auto else ''}"
            + (f"; the workers' decoding waited for reads {s.read_wait_share:.0%} of the time, "
               f"{s.read_limited_s / s.read_wait_s:.0%} of that at the limit" if s.read_wait_s > 0 else ""))


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def _shard_row(s: LoaderStats) -> str:
    text = (f"{s.shard_mode} mode: {s.requests_per_sample:.3f} requests and {_bytes(s.bytes_per_sample)} from "
            "storage per sample")
    if s.shard_range_ignored:
        text += f" (Range ignored by {s.shard_range_ignored})"
    if s.shard_mode == "window":
        text += (f"; {s.shard_fetches} shards fetched, {_bytes(s.shard_window_bytes)} held now, "
                 f"{_bytes(s.shard_window_peak_bytes)} at the peak; reads waited {s.shard_fetch_wait_s:.2f} s for them")
    return text


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[pos]


_CPU_SUMS = ("cpu_window_s", "machine_busy_s", "program_cpu_s", "worker_cpu_s", "worker_cpu_wait_s")
"""The CPU counters :class:`CpuWindow` adds up (its :meth:`~CpuWindow.totals` adds ``cpus`` and
``cpu_wait_measured``: together, the statistics of source ``"cpu"``)."""

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[float, int] | None:
    """``(busy CPU-seconds since boot, CPUs)`` of the whole machine, from ``/proc/stat``: every
    process's time, the kernel's and the hypervisor's steal; not idle or I/O wait. ``None``
    where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
        values = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    cpus = sum(1 for line in lines[1:] if line.startswith(b"cpu"))
    return (sum(values) - values[3] - values[4]) / _TICK, cpus


def process_cpu(pid: int) -> tuple[float, float | None] | None:
    """``(CPU seconds, seconds runnable but waiting for a CPU)`` of process ``pid`` over its
    life, all its threads: ``/proc/<pid>/stat`` and ``/proc/<pid>/task/*/schedstat`` (the
    second is ``None`` where the kernel has no scheduler statistics). ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    waited = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                waited += int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return cpu, None
    return cpu, waited


class CpuWindow:
    """The CPU counters of the machine and of a loader's processes over the windows it is
    measured in (its epochs): :meth:`open` and :meth:`close` bracket one; :meth:`totals` adds
    the closed ones to the open one. The loader's processes are this one (loader and training
    loop) and the worker pids ``workers()`` returns."""

    def __init__(self, workers: Callable[[], list[int | None]]):
        self.workers = workers
        self.closed = dict.fromkeys(_CPU_SUMS, 0.0)
        self.measured = False  # scheduler wait figures were read for some worker
        self.cpus = 0
        self._base: tuple | None = None

    def _sample(self) -> tuple | None:
        machine = machine_cpu()
        if machine is None:
            return None
        self.cpus = machine[1]
        procs = {}
        for pid in self.workers():
            figures = process_cpu(pid) if pid is not None else None
            if figures is not None:
                procs[pid] = figures
        return time.perf_counter(), machine[0], time.process_time(), procs

    def open(self) -> None:
        self.close()
        self._base = self._sample()

    def close(self) -> None:
        base, self._base = self._base, None
        if base is not None:
            for key, value in self._delta(base).items():
                self.closed[key] += value

    def _delta(self, base) -> dict:
        now = self._sample()
        if now is None:
            return {}
        worker = wait = 0.0
        for pid, (cpu, waited) in now[3].items():
            cpu0, waited0 = base[3].get(pid, (0.0, 0.0))
            worker += cpu - cpu0
            if waited is not None and waited0 is not None:
                wait += waited - waited0
                self.measured = True
        return dict(cpu_window_s=now[0] - base[0], machine_busy_s=now[1] - base[1],
                    program_cpu_s=now[2] - base[2] + worker, worker_cpu_s=worker, worker_cpu_wait_s=wait)

    def totals(self) -> dict:
        """The :data:`STATS` of source ``"cpu"``, by name, over every window so far."""
        totals = dict(self.closed)
        if self._base is not None:
            for key, value in self._delta(self._base).items():
                totals[key] += value
        return dict(totals, cpus=self.cpus, cpu_wait_measured=self.measured)


SKIPPED_KEPT = 10_000
"""How many skipped indices ``stats().skipped`` lists; ``skipped_total`` counts them all."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def outside_frames() -> int:
    """The ``stacklevel`` of the first caller outside aioload (the loop that iterates a loader)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class StatsRecorder:
    """Cheap counters; read latencies are kept in a fixed-size ring for percentiles.

    Writers: the engine thread (reads, decode replies, skipped indices) and the consumer's
    thread (epochs and delivered batches; decode with ``num_workers=0``).
    """

    RING = 2048

    if TYPE_CHECKING:  # the counters (``batches``, ``reads``, ...) are set by reset() from STATS
        copy_on_read: str
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __init__(self):
        self._lock = threading.Lock()
        self.worker_pids: Callable[[], list[int | None]] = list  # set by the loader: its workers' pids
        # A BlockingReadWarning found where the reads run, for the consumer's thread to warn
        # with; then True (once per loader: not reset with the counters).
        self.stall: Warning | bool | None = None
        self.dataset: Any = None  # set by the loader: walked for copy-on-read's culprits
        # each worker's memory, by worker id (gauges: not reset with the counters)
        self._memory = _memory.MemoryWindow(lambda: self.worker_pids())
        self._copying: Warning | None = None  # a CopyOnReadWarning for the consumer's thread to give
        # what each worker's caches held after its last task, by worker id: {kind: bytes}
        self._caches: dict[int, dict[str, int]] = {}
        self._own_caches: list | None = None  # the dataset's caches in this process, once found
        self.reset()

    def reset(self) -> None:
        """Every counter back to zero (the statistics of source ``"recorder"``, from
        :data:`STATS`), the latency ring emptied, no epoch running."""
        with self._lock:
            for name, default in _RECORDED.items():
                setattr(self, name, default)
            self.skipped: list = []  # the first SKIPPED_KEPT indices
            self.read_limits: dict[int, int] = {}  # where the workers read: each one's limit, by worker id
            self._latencies: list[float] = []
            self._ring_pos = 0
            self._cpu = CpuWindow(lambda: self.worker_pids())
            self._closed_s = 0.0
            self._epoch_start: float | None = None
            self._epoch_last = 0.0
            self._first_pending = False
            self._memory_opened = False  # the epoch's memory baseline taken (memory.OPEN_AFTER_S)

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
        self._keep_latency(seconds)

    def worker_reads(self, latencies: list[float], nbytes: int, waited_s: float = 0.0,
                     limited_s: float = 0.0) -> None:
        """Reads done for one task in a worker process or an executor's (not on the event
        loop, so never in flight here): ``latencies`` in seconds, one per read, ``nbytes``
        their bytes together; ``waited_s``, how long the decoding waited for them, of which
        ``limited_s`` with reads queued behind the reads-in-flight limit."""
        self.reads += len(latencies)
        self.bytes_read += nbytes
        self.read_s += sum(latencies)
        self.read_wait_s += waited_s
        self.read_limited_s += limited_s
        for seconds in latencies:
            self._keep_latency(seconds)

    def read_limit(self, worker: int, limit: int) -> None:
        """Worker ``worker`` reads with at most ``limit`` reads in flight now."""
        self.read_limits[worker] = limit

    def worker_read_limit(self) -> int | None:
        """The workers' reads-in-flight limits together, as their last replies gave them
        (``None`` before any reply of a worker that reads)."""
        limits = self.read_limits
        return sum(limits.values()) if limits else None

    def worker_caches(self, worker: int, held: tuple) -> None:
        """Worker ``worker``'s caches hold ``held`` (``(kind, bytes)`` pairs) now."""
        self._caches[worker] = dict(held)

    def cache_figures(self) -> dict[str, int]:
        """Each kind of cache's bytes: this process's and the workers' last reported."""
        totals = dict.fromkeys(_CACHE_KINDS.values(), 0)
        if self._own_caches is None and self.dataset is not None:
            self._own_caches = caches_of(self.dataset)
        for held in [held_bytes(self._own_caches or []), *list(self._caches.values())]:
            for kind, nbytes in held.items():
                if kind in _CACHE_KINDS:
                    totals[_CACHE_KINDS[kind]] += nbytes
        return totals

    def read_stalled(self, warning: Warning) -> None:
        """A ``read`` blocks its event loop: the consumer warns with ``warning``, once."""
        if self.stall is None:
            self.stall = warning

    def warn_stalled(self) -> None:
        """In the consumer's thread: the stall warning, if one waits (once per loader)."""
        stall = self.stall
        if isinstance(stall, Warning):
            self.stall = True
            warnings.warn(stall, stacklevel=outside_frames())

    def _keep_latency(self, seconds: float) -> None:
        """Into the ring of the :attr:`RING` most recent read latencies."""
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
            self._memory_opened = False
            self._cpu.open()
        self._warn_copying()

    def delivered(self, samples: int, waited: float) -> None:
        """A batch was handed over after ``waited`` seconds inside ``__next__``."""
        now = time.perf_counter()
        with self._lock:
            if self._epoch_start is None:
                self._epoch_start = now - waited
                self.epochs += 1
                self._first_pending = True
                self._memory_opened = False
                self._cpu.open()
            if self._first_pending:
                self.first_batch_samples += samples
            if (not self._memory_opened and now - self._epoch_start >= _memory.OPEN_AFTER_S
                    and self._memory.affordable()):
                self._memory_opened = True
                self._memory.open()  # each worker's private memory from here to the epoch's end
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
        self._warn_copying()

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
            self._cpu.close()
            self._copied(self._memory.close())

    def _copied(self, growth: int) -> None:
        """The epoch's largest worker growth: past :data:`~aioload._observe.memory.GROWTH_WARNING`,
        the dataset's large containers are named (once per loader)."""
        if growth <= _memory.GROWTH_WARNING or self.copy_on_read or self.dataset is None:
            return
        found = _memory.large_containers(self.dataset)
        if not found:
            return
        self.copy_on_read = ", ".join(f"{path} ({items:,} items)" for path, _, items in found)
        grown = [(m.growth, wid, m.pid) for wid, m in enumerate(self._memory.known) if m is not None]
        most, wid, pid = max(grown)
        self._copying = _memory.copy_on_read_warning(found, wid, pid, most, self.epochs - 1)

    def _warn_copying(self) -> None:
        """In the consumer's thread, outside the lock: the copy-on-read warning, if one waits."""
        copying, self._copying = self._copying, None
        if copying is not None:
            warnings.warn(copying, stacklevel=outside_frames())

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

    def settle(self) -> None:
        """No measurement thread left running (the loader's ``close()``)."""
        self._memory.join()

    def snapshot(self, **gauges) -> LoaderStats:
        """Freeze the counters; ``gauges`` are the live figures only the loader knows
        (``queue_occupancy``, ``io_concurrency``, ``queue_depth``, ``num_workers``, ...)."""
        with self._lock:
            latencies = list(self._latencies)
            values: dict[str, Any] = {name: getattr(self, name) for name in _RECORDED}
            values.update(elapsed_s=self._elapsed(), reads_in_flight=max(0, self.reads_in_flight),
                          skipped=tuple(self.skipped), **self._cpu.totals())
        values["read_p50_ms"] = _percentile(latencies, 0.5) * 1e3
        values["read_p99_ms"] = _percentile(latencies, 0.99) * 1e3
        values.update(self._memory.figures())
        values.update(self.cache_figures())
        values.update(gauges)
        return LoaderStats(**values)
