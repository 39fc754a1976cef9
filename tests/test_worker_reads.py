"""Reads in the worker processes (``read_in_workers``): where ``read`` runs, errors, timeouts,
the bound on reads in flight, reads overlapping decode, statistics, and clean shutdown."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from torchvision.transforms.v2 import CenterCrop

import aioload
from aioload._base.errors import DataLoaderTimeoutError
from tests.conftest import child_pids
from tests.httpserver import Server

MAIN = os.getpid()


class WhereRead(aioload.Dataset):
    """Sample i is (i, the pid that ran read(i), the pid that ran decode)."""

    def __init__(self, n: int = 24, fail_at=(), delay: float = 0.0, hang_at=()):
        self.n, self.fail_at, self.delay, self.hang_at = n, set(fail_at), delay, set(hang_at)

    def __len__(self) -> int:
        return self.n

    def describe(self, index: int) -> str:
        return f"mem://item/{index}"

    async def read(self, index):
        if index in self.fail_at:
            raise OSError(f"cannot read item {index}")
        if index in self.hang_at:
            await asyncio.sleep(60)
        if self.delay:
            await asyncio.sleep(self.delay)
        return index, os.getpid()

    def decode(self, raw):
        index, pid = raw
        return index, pid, os.getpid()


def _collect(loader) -> tuple[list, set, set]:
    indices, read_pids, decode_pids = [], set(), set()
    for index, read_pid, decode_pid in loader:
        indices += index.tolist()
        read_pids |= set(read_pid.tolist())
        decode_pids |= set(decode_pid.tolist())
    return indices, read_pids, decode_pids


def test_reads_run_in_the_workers_by_default():
    with aioload.DataLoader(WhereRead(), batch_size=4, num_workers=2) as loader:
        indices, read_pids, decode_pids = _collect(loader)
        stats = loader.stats()
    assert indices == list(range(24))
    assert MAIN not in read_pids
    assert read_pids == decode_pids  # each worker reads what it decodes
    assert len(read_pids) == 2
    assert stats.reads == 24  # counted as reads, though none ran in this process


def test_read_in_workers_false_reads_on_the_loaders_loop():
    with aioload.DataLoader(WhereRead(), batch_size=4, num_workers=2, read_in_workers=False) as loader:
        indices, read_pids, decode_pids = _collect(loader)
    assert indices == list(range(24))
    assert read_pids == {MAIN}
    assert MAIN not in decode_pids


class SharedCacheReads(WhereRead):
    def __init__(self):
        super().__init__()
        self.storage = aioload.Storage(cache=aioload.MemoryCache(1 << 20))


def test_a_dataset_with_an_in_memory_cache_reads_in_the_main_process():
    ds = SharedCacheReads()
    assert ds.read_in_workers is False
    with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
        _, read_pids, _ = _collect(loader)
    assert read_pids == {MAIN}


def test_read_in_workers_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match=r"^read_in_workers must be True, False or None, got 'yes'$"):
        aioload.DataLoader(WhereRead(), num_workers=2, read_in_workers="yes")


def test_a_failed_read_in_a_worker_names_the_sample_and_keeps_its_type():
    loader = aioload.DataLoader(WhereRead(fail_at={6}), batch_size=4, num_workers=2)
    with loader, pytest.raises(OSError, match="cannot read item 6") as info:
        _collect(loader)
    where, traceback = info.value.__notes__  # one note says where, once; the worker's traceback follows
    assert where == "while reading dataset index 6 (mem://item/6) in an aioload worker"
    assert traceback.startswith("Original traceback:") and "while reading" not in traceback


def test_failed_reads_in_workers_are_skipped_with_on_error_skip():
    with aioload.DataLoader(WhereRead(fail_at={3, 17}), batch_size=4, num_workers=2, on_error="skip") as loader:
        indices, _, _ = _collect(loader)
        skipped = loader.stats().skipped
    assert indices == [i for i in range(24) if i not in (3, 17)]
    assert sorted(skipped) == [3, 17]


def test_read_timeout_applies_to_reads_in_workers():
    loader = aioload.DataLoader(WhereRead(hang_at={5}), batch_size=4, num_workers=2, read_timeout=0.5)
    with loader, pytest.raises(DataLoaderTimeoutError, match=r"dataset.read\(5\) did not return within read_timeout=0.5"):
        _collect(loader)
    assert child_pids() == []


class CountsInFlight(aioload.Dataset):
    """decode returns the most reads this worker process ever had in flight at once."""

    in_flight = 0
    peak = 0

    def __len__(self) -> int:
        return 64

    async def read(self, index):
        cls = type(self)
        cls.in_flight += 1
        cls.peak = max(cls.peak, cls.in_flight)
        try:
            await asyncio.sleep(0.02)
        finally:
            cls.in_flight -= 1
        return index

    def decode(self, raw):
        return type(self).peak


def test_io_concurrency_is_split_across_the_workers():
    with aioload.DataLoader(CountsInFlight(), batch_size=16, num_workers=2, io_concurrency=6) as loader:
        peaks = torch.cat([batch for batch in loader]).tolist()
    assert max(peaks) == 3  # 6 reads in flight in all: 3 per worker, and they do run at once


class SeesReadsAhead(aioload.Dataset):
    """decode returns how many reads this worker process had started so far; the first
    batch's reads are slow, so the next batch's task has arrived before they finish."""

    started = 0

    def __len__(self) -> int:
        return 32

    async def read(self, index):
        type(self).started += 1
        if index < 8:
            await asyncio.sleep(0.3)
        return index

    def decode(self, raw):
        return type(self).started


def test_a_workers_next_task_is_read_while_it_decodes_the_one_before():
    # One worker, batches of 8: while batch 0's reads wait, batch 1's task arrives; its reads
    # must have started before batch 0 is decoded. (Sample 0 goes first, alone: the probe
    # that teaches the loader the batch layout.)
    with aioload.DataLoader(SeesReadsAhead(), batch_size=8, num_workers=1) as loader:
        first = next(iter(loader)).tolist()
    assert first[0] == 1
    assert min(first[1:]) > 8


def test_reads_in_workers_over_http_leave_no_open_session(image_root, capfd):
    names = sorted(str(p.relative_to(image_root)) for p in image_root.rglob("*.jpg"))[:16]
    with Server(image_root) as srv:
        ds = aioload.ImageFiles([srv.url(n) for n in names], labels=list(range(16)), transform=CenterCrop(16))
        with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
            labels = [y for _, y in loader]
            stats = loader.stats()
        deadline = time.monotonic() + 30
        while child_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert torch.cat(labels).tolist() == list(range(16))
    assert stats.reads == 16 and stats.bytes_read > 0
    assert child_pids() == []
    err = capfd.readouterr().err
    assert "unclosed" not in err.lower() and "Traceback" not in err


class SlowNine(aioload.Dataset):
    """Sample i is (i, the pid that decoded it). read(9) takes 8 s; it says in ``marks`` when it
    starts and whether it was cancelled."""

    def __init__(self, marks: str, n: int = 24):
        self.marks, self.n = marks, n

    def __len__(self) -> int:
        return self.n

    async def read(self, index):
        if index == 9:
            with open(os.path.join(self.marks, "started"), "w"):
                pass
            try:
                await asyncio.sleep(8)
            except asyncio.CancelledError:
                with open(os.path.join(self.marks, "cancelled"), "w"):
                    pass
                raise
        return index

    def decode(self, raw):
        return raw, os.getpid()


def test_break_does_not_wait_for_the_reads_in_the_workers_and_keeps_persistent_workers(tmp_path):
    from aioload._engine.engine import DRAIN_TIMEOUT

    with aioload.DataLoader(SlowNine(str(tmp_path)), batch_size=4, num_workers=2, persistent_workers=True) as loader:
        for index, pid in loader:
            first_pids = set(pid.tolist())
            deadline = time.monotonic() + 60  # a hang guard: the read of sample 9 starts soon
            while not (tmp_path / "started").exists():
                assert time.monotonic() < deadline, "read(9) never started"
                time.sleep(0.01)
            started = time.monotonic()
            break
        stopped = time.monotonic() - started  # the epoch was stopped when its iterator went
        assert (tmp_path / "cancelled").exists()  # the worker cancelled the read in flight
        assert stopped < DRAIN_TIMEOUT, f"break waited {stopped:.1f} s for the read in flight"
        pids = {pid for _, pids in loader for pid in pids.tolist()}
        assert len(pids) == 2 and first_pids <= pids  # the same workers serve the next epoch
        assert loader.stats().worker_restarts == 0
