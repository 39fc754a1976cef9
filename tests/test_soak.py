"""Soak: many epochs over one loader, with and without faults, must not accumulate anything.

Each test runs 25+ epochs (or cycles) and records, after every one, what the process holds:
memory (VmRSS of the loader's process and of each worker), child processes, zombies,
threads, file descriptors, slot memory and /dev/shm. A leak is growth that keeps going, so
the tests compare the second half of the run with the first, with generous margins for RSS
(allocators and caches settle at their own pace) and small ones for counted resources.
"""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

import aioload
from tests.faulty import FaultyDataset, parse, write_samples
from tests.resources import (
    Snapshot, aioload_threads, assert_released, children, fd_count, memfd_fds, memfd_maps, private_kb,
    shm_entries, status_kb, wait_until, zombies,
)

# every /dev/shm entry is compared after each epoch: no other test runs meanwhile
pytestmark = [pytest.mark.timeout(110), pytest.mark.slow, pytest.mark.serial]

PARENT_RSS_MARGIN_KB = 24 * 1024
WORKER_RSS_MARGIN_KB = 12 * 1024


class Images(FaultyDataset):
    """Samples with a 12 KB image-like tensor beside the index (slot columns of real size)."""

    def decode(self, raw):
        index, data = raw
        return parse(data, index)[0], torch.full((3, 64, 64), index % 251, dtype=torch.uint8)


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    """One loader before any snapshot: lazily opened, process-wide handles (multiprocessing's
    shared heap, the event loop's) are then part of every baseline."""
    root = tmp_path_factory.mktemp("warm")
    write_samples(root, 8)
    with aioload.DataLoader(FaultyDataset(root, 8), batch_size=4, num_workers=1) as loader:
        list(loader)


def workers() -> list[int]:
    return sorted(p.pid for p in multiprocessing.active_children() if p.name.startswith("aioload-worker"))


def record(rows: list) -> None:
    pids = workers()
    rows.append({
        "rss": status_kb("self", "VmRSS"),
        "workers": pids,
        "worker_rss": [status_kb(pid, "VmRSS") for pid in pids],
        "fds": fd_count(),
        "slot_fds": memfd_fds(),
        "slot_maps": memfd_maps(),
        "children": len(children()),
        "zombies": len(zombies()),
        "shm": shm_entries(),
    })


def assert_no_growth(rows: list, key: str, margin: int) -> None:
    """The second half of the run never exceeds the first half's peak by more than ``margin``."""
    half = len(rows) // 2
    first = max(r[key] for r in rows[1:half])  # epoch 0 warms caches up
    second = max(r[key] for r in rows[half:])
    assert second <= first + margin, f"{key} keeps growing: {[r[key] for r in rows]}"


def assert_floor_flat(rows: list, key: str, margin: int) -> None:
    """A counted resource that a leak would raise every cycle: the second half's lowest count
    stays within ``margin`` of the first half's lowest. Transient handles (a replaced pool's
    sockets closing, a pipe of a process being reaped) raise single readings and are not a
    leak; one handle lost per cycle raises the floor by half the cycle count."""
    half = len(rows) // 2
    first = min(r[key] for r in rows[1:half])
    second = min(r[key] for r in rows[half:])
    assert second <= first + margin, f"{key} keeps growing: {[r[key] for r in rows]}"


def test_many_epochs_keep_memory_processes_threads_and_fds_flat(tmp_path):
    epochs, n = 30, 256
    write_samples(tmp_path, n)
    before = Snapshot.take()
    rows = []
    with aioload.DataLoader(Images(tmp_path, n), batch_size=16, shuffle=True, num_workers=2, seed=0,
                            timeout=30) as loader:
        for epoch in range(epochs):
            seen = sorted(i for ids, images in loader for i in ids.tolist())
            assert seen == list(range(n)), f"epoch {epoch}"
            wait_until(lambda: not aioload_threads(), 5, "the engine thread to end with its epoch")
            record(rows)
    assert len(rows[0]["workers"]) == 2
    assert all(r["workers"] == rows[0]["workers"] for r in rows), "workers are kept across complete epochs"
    assert all(r["children"] == 2 and r["zombies"] == 0 for r in rows)
    assert all(r["shm"] == before.shm for r in rows)
    assert_no_growth(rows, "rss", PARENT_RSS_MARGIN_KB)
    for w in range(2):
        for r in rows:
            r[f"worker{w}"] = r["worker_rss"][w]
        assert_no_growth(rows, f"worker{w}", WORKER_RSS_MARGIN_KB)
    # the slot pool may add a slot while it finds its size (one fd for the segment, one for
    # its mapping), but never grows with the epoch count
    assert_no_growth(rows, "fds", 2)
    assert_no_growth(rows, "slot_fds", 2)
    assert_no_growth(rows, "slot_maps", 1)
    assert_released(before)


@pytest.mark.parametrize("persistent, cycles", [(True, 25), (False, 12)])
def test_abandoned_epochs_do_not_accumulate(tmp_path, persistent, cycles):
    """``break`` after a few batches, again and again; without ``persistent_workers`` each
    cycle also stops the workers and the next one starts fresh ones."""
    n = 256
    write_samples(tmp_path, n)
    before = Snapshot.take()
    rows = []
    with aioload.DataLoader(Images(tmp_path, n), batch_size=16, num_workers=2, persistent_workers=persistent,
                            timeout=30) as loader:
        for _ in range(cycles):
            for step, batch in enumerate(loader):
                if step == 2:
                    break
            del batch
            wait_until(lambda: not aioload_threads(), 5, "the engine thread to stop after break")
            record(rows)
    assert all(r["children"] <= 2 and r["zombies"] == 0 for r in rows)
    assert all(r["shm"] == before.shm for r in rows)
    assert_no_growth(rows, "rss", PARENT_RSS_MARGIN_KB)
    assert_no_growth(rows, "fds", 2)
    assert_no_growth(rows, "slot_fds", 2)
    assert_released(before)


def test_crash_and_skip_cycles_do_not_accumulate(tmp_path):
    """Each cycle: an epoch whose worker is killed, then an epoch that skips failing samples;
    every crash costs one fresh pool and nothing else."""
    cycles, n = 12, 64
    faults = {5: "kill", 20: "corrupt", 41: "missing"}
    write_samples(tmp_path / "data", n, faults)
    flag = tmp_path / "fire-once"
    before = Snapshot.take()
    rows = []
    ds = FaultyDataset(tmp_path / "data", n, faults, once=str(flag))
    with aioload.DataLoader(ds, batch_size=8, num_workers=2, on_error="skip", timeout=30) as loader:
        for cycle in range(cycles):
            flag.touch()
            with pytest.raises(aioload.WorkerCrashedError):
                list(loader)
            seen = sorted(i for batch in loader for i in batch[:, 0].tolist())
            assert seen == [i for i in range(n) if i not in (20, 41)]
            assert loader.stats().worker_restarts == cycle + 1
            wait_until(lambda: not aioload_threads(), 5, "the engine thread to end")
            gc.collect()  # the lost pool's objects, and the handles they hold, are garbage now
            record(rows)
    assert all(r["children"] == 2 and r["zombies"] == 0 for r in rows)
    assert all(r["shm"] == before.shm for r in rows)
    assert_no_growth(rows, "rss", PARENT_RSS_MARGIN_KB)
    # Each cycle replaces a crashed pool, whose sockets and pipes close as the pool object is
    # collected and its processes reaped: single readings jitter by a few, so the floor counts.
    assert_floor_flat(rows, "fds", 2)
    assert_no_growth(rows, "slot_fds", 2)
    assert_released(before)


class Manifest(aioload.Dataset):
    """A dataset that keeps a large manifest in memory: each sample reads ``k`` of its
    entries (a shard, a group of records), so one epoch touches every entry."""

    def __init__(self, paths, k: int):
        self.paths, self.k = paths, k

    def __len__(self) -> int:
        return len(self.paths) // self.k

    async def read(self, index: int) -> int:
        return index

    def decode(self, index: int) -> torch.Tensor:
        total = sum(len(self.paths[j]) for j in range(index * self.k, (index + 1) * self.k))
        return torch.tensor([index, total])


def copied_by_workers(paths) -> list[int]:
    """How much of its parent's memory each (forked) worker copies over one epoch, in kB."""
    with aioload.DataLoader(Manifest(paths, 500), batch_size=16, num_workers=2, timeout=60,
                            multiprocessing_context="fork") as loader:
        it = iter(loader)
        next(it)
        pids = workers()
        start = [private_kb(pid) for pid in pids]
        for _ in it:
            pass
        return [private_kb(pid) - kb for pid, kb in zip(pids, start)]


def test_large_manifest_is_not_copied_into_workers():
    """The copy-on-read problem, measured: a list of 400k path strings is copied page by page
    into each worker as decode reads it; the same paths in an aioload.StringList are not."""
    paths = [f"/data/train/n{i % 1000:08d}/img_{i:09d}.JPEG" for i in range(400_000)]
    as_list = copied_by_workers(paths)
    packed = aioload.StringList(paths)
    del paths
    gc.collect()
    as_strings = copied_by_workers(packed)
    # the list's strings take about 36 MB; each worker reads half of them
    assert min(as_list) > 8 * 1024, f"the measurement should see the list being copied: {as_list} kB"
    assert max(as_strings) < 4 * 1024, f"StringList was copied into workers: {as_strings} kB"
