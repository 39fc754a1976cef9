"""Datasets whose samples draw random numbers, for the reproducibility and resume tests
(module level, so that every start method can import them).

Sample ``i`` is ``(tensor([i, torch.rand, random.random, np.random.rand]), i)``: the first
column names the sample, the other three show whether each RNG was seeded the same way.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch

import aioload


def augmented(i) -> tuple[torch.Tensor, int]:
    drawn = [torch.rand(()).item(), random.random(), float(np.random.rand())]
    return torch.tensor([float(i), *drawn], dtype=torch.float64), i


class Augmented(aioload.Dataset):
    """The split protocol: ``read`` returns the index, ``decode`` draws from all three RNGs."""

    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        return i

    def read_blocking(self, i):
        return i

    def decode(self, raw):
        return augmented(raw)


class PlainAugmented(torch.utils.data.Dataset):
    """A plain torch dataset: ``__getitem__`` draws from all three RNGs."""

    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return augmented(i)


class BatchedAugmented(PlainAugmented):
    """A dataset with ``__getitems__`` (a batched fetch), which draws per call."""

    def __getitems__(self, indices):
        return [augmented(i) for i in indices]


class Keyed(torch.utils.data.Dataset):
    """Samples addressed by string keys (``"k0"``, ``"k1"``, ...)."""

    def __init__(self, n: int = 12):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        return augmented(int(key[1:]))


class Gated(Augmented):
    """Decoding index ``gated`` waits (up to ``deadline`` seconds) until the file ``gate``
    exists: the test decides when that sample's batch can finish."""

    def __init__(self, n: int, gate: str, gated: int = 0, deadline: float = 60.0):
        super().__init__(n)
        self.gate, self.gated, self.deadline = gate, gated, deadline

    def decode(self, raw):
        if raw == self.gated:
            end = time.monotonic() + self.deadline
            while not os.path.exists(self.gate) and time.monotonic() < end:
                time.sleep(0.005)
        return augmented(raw)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int = 10):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Shuffled(torch.utils.data.Sampler):
    """A sampler aioload cannot replay: an unseeded private RNG, a new order every epoch.
    ``history`` keeps every order it produced."""

    def __init__(self, n: int):
        self.n = n
        self.rng = random.Random()
        self.history: list[list[int]] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        self.history.append(order)
        return iter(order)


class KeySampler(torch.utils.data.Sampler):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(f"k{i}" for i in reversed(range(self.n)))
