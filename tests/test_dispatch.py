"""How batches reach the workers: every worker gets work at once (a dataset whose workers
wait for one another must not deadlock while the loader learns the batch layout)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch.utils.data import get_worker_info

import aioload

HANG_GUARD = 30.0
"""Seconds a barrier waits before it breaks: a deadlock fails with BrokenBarrierError."""

FORK = multiprocessing.get_context("fork")

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class _Gate:
    """A barrier across the workers, shared at construction (inherited through fork), that
    each worker passes in its first call (per-worker set-up, as sharding code does) or in
    every call (workers in lockstep)."""

    def __init__(self, workers: int, every: bool):
        self.barrier = FORK.Barrier(workers, timeout=HANG_GUARD)
        self.every = every
        self.passed = False

    def wait(self) -> None:
        if get_worker_info() is None:
            return  # the main process: no siblings to wait for
        if self.every or not self.passed:
            self.barrier.wait()
            self.passed = True


class Waiting(torch.utils.data.Dataset):
    """A map-style dataset whose ``__getitem__`` waits for the other workers."""

    def __init__(self, n: int, workers: int, every: bool = False):
        self.n = n
        self.gate = _Gate(workers, every)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        self.gate.wait()
        return torch.full((3,), index), index


class WaitingSplit(aioload.Dataset):
    """The split protocol: ``decode`` (in the workers) waits for the other workers."""

    def __init__(self, n: int, workers: int):
        self.n = n
        self.gate = _Gate(workers, every=False)

    def __len__(self) -> int:
        return self.n

    async def read(self, index):
        return index

    def decode(self, raw):
        self.gate.wait()
        return torch.full((3,), raw), raw


class WaitingStream(torch.utils.data.IterableDataset):
    """Each worker waits for its siblings before it yields its share (every ``workers``-th)."""

    def __init__(self, n: int, workers: int):
        self.n = n
        self.gate = _Gate(workers, every=False)

    def __iter__(self):
        info = get_worker_info()
        self.gate.wait()
        for index in range(info.id, self.n, info.num_workers):
            yield torch.full((3,), index), index


def _check(batches, order) -> None:
    got = [int(i) for _, labels in batches for i in labels]
    assert got == order
    for values, labels in batches:
        assert torch.equal(values, labels[:, None].expand(-1, 3).to(values.dtype))


def _load(dataset, **kwargs) -> list:
    with aioload.DataLoader(dataset, multiprocessing_context="fork", **kwargs) as loader:
        return list(loader)


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_that_wait_for_each_other_all_get_work_at_once(workers):
    _check(_load(Waiting(48, workers), batch_size=8, num_workers=workers), list(range(48)))


def test_torch_runs_the_waiting_dataset():
    """The oracle: torch's DataLoader gives every worker work at once."""
    loader = torch.utils.data.DataLoader(Waiting(48, 2), batch_size=8, num_workers=2,
                                         multiprocessing_context="fork")
    _check(list(loader), list(range(48)))


def test_waiting_workers_with_per_sample_seeds():
    _check(_load(Waiting(48, 2), batch_size=8, num_workers=2, seed=0), list(range(48)))


def test_waiting_workers_with_a_small_batch():
    """Batches of one sample: the first batches of every worker teach the layout together."""
    _check(_load(Waiting(12, 3), batch_size=1, num_workers=3), list(range(12)))


def test_waiting_workers_with_a_collate_fn():
    def collate(samples):
        return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])

    _check(_load(Waiting(48, 2), batch_size=8, num_workers=2, collate_fn=collate), list(range(48)))


def test_waiting_decode_of_a_split_dataset():
    _check(_load(WaitingSplit(48, 2), batch_size=8, num_workers=2), list(range(48)))


def test_waiting_workers_of_an_iterable_dataset():
    batches = _load(WaitingStream(32, 2), batch_size=4, num_workers=2)
    # torch's order: batches alternate between the workers' shares
    assert [int(i) for _, labels in batches for i in labels] == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14,
                                                                  9, 11, 13, 15, 16, 18, 20, 22, 17, 19,
                                                                  21, 23, 24, 26, 28, 30, 25, 27, 29, 31]


