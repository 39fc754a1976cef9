"""How batches reach the workers: every worker gets work at once (a dataset whose workers
wait for one another must not deadlock while the loader learns the batch layout)."""

from __future__ import annotations

import asyncio
import multiprocessing
import random

import numpy as np
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



# -- which worker loads which batch, and the random numbers it draws -------------------------


class Draws(torch.utils.data.Dataset):
    """Sample ``i`` records the worker that loaded it and what each of its RNGs drew."""

    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        info = get_worker_info()
        return {"index": index, "worker": -1 if info is None else info.id, "torch": torch.rand(1),
                "random": random.random(), "numpy": float(np.random.rand())}


class SplitDraws(aioload.Dataset):
    """The same draws from the split protocol's ``decode`` (``__getitem__`` for torch)."""

    def __init__(self, n: int = 23):
        self.draws = Draws(n)

    def __len__(self) -> int:
        return len(self.draws)

    async def read(self, index):
        # reads finish out of order: a later batch's reads are often done first
        await asyncio.sleep(0.02 * (2 - index % 3))
        return index

    def decode(self, raw):
        return self.draws[raw]

    def __getitem__(self, index):
        return self.draws[index]


def _samples(loader, epochs: int = 3) -> list[list[tuple]]:
    """Per epoch, per sample: ``(index, worker id, torch draw, random draw, numpy draw)``."""
    out = []
    for _ in range(epochs):
        rows = []
        for batch in loader:
            rows += zip(batch["index"].tolist(), batch["worker"].tolist(), batch["torch"][:, 0].tolist(),
                        batch["random"].tolist(), batch["numpy"].tolist())
        out.append(rows)
    return out


def _torch_and_aioload(dataset, **kwargs) -> tuple[list, list]:
    def generator():
        return torch.Generator().manual_seed(1234)

    kwargs = dict(batch_size=4, shuffle=True, **kwargs)
    expected = _samples(torch.utils.data.DataLoader(dataset, generator=generator(), **kwargs))
    with aioload.DataLoader(dataset, generator=generator(), **kwargs) as loader:
        return expected, _samples(loader)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_without_seed_each_batch_is_loaded_by_the_worker_torch_uses(workers, persistent):
    """Batch i is loaded whole by worker i mod N, in order, so get_worker_info().id and every
    random draw of every sample equal torch's, in every epoch."""
    expected, got = _torch_and_aioload(Draws(), num_workers=workers, persistent_workers=persistent)
    assert [[s[:2] for s in epoch] for epoch in got] == [[s[:2] for s in epoch] for epoch in expected]
    assert got == expected


def test_without_seed_a_split_dataset_draws_as_torch_does():
    """The split protocol too: reads finish in any order, but each worker decodes its batches
    in the sampler's order, as torch's worker runs ``__getitem__``."""
    expected, got = _torch_and_aioload(SplitDraws(), num_workers=2)
    assert got == expected


def test_without_seed_a_collate_fn_batch_is_loaded_as_in_torch():
    expected, got = _torch_and_aioload(Draws(), num_workers=2, collate_fn=_collate_dicts)
    assert got == expected


def test_without_seed_unbatched_samples_go_round_robin():
    """``batch_size=None``: each sample is a task, sample i in worker i mod N."""
    def rows(loader):
        return [(s["index"], s["worker"], float(s["torch"][0]), s["random"], s["numpy"]) for s in loader]

    dataset = Draws(10)
    expected = rows(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                                generator=torch.Generator().manual_seed(5)))
    with aioload.DataLoader(dataset, batch_size=None, num_workers=2,
                            generator=torch.Generator().manual_seed(5)) as loader:
        assert rows(loader) == expected


def _collate_dicts(samples):
    return torch.utils.data.default_collate(samples)



class Photos(torch.utils.data.Dataset):
    """Small images with torchvision's RandomResizedCrop and flip, drawn in ``__getitem__``."""

    def __init__(self, n: int = 24):
        from torchvision.transforms import v2

        self.images = torch.randint(0, 256, (n, 3, 40, 32), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.uint8)
        self.transform = v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index):
        return self.transform(self.images[index]), index


def test_without_seed_random_augmentations_equal_torchs_from_the_first_epoch():
    """RandomResizedCrop without seed=: the same crops as torch's DataLoader in every epoch,
    the first included (where least-loaded dispatch gave batches to other workers)."""
    def epochs(loader):
        return [[batch for batch in loader] for _ in range(3)]

    kwargs = dict(batch_size=4, shuffle=True, num_workers=2)
    expected = epochs(torch.utils.data.DataLoader(Photos(), generator=torch.Generator().manual_seed(9), **kwargs))
    with aioload.DataLoader(Photos(), generator=torch.Generator().manual_seed(9), **kwargs) as loader:
        got = epochs(loader)
    for want_epoch, got_epoch in zip(expected, got):
        assert len(want_epoch) == len(got_epoch) == 6
        for (want, want_index), (have, have_index) in zip(want_epoch, got_epoch):
            assert torch.equal(have_index, want_index)
            assert torch.equal(have, want)
