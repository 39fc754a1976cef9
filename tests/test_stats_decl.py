"""Each statistic is declared once (a field of LoaderStats with its kind, unit and meaning):
the docs' table, ``since``, ``StatsRecorder.reset`` and ``snapshot`` all follow from it."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from aioload._observe.stats import COUNTER, DERIVED, GAUGE, STATS, LoaderStats, StatsRecorder, stats_table

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "stats.md"
SOURCES = {"recorder", "clock", "cpu", "memory", "latency", "loader"}


def test_every_field_is_declared_with_a_kind_and_a_meaning():
    names = [f.name for f in dataclasses.fields(LoaderStats)]
    assert list(STATS) == names
    for name, stat in STATS.items():
        assert stat.kind in (COUNTER, GAUGE, DERIVED), name
        assert stat.doc.strip(), name
        if stat.kind == DERIVED:
            assert stat.source == "", name
        else:
            assert stat.source in SOURCES, name
    derived = {f.name for f in dataclasses.fields(LoaderStats) if not f.init}
    assert derived == {name for name, s in STATS.items() if s.kind == DERIVED}


def test_the_docs_list_every_statistic():
    text = DOCS.read_text()
    for name in (f.name for f in dataclasses.fields(LoaderStats)):
        assert f"| `{name}` |" in text, name
    assert stats_table() in text  # the meanings, kinds and units as declared


def test_since_follows_the_kinds():
    values = {f.name: (7 if f.type in ("int", int) else 7.5) for f in dataclasses.fields(LoaderStats) if f.init}
    values.update(skipped=(1, 2, 3), executor="tcp://a:1", cpu_wait_measured=True)
    later = LoaderStats(**values)
    earlier = LoaderStats(**{k: (v[:1] if isinstance(v, tuple) else v) for k, v in values.items()
                             if STATS[k].kind == COUNTER})
    interval = later.since(earlier)
    for name, stat in STATS.items():
        if stat.kind == COUNTER and name != "skipped":
            assert getattr(interval, name) == 0, name
        elif stat.kind == GAUGE:
            assert getattr(interval, name) == getattr(later, name), name
    assert interval.skipped == (2, 3)
    assert interval.samples_per_s == 0.0 and later.samples_per_s == pytest.approx(7 / 7.5)  # recomputed


def test_snapshot_takes_every_recorded_statistic_and_reset_clears_them():
    rec = StatsRecorder()
    recorded = [name for name, s in STATS.items() if s.source == "recorder"]
    for number, name in enumerate(recorded, start=1):
        setattr(rec, name, [number] if name == "skipped" else number)
    snap = rec.snapshot()
    for number, name in enumerate(recorded, start=1):
        assert getattr(snap, name) == ((number,) if name == "skipped" else number), name
    rec.read_done(0.5, 10)
    rec.reset()
    fresh = StatsRecorder().snapshot()
    after = rec.snapshot()
    for name in recorded + ["read_p50_ms", "read_p99_ms", "elapsed_s"]:
        assert getattr(after, name) == getattr(fresh, name), name


def test_worker_reads_count_like_reads_on_the_event_loop():
    rec = StatsRecorder()
    rec.read_started()  # one read running on the event loop meanwhile
    rec.worker_reads([0.010, 0.030, 0.020], 300)
    snap = rec.snapshot()
    assert (snap.reads, snap.bytes_read, snap.reads_in_flight) == (3, 300, 1)
    assert snap.read_s == pytest.approx(0.06)
    assert snap.read_p50_ms == pytest.approx(20.0)
    assert snap.read_p99_ms == pytest.approx(30.0)
    rec.read_done(0.040, 50)
    snap = rec.snapshot()
    assert (snap.reads, snap.bytes_read, snap.reads_in_flight) == (4, 350, 0)
    assert snap.read_p99_ms == pytest.approx(40.0)


def test_worker_reads_keep_only_the_most_recent_latencies():
    rec = StatsRecorder()
    rec.worker_reads([1.0] * StatsRecorder.RING, 0)
    rec.worker_reads([0.001] * StatsRecorder.RING, 0)
    snap = rec.snapshot()
    assert snap.reads == 2 * StatsRecorder.RING
    assert snap.read_p99_ms == pytest.approx(1.0)
    assert snap.read_s == pytest.approx(StatsRecorder.RING * 1.001)


def test_worker_reads_of_nothing_change_nothing():
    rec = StatsRecorder()
    rec.worker_reads([], 0)
    snap = rec.snapshot()
    assert (snap.reads, snap.bytes_read, snap.read_s, snap.read_p50_ms) == (0, 0, 0.0, 0.0)
