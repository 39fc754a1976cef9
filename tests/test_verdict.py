"""The verdict on steady synthetic loads of each kind, its policy on chosen figures, and the
log line that carries it.

Loads are built so that their kind does not depend on the machine's speed: a read stage that
sleeps 50 ms with one read in flight, a consumer that sleeps, decode that burns CPU time with
one worker, more CPU-burning workers than CPUs, and CPU hogs started by the test. Tests assert
on ``verdict_category``, never on timings.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import aioload
from aioload._observe.stats import CATEGORIES, LoaderStats, machine_cpu, process_cpu

ROOT = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/stat")
needs_proc = pytest.mark.skipif(not LINUX, reason="the CPU counters come from /proc")


class Load(aioload.Dataset):
    """``read`` sleeps ``read_s``; ``decode`` burns ``cpu_s`` of CPU time, then sleeps ``sleep_s``."""

    def __init__(self, n: int, read_s: float = 0.0, cpu_s: float = 0.0, sleep_s: float = 0.0):
        self.n, self.read_s, self.cpu_s, self.sleep_s = n, read_s, cpu_s, sleep_s

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        if self.read_s:
            await asyncio.sleep(self.read_s)
        return i

    def decode(self, i):
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor([i])


def verdict_of(dataset, step_s: float = 0.0, **kwargs) -> LoaderStats:
    with aioload.DataLoader(dataset, **kwargs) as loader:
        seen = 0
        for batch in loader:
            seen += len(batch)
            if step_s:
                time.sleep(step_s)
        assert seen == len(dataset)
        s = loader.stats()
    assert s.verdict_category in CATEGORIES
    return s


def machine_cpus() -> int:
    figures = machine_cpu()
    return figures[1] if figures else (os.cpu_count() or 1)


# -- loads of each kind ---------------------------------------------------------------------
@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
def test_read_bound():
    s = verdict_of(Load(16, read_s=0.05), batch_size=4, num_workers=1, io_concurrency=1)
    assert s.verdict_category == "read-bound", s
    assert s.verdict.endswith("raise io_concurrency")


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
def test_consumer_bound():
    s = verdict_of(Load(32), step_s=0.1, batch_size=4, num_workers=1)
    assert s.verdict_category == "not-data-bound", s
    assert "num_workers" not in s.verdict and "io_concurrency" not in s.verdict


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
@needs_proc
def test_decode_bound():
    # One CPU-burning worker. While other programs hold the CPUs (a shared machine), the same
    # load is rightly "cpu-contention": the load is repeated, a few times at most, for a
    # moment in which they leave it a CPU. Any other category fails at once.
    contended = []
    for _ in range(5):
        s = verdict_of(Load(48, cpu_s=0.02), batch_size=4, num_workers=1)
        if s.verdict_category != "cpu-contention":
            break
        assert s.others_cpus >= 0.5
        contended.append(s.verdict)
    assert s.verdict_category == "decode-bound", (s, contended)
    assert s.cpu_window_s > 0 and s.cpus == machine_cpus()
    assert s.worker_cpu_s > 0 and s.program_cpu_s >= s.worker_cpu_s


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
@needs_proc
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # torch's own, as torch says it
def test_more_workers_than_cpus():
    workers = 2 * machine_cpus() + 1
    s = verdict_of(Load(24 * workers, cpu_s=0.02), batch_size=2, num_workers=workers)
    assert s.verdict_category == "too-many-workers", s
    assert "lower num_workers to " in s.verdict
    assert s.cpu_wait_measured and s.worker_cpu_wait_s > 0


HOG = "import os, sys\nos.write(1, b'x')\nwhile True:\n    pass\n"


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
@needs_proc
def test_competing_cpu_hogs():
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE) for _ in range(2 * machine_cpus())]
    try:
        for hog in hogs:  # each hog is in its loop once it has written its byte
            assert hog.stdout.read(1) == b"x"
        s = verdict_of(Load(48, cpu_s=0.02), batch_size=4, num_workers=1)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(30)
            hog.stdout.close()
    assert s.verdict_category == "cpu-contention", s
    assert s.others_cpus >= 0.5
    assert "raise num_workers" not in s.verdict and "lower num_workers" not in s.verdict


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
@needs_proc
def test_decode_that_sleeps_is_blocked_not_short_of_cpus():
    # sleeps long beside the few ms a wake-up may wait for a CPU on a busy machine
    s = verdict_of(Load(24, sleep_s=0.1), batch_size=4, num_workers=2)
    assert s.verdict_category == "decode-blocked", s
    assert s.verdict.endswith("move the I/O or waiting out of decode() into read()")


def test_categories_on_the_way_in():
    assert LoaderStats().verdict_category == "no-batches"
    assert LoaderStats(batches=1, samples=4, elapsed_s=0.5, first_batch_s=0.5, num_workers=1).verdict_category == "starting"


# -- the policy, on chosen figures ----------------------------------------------------------
# Ten seconds in which decode (2 workers, saturated) kept training waiting half the time.
BASE = dict(batches=100, samples=400, epochs=1, elapsed_s=10.0, first_batch_s=0.5, wait_s=5.0, reads=400,
            decoded=400, decode_s=19.0, num_workers=2, io_concurrency=64, cpus=2, cpu_window_s=10.0,
            cpu_wait_measured=True)


def test_decode_bound_advises_more_workers_only_with_idle_cpus():
    # a 4-CPU machine has two CPUs idle
    four = LoaderStats(**{**BASE, "cpus": 4}, decode_cpu_s=18.0, worker_cpu_s=18.0, program_cpu_s=19.0,
                       machine_busy_s=19.5)
    assert four.verdict_category == "decode-bound"
    assert four.idle_cpus == pytest.approx(2.05)
    assert "raise num_workers" in four.verdict
    full = LoaderStats(**BASE, decode_cpu_s=18.0, worker_cpu_s=18.0, program_cpu_s=19.0, machine_busy_s=20.0)
    assert full.verdict_category == "decode-bound"
    assert "raise num_workers" not in full.verdict and "more workers would not help" in full.verdict


def test_waiting_for_cpus_others_hold_is_contention():
    s = LoaderStats(**BASE, decode_cpu_s=8.0, worker_cpu_s=8.0, program_cpu_s=8.5, machine_busy_s=20.0,
                    worker_cpu_wait_s=10.0)
    assert s.verdict_category == "cpu-contention"
    assert s.others_cpus == pytest.approx(1.15)
    assert "num_workers would not help" in s.verdict and "other programs 1.15" in s.verdict


def test_waiting_for_cpus_this_program_holds_is_too_many_workers():
    s = LoaderStats(**{**BASE, "num_workers": 6, "decode_s": 57.0}, decode_cpu_s=19.0, worker_cpu_s=19.0, program_cpu_s=19.8,
                    machine_busy_s=20.0, worker_cpu_wait_s=30.0)
    assert s.verdict_category == "too-many-workers"
    assert s.verdict.endswith("lower num_workers to 2")
    # the training loop itself takes a CPU: two workers are one too many on two CPUs
    s = LoaderStats(**BASE, decode_cpu_s=8.0, worker_cpu_s=8.0, program_cpu_s=18.0, machine_busy_s=20.0,
                    worker_cpu_wait_s=10.0)
    assert s.verdict_category == "too-many-workers"
    assert s.verdict.endswith("lower num_workers to 1")


def test_off_cpu_without_waiting_is_blocked():
    s = LoaderStats(**BASE, decode_cpu_s=2.0, worker_cpu_s=2.0, program_cpu_s=2.5, machine_busy_s=3.0,
                    worker_cpu_wait_s=0.5)
    assert s.verdict_category == "decode-blocked"
    plain = LoaderStats(**{**BASE, "reads": 0}, decode_cpu_s=2.0, worker_cpu_s=2.0, program_cpu_s=2.5,
                        machine_busy_s=3.0, worker_cpu_wait_s=0.5)
    assert plain.verdict.endswith("give the dataset an async read() (aioload.Dataset) for its I/O")


def test_no_counters_no_advice():
    s = LoaderStats(**{**BASE, "cpu_window_s": 0.0, "cpu_wait_measured": False}, decode_cpu_s=2.0)
    assert s.verdict_category == "unexplained"
    assert "num_workers" not in s.verdict


def test_the_evidence_is_in_the_sentence_and_the_figures_are_fields():
    s = LoaderStats(**BASE, decode_cpu_s=8.0, worker_cpu_s=8.0, program_cpu_s=8.5, machine_busy_s=20.0,
                    worker_cpu_wait_s=10.0)
    assert s.cpu_evidence == ("over 10.0 s: this process and its 2 workers used 0.85 of 2 CPUs, other programs "
                              "1.15, idle 0.00, 1.00 workers waiting for a CPU on average")
    assert s.cpu_evidence in s.verdict and s.cpu_evidence in str(s)
    assert f"[{s.verdict_category}] {s.verdict}" in str(s)


def test_since_keeps_the_cpu_counters_of_the_interval():
    a = LoaderStats(**BASE, decode_cpu_s=8.0, worker_cpu_s=8.0, program_cpu_s=8.5, machine_busy_s=20.0)
    b = LoaderStats(**{**BASE, "cpu_window_s": 30.0}, decode_cpu_s=8.0, worker_cpu_s=8.0, program_cpu_s=10.5,
                    machine_busy_s=30.0)
    d = b.since(a)
    assert (d.cpu_window_s, d.machine_busy_s, d.program_cpu_s) == (20.0, 10.0, 2.0)


@needs_proc
def test_process_counters_read_this_process():
    cpu, waited = process_cpu(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    later, waited_later = process_cpu(os.getpid())
    assert later >= cpu and (waited is None or waited_later >= waited)
    assert process_cpu(2 ** 22 + 1) is None  # above Linux's largest pid: no such process


# -- samples/s: one name per definition ---------------------------------------------------------
def test_both_throughputs_are_named():
    s = LoaderStats(batches=10, samples=40, epochs=1, elapsed_s=2.0, first_batch_s=1.0, first_batch_samples=4,
                    num_workers=1)
    assert s.samples_per_s == pytest.approx(20.0) and s.steady_samples_per_s == pytest.approx(36.0)
    assert "20.0 samples/s from iter() on, start-up included; 36.0 after the first batch" in str(s)


def test_first_batch_samples_are_counted():
    with aioload.DataLoader(Load(12), batch_size=4, num_workers=1) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        s = loader.stats()
    assert (s.samples, s.first_batch_samples, s.epochs) == (24, 8, 2)


# -- log_every= without any logging configured ----------------------------------------------------
SCRIPT = textwrap.dedent("""
    import asyncio, logging, sys
    import torch
    import aioload

    class Slow(aioload.Dataset):
        def __len__(self):
            return 16
        async def read(self, i):
            await asyncio.sleep(0.02)
            return i
        def decode(self, i):
            return torch.tensor([i])

    if sys.argv[1] == "configured":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
    with aioload.DataLoader(Slow(), batch_size=2, num_workers=1, io_concurrency=1, log_every=0.01) as loader:
        for _ in loader:
            pass
    print("done")
""")


def run_script(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_log_every_prints_without_logging_configured():
    done = run_script("bare")
    lines = [line for line in done.stderr.splitlines() if "aioload: " in line and " samples/s over " in line]
    assert lines, done.stderr


def test_log_every_goes_through_configured_logging_only():
    done = run_script("configured")
    assert any(line.startswith("LOG aioload aioload: ") for line in done.stdout.splitlines()), done.stdout
    assert " samples/s over " not in done.stderr


# Ten seconds in which the workers read their samples and their decoding waited for reads a
# third of their time after the first batch (9.5 s); decode itself had CPUs to spare.
WORKER_READS = dict(batches=100, samples=6400, epochs=1, elapsed_s=10.0, first_batch_s=0.5, wait_s=8.0, reads=6400,
                    read_s=50.0, decoded=6400, decode_s=8.0, decode_cpu_s=8.0, num_workers=2, io_concurrency=64,
                    io_ceiling=64, read_wait_s=6.0)


def test_workers_waiting_for_reads_held_at_a_fixed_limit_name_the_limit():
    s = LoaderStats(**WORKER_READS, read_limited_s=5.0)
    assert s.verdict_category == "read-bound", s
    assert s.read_wait_share == pytest.approx(6.0 / (2 * 9.5))  # start-up is not a share of their time
    assert s.verdict == (
        "data-bound 84% of the time: the workers' decoding waited for its reads 32% of the time (read p50 0.0 ms, "
        "reads queued behind the reads-in-flight limit 83% of that wait): the limit is io_concurrency=64 "
        "(32 per worker): raise it, or use io_concurrency='auto'")


def test_auto_at_its_bound_says_the_bound_and_auto_below_it_says_it_is_rising():
    top = LoaderStats(**{**WORKER_READS, "io_concurrency": 1024, "io_ceiling": 1024}, io_auto=True, read_limited_s=5.0)
    assert top.verdict_category == "read-bound"
    assert top.verdict.endswith("io_concurrency='auto' has reached its bound (1024, 512 per worker): the storage "
                                "needs more reads in flight than that; set io_concurrency above it")
    rising = LoaderStats(**{**WORKER_READS, "io_ceiling": 1024}, io_auto=True, read_limited_s=5.0)
    assert rising.verdict.endswith("io_concurrency='auto' is raising the limit (64 now, 32 per worker); a longer "
                                   "run settles it")


def test_workers_waiting_for_reads_below_the_limit_is_latency_not_the_limit():
    s = LoaderStats(**WORKER_READS, read_limited_s=0.5)
    assert s.verdict_category == "read-latency-bound", s
    assert "below the reads-in-flight limit of 64, 32 per worker" in s.verdict
    assert s.verdict.endswith("raise prefetch_factor so that each worker reads further ahead")
    quiet = LoaderStats(**{**WORKER_READS, "read_wait_s": 0.5}, read_limited_s=0.5)  # 2.5 % of the time
    assert quiet.verdict_category == "unexplained"


@pytest.mark.serial  # the verdict reads the machine's CPU counters: no other test's load
def test_reads_held_at_the_workers_limit_are_read_bound_end_to_end():
    """Real workers: 50 ms reads, batches of 16 and a fixed 4 reads in flight per worker:
    the decoding waits, its reads queued behind the limit, and the verdict names it."""
    s = verdict_of(Load(64, read_s=0.05), batch_size=16, num_workers=1, io_concurrency=4)
    assert s.verdict_category == "read-bound", s
    assert "the limit is io_concurrency=4 (4 per worker)" in s.verdict or "reads are saturated" in s.verdict
