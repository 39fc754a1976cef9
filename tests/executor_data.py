"""Datasets for the executor tests. They run in executor processes (a process pool's, a Dask
cluster's workers), which import them by module name."""

from __future__ import annotations

import os
import signal
import time

import torch

import aioload


class Augmented(aioload.Dataset):
    """A split dataset whose decode draws from torch's RNG: seeding per sample shows."""

    def __init__(self, n: int = 40, delay: float = 0.0, bad=()):
        self.n, self.delay, self.bad = n, delay, frozenset(bad)

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        return i.to_bytes(4, "little")

    def decode(self, raw):
        i = int.from_bytes(raw, "little")
        if self.delay:
            time.sleep(self.delay)
        if i in self.bad:
            raise ValueError(f"sample {i} is broken")
        return torch.full((4,), float(i)) + torch.rand(4), i


class PlainAugmented(torch.utils.data.Dataset):
    """The same through ``__getitem__`` (a plain torch dataset)."""

    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((2, 3), float(i)) + torch.rand(2, 3), "i": i, "name": f"s{i}"}


class Unpickled(Augmented):
    """Appends this process's pid to ``log`` each time the dataset is unpickled."""

    def __init__(self, n: int, log: str):
        super().__init__(n)
        self.log = log

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


class KillsItsProcess(Augmented):
    """Sample ``victim`` kills the process decoding it (SIGKILL), every time."""

    def __init__(self, n: int, victim: int):
        super().__init__(n)
        self.victim = victim

    def decode(self, raw):
        if int.from_bytes(raw, "little") == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().decode(raw)


class Pids(Augmented):
    """Each sample also says which process decoded it."""

    def decode(self, raw):
        x, i = super().decode(raw)
        return x, i, os.getpid()


def getpid() -> int:
    return os.getpid()
