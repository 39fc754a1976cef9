"""Datasets and samplers for the Stateful protocol's tests (module level, so that every start
method can import them): streams split unevenly between workers, with and without a state."""

from __future__ import annotations

import time

import torch


def identity(batch):
    return batch


def worker_slice(sizes: list[int]) -> range:
    """This worker's items of a stream split ``sizes`` between the workers (in-process: all)."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return range(sum(sizes))
    start = sum(sizes[: info.id])
    return range(start, start + sizes[info.id])


class Uneven(torch.utils.data.IterableDataset):
    """Worker ``w`` yields ``sizes[w]`` consecutive ints; no state of its own. ``iters`` counts
    the ``__iter__`` calls of this copy (in a worker: that worker's)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.iters = 0

    def __iter__(self):
        self.iters += 1
        return iter(worker_slice(self.sizes))


class Counted(torch.utils.data.IterableDataset):
    """Like :class:`Uneven`, with a state: the position in this worker's slice and an epoch
    counter (bumped when the slice runs out), so that every epoch's items differ."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.position = 0
        self.epoch = 0
        self.loaded = 0  # load_state_dict calls on this copy

    def __iter__(self):
        items = worker_slice(self.sizes)
        while self.position < len(items):
            item = items[self.position]
            self.position += 1
            yield (item, self.epoch)
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.loaded += 1
        self.position = state["position"]
        self.epoch = state["epoch"]


class RandomWalk(torch.utils.data.IterableDataset):
    """Its own iterator, drawing from torch's global RNG in the worker: the state holds the RNG
    state as a tensor (not plain data)."""

    def __init__(self, length: int):
        self.length = length
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.length:
            raise StopIteration
        self.i += 1
        return int(torch.randint(1000, (1,)))

    def state_dict(self) -> dict:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class CountingSampler(torch.utils.data.Sampler):
    """A sampler with a state of its own: the position in ``range(n)`` (resumed through it)."""

    def __init__(self, n: int):
        self.n = n
        self.position = 0
        self.resume_at = None

    def __iter__(self):
        start, self.resume_at = (self.resume_at or 0), None
        for i in range(start, self.n):
            self.position = i + 1
            yield i
        self.position = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["position"]


class OwnIterator(torch.utils.data.IterableDataset):
    """Its own iterator, starting over in ``__iter__`` (so the loader must call it once an epoch)."""

    def __init__(self, length: int):
        self.length = length
        self.i = 0

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        if self.i >= self.length:
            raise StopIteration
        self.i += 1
        return self.i - 1


class RandomMap(torch.utils.data.Dataset):
    """A map-style dataset whose samples draw from torch's RNG (in its worker, or in process),
    Stateful through that RNG's state."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i):
        return (i, int(torch.randint(1000, (1,))))

    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])


class Epoched(torch.utils.data.IterableDataset):
    """Like :class:`Uneven`, with ``set_epoch`` (as a Hugging Face streaming dataset has): each
    item comes with the epoch its copy was last given, and ``epochs`` lists them."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.epoch = -1  # never given one
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    def __iter__(self):
        return iter([(item, self.epoch) for item in worker_slice(self.sizes)])


class SharedEpoch(torch.utils.data.IterableDataset):
    """Like :class:`Epoched`, with the epoch a Hugging Face streaming dataset keeps: a tensor in
    shared memory (the training process's dataset and every worker's copy share it) that
    ``set_epoch`` moves by adding the difference in place. The pause between the read and the
    add widens the window in which two copies setting it at once both add."""

    def __init__(self, sizes: list[int], pause: float = 0.2):
        self.sizes = sizes
        self.pause = pause
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        step = epoch - int(self._epoch)
        time.sleep(self.pause)
        self._epoch += step

    def __iter__(self):
        return iter([(item, self.epoch) for item in worker_slice(self.sizes)])


class EpochSampler(torch.utils.data.Sampler):
    """A sampler with a state of its own: how many epochs it has drawn, which seeds each
    epoch's order (torch's samplers keep nothing of the kind)."""

    def __init__(self, n: int):
        self.n = n
        self.epochs = 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epochs)).tolist()
        self.epochs += 1
        return iter(order)

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = state["epochs"]


class Noisy(torch.utils.data.Dataset):
    """No state of its own: each sample draws from the worker's torch, ``random`` and numpy
    streams, and says which worker seed it was drawn under."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        import random

        import numpy as np

        info = torch.utils.data.get_worker_info()
        return (i, int(torch.randint(1 << 30, ())), random.randrange(1 << 30), int(np.random.randint(1 << 30)),
                None if info is None else info.seed)


class NoisyStream(torch.utils.data.IterableDataset):
    """Worker ``w`` yields ``sizes[w]`` items, each with a draw from the worker's torch stream."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __iter__(self):
        for i in worker_slice(self.sizes):
            yield (i, int(torch.randint(1 << 30, ())))
