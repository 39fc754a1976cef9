"""loader.stats(), its verdict, log_every=, progress=, and the autotuner.

Workloads have known costs (a read that sleeps, a decode that burns CPU time), so the figures
have known lower bounds; counts are exact. No test asserts speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import sys
import time

import pytest
import torch

import aioload
from aioload._data.limiter import Limiter
from aioload._observe.stats import LoaderStats, StatsRecorder, format_stats
from aioload._engine.spec import BatchBound
from aioload._observe import tune
from aioload._observe.tune import Controller, Tuner, Window

READ_S = 0.02
BUSY_S = 0.005
PAYLOAD = 100


class Timed(aioload.Dataset):
    """``read`` sleeps ``read_s`` and returns ``PAYLOAD`` bytes; ``decode`` burns ``busy_s`` of
    CPU time; reads of the indices in ``bad`` fail."""

    def __init__(self, n: int = 16, read_s: float = 0.0, busy_s: float = 0.0, bad=()):
        self.n, self.read_s, self.busy_s, self.bad = n, read_s, busy_s, frozenset(bad)

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        if self.read_s:
            await asyncio.sleep(self.read_s)
        if i in self.bad:
            raise OSError(f"cannot read sample {i}")
        return i.to_bytes(4, "little") * (PAYLOAD // 4)

    def decode(self, raw):
        end = time.thread_time() + self.busy_s
        while time.thread_time() < end:
            pass
        return torch.tensor([int.from_bytes(raw[:4], "little")])


def drain(loader, epochs: int = 1, step_s: float = 0.0) -> list[int]:
    seen = []
    for _ in range(epochs):
        for batch in loader:
            seen += batch.flatten().tolist()
            if step_s:
                time.sleep(step_s)
    return seen


# -- figures against known workloads ------------------------------------------------------
def test_read_latency_and_exact_counts():
    with aioload.DataLoader(Timed(16, read_s=READ_S), batch_size=4, num_workers=2) as loader:
        assert sorted(drain(loader, epochs=2)) == sorted(list(range(16)) * 2)
        s = loader.stats()
    assert (s.batches, s.samples, s.epochs, s.reads, s.decoded) == (8, 32, 2, 32, 32)
    assert s.bytes_read == 32 * PAYLOAD
    # every read sleeps READ_S: a lower bound on each (the event loop's timers have millisecond
    # resolution, so a sleep may end up to 1 ms early); no upper bound, this machine is shared
    assert READ_S * 1e3 - 1 <= s.read_p50_ms <= s.read_p99_ms
    assert s.read_s >= 32 * (READ_S - 1e-3)
    assert s.reads_in_flight == 0
    assert s.skipped == () and s.worker_restarts == 0
    assert s.num_workers == 2 and s.io_concurrency == 64
    assert s.elapsed_s > s.first_batch_s > 0
    assert 0 < s.samples_per_s == pytest.approx(s.samples / s.elapsed_s)


def test_decode_time_per_sample_in_workers():
    with aioload.DataLoader(Timed(8, busy_s=BUSY_S), batch_size=4, num_workers=2) as loader:
        drain(loader)
        s = loader.stats()
    assert s.decoded == 8
    assert s.decode_ms_per_sample >= BUSY_S * 1e3
    assert s.decode_s >= 8 * BUSY_S


def test_decode_time_per_sample_in_process():
    with aioload.DataLoader(Timed(8, busy_s=BUSY_S), batch_size=4, num_workers=0) as loader:
        drain(loader)
        s = loader.stats()
    assert (s.batches, s.samples, s.decoded) == (2, 8, 8)
    assert s.decode_ms_per_sample >= BUSY_S * 1e3


def test_skipped_indices_are_recorded():
    with aioload.DataLoader(Timed(12, bad={3, 7}), batch_size=4, num_workers=2, on_error="skip") as loader:
        assert sorted(drain(loader)) == [i for i in range(12) if i not in (3, 7)]
        s = loader.stats()
    assert sorted(s.skipped) == [3, 7]
    assert (s.batches, s.samples, s.reads) == (3, 10, 12)
    assert s.bytes_read == 10 * PAYLOAD
    assert "skipped" in str(s) and "3" in str(s)


def test_shared_memory_and_queue_occupancy():
    with aioload.DataLoader(Timed(16), batch_size=4, num_workers=2, queue_depth=3) as loader:
        drain(loader)  # the first epoch learns the batch layout; slots are used from then on
        it = iter(loader)
        next(it)
        deadline = time.monotonic() + 30
        while loader.stats().queue_occupancy < 3:  # the three other batches become ready
            assert time.monotonic() < deadline, loader.stats()
            time.sleep(0.01)
        s = loader.stats()
        assert s.shm_bytes > 0 and s.queue_depth == 3
        assert len(list(it)) == 3
        assert loader.stats().queue_occupancy == 0 and loader.stats().batches == 8


def test_async_iteration_is_counted_too():
    async def main():
        steps = []
        with aioload.DataLoader(Timed(12, read_s=READ_S), batch_size=4, num_workers=1) as loader:
            async for _ in loader:
                started = time.monotonic()
                await asyncio.sleep(0.05)  # the training step
                steps.append(time.monotonic() - started)
            return loader.stats(), steps

    s, steps = asyncio.run(main())
    assert (s.batches, s.samples, s.epochs, s.reads, s.decoded) == (3, 12, 1, 12, 12)
    assert s.elapsed_s >= sum(steps[:-1])  # the steps after the first batch are inside the clock
    assert s.verdict.startswith("not data-bound")


# -- what "waiting" means ---------------------------------------------------------------------
def test_recorder_splits_first_batch_wait_and_steady_state():
    rec = StatsRecorder()
    rec.begin_epoch()
    rec.delivered(4, waited=0.5)  # the first batch: counted as start-up, not as waiting
    rec.delivered(4, waited=0.25)
    rec.delivered(4, waited=0.0)
    rec.end_epoch(waited=0.125)
    s = rec.snapshot()
    assert (s.batches, s.samples, s.epochs) == (3, 12, 1)
    assert s.wait_s == pytest.approx(0.375)
    assert s.first_batch_s <= s.elapsed_s


def test_since_gives_the_interval():
    a = LoaderStats(batches=2, samples=8, epochs=1, elapsed_s=1.0, wait_s=0.5, reads=8, read_s=0.4,
                    skipped=(1,), num_workers=2)
    b = LoaderStats(batches=6, samples=24, epochs=1, elapsed_s=3.0, wait_s=0.5, reads=24, read_s=1.2,
                    skipped=(1, 5), num_workers=2)
    d = b.since(a)
    assert (d.batches, d.samples, d.reads, d.skipped) == (4, 16, 16, (5,))
    assert d.elapsed_s == pytest.approx(2.0)
    assert d.samples_per_s == pytest.approx(8.0)
    assert d.wait_fraction == 0.0
    assert d.mean_reads_in_flight == pytest.approx(0.4)


# -- the verdict ---------------------------------------------------------------------------------
# On figures given here; tests/test_verdict.py runs real loads of each kind and checks the category.
def test_verdict_decode_bound_oversubscribed_and_in_process():
    # figures without CPU counters (cpu_window_s=0): no claim about idle CPUs or who held them;
    # tests/test_verdict.py covers the verdict with measured counters
    figures = dict(batches=10, samples=40, elapsed_s=2.0, first_batch_s=0.2, wait_s=0.9, reads=40, decoded=40,
                   decode_s=3.8, num_workers=2, io_concurrency=64, first_batch_samples=4)
    s = LoaderStats(**figures, decode_cpu_s=3.7)
    assert s.verdict_category == "decode-bound"
    assert s.verdict == ("data-bound 50% of the time: decode is saturated (2 workers 95% busy, on a CPU 97%), "
                         "raise num_workers if the machine has idle CPUs")
    s = LoaderStats(**figures, decode_cpu_s=0.38)  # decode was runnable, but mostly not running
    assert s.verdict_category == "unexplained"
    assert s.verdict.startswith("data-bound 50% of the time: decode was on a CPU 10% of the time it ran; whether")
    s = LoaderStats(batches=10, samples=40, elapsed_s=2.0, first_batch_s=0.2, wait_s=0.9, num_workers=0)
    assert s.verdict_category == "in-process" and "num_workers=0" in s.verdict
    assert LoaderStats().verdict == "no batches delivered yet"


def test_format_stats_has_every_figure():
    s = LoaderStats(batches=3, samples=12, epochs=1, elapsed_s=1.0, first_batch_s=0.1, reads=12,
                    bytes_read=1200, read_s=0.2, read_p50_ms=15.0, read_p99_ms=30.0, decoded=12,
                    decode_s=0.012, decode_cpu_s=0.006, queue_occupancy=2, io_concurrency=64, queue_depth=4,
                    num_workers=2, skipped=(5,), worker_restarts=1, shm_bytes=4096)
    text = format_stats(s)
    for needle in ("12.0 samples/s", "p50 15.00 ms", "p99 30.00 ms", "1.000 ms/sample", "on a CPU 50%",
                   "2 batches ready", "indices 5", "worker restarts  1", "4.1 KB", "1.2 KB", s.verdict):
        assert needle in text
    assert str(s) == text


# -- log_every and progress ----------------------------------------------------------------------
def test_log_every_emits_a_record(caplog):
    with caplog.at_level(logging.INFO, logger="aioload"):
        with aioload.DataLoader(Timed(16, read_s=READ_S), batch_size=4, num_workers=1, io_concurrency=1,
                                log_every=0.01) as loader:
            drain(loader)
    records = [r for r in caplog.records if r.name == "aioload" and "samples/s" in r.getMessage()]
    # 20 ms reads, one at a time, and a consumer that only waits: each line after the first
    # batch says data-bound (and none says "not data-bound")
    judged = [r.getMessage() for r in records if "only the first batch" not in r.getMessage()]
    assert judged
    assert all(re.search(r"(?<!not )\bdata-bound\b", m) for m in judged), judged


def test_progress_bar(capsys):
    with aioload.DataLoader(Timed(12), batch_size=4, num_workers=1, progress=True) as loader:
        drain(loader)
    err = capsys.readouterr().err
    assert "epoch 0" in err and "3/3" in err and "samples/s" in err


def test_progress_without_tqdm_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"^progress=True needs tqdm, which is not installed: pip install tqdm$"):
        aioload.DataLoader(Timed(4), batch_size=2, progress=True)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"io_concurrency": "fast"}, ValueError, r"^io_concurrency must be an int >= 1 or 'auto', got 'fast'$"),
    ({"queue_depth": "deep"}, ValueError, r"^queue_depth must be an int >= 1 or 'auto', got 'deep'$"),
    ({"log_every": 0}, ValueError, r"^log_every must be > 0 seconds or None, got 0$"),
    ({"log_every": "1s"}, TypeError, r"^log_every must be a number of seconds > 0 or None, got '1s'$"),
    ({"progress": "yes"}, TypeError, r"^progress must be True or False, got 'yes'$"),
])
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        aioload.DataLoader(Timed(4), batch_size=2, **kwargs)


# -- the resizable limiter --------------------------------------------------------------------
def test_limiter_resizes_and_survives_cancellation():
    async def main():
        lim = Limiter(1)
        await lim.acquire()
        waiter = asyncio.ensure_future(lim.acquire())
        cancelled = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        assert not waiter.done() and lim.in_use == 1
        cancelled.cancel()
        lim.set_limit(2)  # room for one more: the first waiter gets it
        await waiter
        assert lim.in_use == 2
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        lim.set_limit(1)  # shrinking never takes a permit back
        assert lim.in_use == 2 and lim.locked()
        late = asyncio.ensure_future(lim.acquire())
        lim.release()
        await asyncio.sleep(0)
        assert not late.done()  # 1 in use, limit 1
        lim.release()
        await late
        assert lim.in_use == 1
        with pytest.raises(ValueError, match="^limit must be >= 1, got 0$"):
            lim.set_limit(0)

    asyncio.run(main())


# -- the tuner, fed synthetic measurements --------------------------------------------------------
def controller(batch_size: int = 32, **kw) -> Controller:
    """A controller for two workers whose batches are split across them (one batch each in
    flight) and whose reads run on the engine's loop (enough batches to keep them busy)."""
    return Controller(batch_size=batch_size, num_workers=2,
                      in_flight=BatchBound(2, 2, batch_size, whole=False, reads=True).batches, **kw)


def pipeline(c: Controller, latency: float, decode_rate: float, demand: float = float("inf"),
             storage_rate: float | None = None) -> Window:
    """One second of a model pipeline: reads limited by ``c.io / latency`` (and the storage's
    own rate), decode by ``decode_rate``, the consumer by ``demand`` samples/s."""
    read_cap = c.io / latency if latency else float("inf")
    if storage_rate is not None:
        read_cap = min(read_cap, storage_rate)
    rate = min(read_cap, decode_rate, demand)
    observed_latency = latency if storage_rate is None else max(latency, c.io / storage_rate)
    wait = 0.9 if demand == float("inf") else max(0.0, 1 - rate / demand)
    return Window(seconds=1.0, batches=max(1, round(rate / c.batch_size)), wait_fraction=wait, reads=round(rate),
                  read_s=rate * observed_latency, bytes_read=round(rate) * 1000,
                  decode_busy=min(1.0, rate / decode_rate), slot_bytes=c.batch_size * 1000)


def run_controller(c: Controller, windows: int = 60, **model) -> list[tuple[int, int]]:
    history = []
    for _ in range(windows):
        c.update(pipeline(c, **model))
        history.append((c.io, c.depth))
    return history


@pytest.mark.parametrize(("latency", "decode_rate", "demand"), [
    (0.05, 2000, float("inf")),   # remote storage, decode-bound: needs 100 reads in flight
    (0.05, 2000, 1500),           # remote storage, the consumer sets the pace
    (0.005, 4000, float("inf")),  # short latency: the starting point (64) already suffices
    (0.0, 500, float("inf")),     # local: nothing to tune
])
def test_controller_converges_and_settles(latency, decode_rate, demand):
    c = controller()
    history = run_controller(c, latency=latency, decode_rate=decode_rate, demand=demand)
    needed = min(decode_rate, demand) * latency
    assert c.io >= needed  # reads are no longer the bottleneck
    assert c.io <= max(64, 4 * needed)  # and no more than a couple of doublings beyond
    assert len(set(history[-20:])) == 1  # no oscillation
    assert c.settled
    assert c.depth == 2  # bursts are not modelled: more depth never helps here


def test_controller_stops_where_storage_saturates():
    c = controller()
    history = run_controller(c, latency=0.05, decode_rate=1e6, storage_rate=3000)
    assert c.io == 256  # 128 serves 2560/s, 256 reaches 3000/s, 512 gains nothing and was undone
    assert len(set(history[-20:])) == 1 and c.settled


def test_controller_grows_depth_only_while_it_helps():
    c = controller(io=64)
    for _ in range(40):
        rate = min(1200.0, 300.0 * c.depth)  # each extra batch in flight helps, up to 1200/s
        c.update(Window(seconds=1.0, batches=round(rate / 32), wait_fraction=1 - rate / 1500, reads=round(rate),
                        read_s=rate * 0.01, bytes_read=0, decode_busy=rate / 1500))
    assert c.io == 64  # fixed knobs stay fixed
    assert c.depth == 4 and c.settled


def test_controller_judges_by_decoded_items_when_nothing_is_read():
    c = controller(io=64)  # an IterableDataset: no reads at all
    history = []
    for _ in range(30):
        c.update(Window(seconds=1.0, batches=20, wait_fraction=0.5, reads=0, read_s=0.0, bytes_read=0,
                        decode_busy=0.5, decoded=20))  # more depth never helps
        history.append(c.depth)
    assert history[0] == 3 and history[1] == 2  # tried once, undone
    assert c.depth == 2 and set(history[2:]) == {2} and c.settled


def test_controller_respects_the_memory_budget():
    # raw reads of 1 MB each: 32 MB per batch in flight; a 200 MB budget holds 6 batches.
    c = controller(memory_budget=200 * 10**6)
    for _ in range(40):
        w = pipeline(c, latency=0.05, decode_rate=5000)
        c.update(dataclasses.replace(w, bytes_read=w.reads * 10**6))
        assert c.memory() <= 200 * 10**6
    assert c.settled and c.io == 128  # 250 in flight would be needed without the budget


def test_the_tuner_hands_each_change_to_the_engine(monkeypatch):
    """The tuner samples the counters and gives the controller's numbers, when they change, to
    the engine's ``apply(io, permits)``; it knows nothing else of the engine."""
    monkeypatch.setattr(tune, "TICK_S", 0.001)
    monkeypatch.setattr(tune, "MIN_WINDOW_S", 0.0)
    c = controller(batch_size=8)
    stats = StatsRecorder()
    applied: list = []

    async def main():
        running = asyncio.create_task(Tuner(c).run(stats, lambda io, permits: applied.append((io, permits)),
                                                   lambda: 1000))
        try:
            async with asyncio.timeout(30):  # a hang guard: nothing here waits on time
                while not applied:
                    # a window in which the consumer waited and 64 reads were always in flight
                    stats.batches += 10
                    stats.wait_s += 1.0
                    stats.reads += 80
                    stats.read_s += 64.0
                    await asyncio.sleep(0.001)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
    assert applied[0] == (128, 128 // 8 + 2)  # io doubled; the batches to keep it busy, plus depth
    assert c.io == 128


def test_auto_grows_io_concurrency_on_slow_reads_on_the_loaders_loop():
    """End to end: 100 ms reads on the engine's loop, trivial decode, a consumer that only
    waits: auto must raise io_concurrency above its start, and every sample still arrives
    exactly once per epoch."""
    n = 1024  # 64 reads in flight serve 640 samples/s: an epoch lasts long enough to measure
    with aioload.DataLoader(Timed(n, read_s=0.1), batch_size=8, num_workers=1, io_concurrency="auto",
                            queue_depth="auto", read_in_workers=False) as loader:
        assert loader.io_concurrency == "auto"
        start = loader.stats().io_concurrency
        assert start == 64
        for _ in range(20):  # a bound on epochs, not on time
            assert sorted(drain(loader)) == list(range(n))
            if loader.stats().io_concurrency > start:
                break
        assert loader.stats().io_concurrency > start, f"io_concurrency stayed at {start}: {loader.stats()}"
        assert "auto" in repr(loader)


def test_auto_grows_each_workers_reads_while_its_decoding_waits_at_the_limit():
    """Reads in the workers (the default): 100 ms reads, batches of 128, a worker that starts
    with 64 reads in flight (its share of io_concurrency="auto") reads each batch in two
    rounds while its decoding waits, with reads queued behind the limit: the limit doubles
    (and again while the next task's reads queue too), and the statistics say so. With a fixed io_concurrency it stays where it was put."""
    n = 512
    with aioload.DataLoader(Timed(n, read_s=0.1), batch_size=128, num_workers=1, io_concurrency="auto") as loader:
        assert loader.stats().io_concurrency == 64
        assert sorted(drain(loader)) == list(range(n))
        s = loader.stats()
        # doubled at least once, and never beyond what the worker can read at once: the samples
        # of the two tasks it holds
        assert 128 <= s.io_concurrency <= 2 * 128 and s.io_auto and s.io_ceiling == 1024
        assert s.read_wait_s > 0 and s.read_limited_s > 0
    with aioload.DataLoader(Timed(n, read_s=0.1), batch_size=128, num_workers=1, io_concurrency=64) as loader:
        assert sorted(drain(loader)) == list(range(n))
        s = loader.stats()
        assert s.io_concurrency == 64 and not s.io_auto and s.io_ceiling == 64
        assert s.read_limited_s > 0.5 * s.read_wait_s > 0  # the limit held the reads back
