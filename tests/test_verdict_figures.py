"""The verdict agrees with the figures printed beside it: start-up is not idle decode (a short
run reads as each of its epochs does), an idle figure is said as it is printed, and a local
folder (whose workers open their files) gets no row of zero reads."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

import aioload
from aioload._observe.stats import STATS, LoaderStats

pytestmark = pytest.mark.unit


def total(*epochs: LoaderStats) -> LoaderStats:
    """The snapshot of a loader that ran these epochs one after the other (counters added up)."""
    counters = {f.name: sum(getattr(e, f.name) for e in epochs) for f in fields(LoaderStats)
                if STATS[f.name].kind == "counter" and isinstance(getattr(epochs[0], f.name), (int, float))}
    return LoaderStats(**{**counters, "num_workers": epochs[0].num_workers, "io_concurrency": 64})


def epoch(first_batch_s: float) -> LoaderStats:
    # 2 workers decoding 10 ms samples from their first batch (16 samples, 0.16 s) to the end:
    # busy the whole time they could decode; the start-up before is what the epochs differ in
    steady, decode_s = 1.0, 2 * (1.0 + 0.16)
    return LoaderStats(batches=15, samples=240, epochs=1, elapsed_s=first_batch_s + steady, first_batch_s=first_batch_s,
                       first_batch_samples=16, wait_s=0.9, decoded=232, decode_s=decode_s, decode_cpu_s=decode_s,
                       num_workers=2, io_concurrency=64)


def test_start_up_is_not_idle_decode():
    first, second = epoch(first_batch_s=0.8), epoch(first_batch_s=0.2)  # workers started, then kept
    both = total(first, second)
    assert [s.verdict_category for s in (first, second, both)] == ["decode-bound"] * 3, both.verdict
    assert [f"{s.decode_busy:.0%}" for s in (first, second, both)] == ["100%"] * 3
    # where the workers idled after their first batch, it shows
    idle = LoaderStats(**{**{f.name: getattr(second, f.name) for f in fields(LoaderStats) if f.init},
                          "decode_s": 1.16, "decode_cpu_s": 1.16})
    assert idle.decode_busy < 0.6 and idle.verdict_category == "unexplained"


CPU = dict(batches=100, samples=400, epochs=1, elapsed_s=10.0, first_batch_s=0.5, wait_s=5.0, reads=400,
           decoded=400, decode_s=19.0, decode_cpu_s=18.0, num_workers=2, io_concurrency=64, cpus=2, cpu_window_s=10.0,
           cpu_wait_measured=True, worker_cpu_s=18.0, program_cpu_s=19.0)


@pytest.mark.parametrize(("busy", "said"), [
    (17.9, "and 0.21 CPUs were idle, too few for another worker: more workers would not help"),
    (20.0, "and no CPU was idle, too few for another worker: more workers would not help"),
    (12.0, "and 0.80 CPUs were idle: raise num_workers"),
])
def test_the_idle_cpus_are_said_as_printed(busy, said):
    s = LoaderStats(**CPU, machine_busy_s=busy)
    assert s.verdict_category == "decode-bound"
    printed = re.search(r"idle (\d\.\d\d)", s.cpu_evidence).group(1)
    assert said in s.verdict and (printed in said or "no CPU" in said and printed == "0.00"), (s.verdict, printed)


def test_one_worker_is_not_workers():
    s = LoaderStats(**{**CPU, "num_workers": 1, "decode_s": 9.5}, machine_busy_s=20.0)
    assert "its 1 worker used" in s.cpu_evidence and "(1 worker 100% busy" in s.verdict
    assert "1 workers" not in str(s)


def test_a_local_folder_has_no_row_of_zero_reads(image_root):
    from torchvision.transforms import v2

    dataset = aioload.ImageFolder(image_root, v2.RandomResizedCrop(32, antialias=True))
    with aioload.DataLoader(dataset, batch_size=8, num_workers=1) as loader:
        for _ in loader:
            pass
        s = loader.stats()
    assert s.reads == 0
    row = next(line for line in str(s).splitlines() if line.startswith("reads "))
    assert row == "reads            none: each sample was loaded by the worker that decoded it (a local file it opened itself, or __getitem__)"
