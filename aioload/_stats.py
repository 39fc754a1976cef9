"""Counters the pipeline updates as it runs, and the frozen snapshot users read."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one loader's pipeline (``loader.stats()``)."""

    batches: int
    samples: int
    elapsed_s: float
    samples_per_s: float
    wait_s: float
    wait_fraction: float
    reads: int
    bytes_read: int
    read_p50_ms: float
    read_p99_ms: float
    decode_ms_per_sample: float
    reads_in_flight: int
    queue_occupancy: int
    skipped: tuple = field(default_factory=tuple)
    worker_restarts: int = 0
    shm_bytes: int = 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[pos]


class StatsRecorder:
    """Cheap counters; read latencies are kept in a fixed-size ring for percentiles."""

    RING = 2048

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.started = None
            self.batches = 0
            self.samples = 0
            self.wait_s = 0.0
            self.reads = 0
            self.bytes_read = 0
            self._latencies: list[float] = []
            self._ring_pos = 0
            self.decode_s = 0.0
            self.decoded = 0
            self.reads_in_flight = 0
            self.queue_occupancy = 0
            self.skipped: list = []
            self.worker_restarts = 0
            self.shm_bytes = 0

    def read_started(self) -> None:
        self.reads_in_flight += 1

    def read_done(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.reads_in_flight -= 1
            self.reads += 1
            self.bytes_read += nbytes
            if len(self._latencies) < self.RING:
                self._latencies.append(seconds)
            else:
                self._latencies[self._ring_pos] = seconds
                self._ring_pos = (self._ring_pos + 1) % self.RING

    def decoded_batch(self, samples: int, seconds: float) -> None:
        with self._lock:
            self.decoded += samples
            self.decode_s += seconds

    def delivered(self, samples: int, waited: float) -> None:
        with self._lock:
            if self.started is None:
                self.started = time.perf_counter() - waited
            self.batches += 1
            self.samples += samples
            self.wait_s += waited

    def snapshot(self) -> LoaderStats:
        with self._lock:
            elapsed = 0.0 if self.started is None else time.perf_counter() - self.started
            lat = list(self._latencies)
            return LoaderStats(
                batches=self.batches,
                samples=self.samples,
                elapsed_s=elapsed,
                samples_per_s=self.samples / elapsed if elapsed > 0 else 0.0,
                wait_s=self.wait_s,
                wait_fraction=self.wait_s / elapsed if elapsed > 0 else 0.0,
                reads=self.reads,
                bytes_read=self.bytes_read,
                read_p50_ms=_percentile(lat, 0.5) * 1e3,
                read_p99_ms=_percentile(lat, 0.99) * 1e3,
                decode_ms_per_sample=self.decode_s / self.decoded * 1e3 if self.decoded else 0.0,
                reads_in_flight=max(0, self.reads_in_flight),
                queue_occupancy=self.queue_occupancy,
                skipped=tuple(self.skipped),
                worker_restarts=self.worker_restarts,
                shm_bytes=self.shm_bytes,
            )
