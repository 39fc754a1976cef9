"""Datasets for the executor tests. They run in executor processes (a process pool's, a Dask
cluster's workers), which import them by module name."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
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


class Indices(aioload.Dataset):
    """``n`` samples whose read gives the index itself; subclasses say what decode makes of it."""

    def __init__(self, n: int = 16):
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        return i


class TwoDraws(Indices):
    """decode draws from torch's, random's and numpy's generators twice, with a pause between
    that lets another thread of the same process run (and draw) meanwhile."""

    def decode(self, i):
        import random

        import numpy as np

        first = torch.rand(2)
        time.sleep(0.01)
        second = torch.rand(2)
        return torch.cat([first, second, torch.tensor([random.random(), float(np.random.rand())])]), i


class SlowRead(aioload.Dataset):
    """Reads in ``slow`` take ``seconds`` (an await: read_timeout can stop them)."""

    def __init__(self, n: int = 12, slow=(), seconds: float = 4.0):
        self.n, self.slow, self.seconds = n, frozenset(slow), seconds

    def __len__(self) -> int:
        return self.n

    def describe(self, i) -> str:
        return f"mem://slow/{i}"

    async def read(self, i):
        if i in self.slow:
            await asyncio.sleep(self.seconds)
        return i

    def decode(self, i):
        return torch.tensor([i])


class WorkerInfoSeen(Indices):
    """Each sample says what get_worker_info() told its decode: (index, id, num_workers, pid)."""

    def decode(self, i):
        info = torch.utils.data.get_worker_info()
        if info is None:
            return torch.tensor([i, -1, -1, os.getpid()])
        return torch.tensor([i, info.id, info.num_workers, os.getpid()])


class InitLog:
    """A worker_init_fn that appends "pid id num_workers seed" to ``path`` (one line per call)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {worker_id} {info.id} {info.num_workers} {info.seed}\n")


def tagged_collate(samples):
    """A collate_fn that shows it ran: the samples stacked, and a tag."""
    return torch.stack([s for s, _ in samples]), "tagged"


class Big(Augmented):
    """A dataset whose pickle is ``mib`` MiB (its payload travels to every process that decodes);
    with ``log``, each unpickling appends this process's pid to that file."""

    def __init__(self, n: int, mib: int, log: str | None = None):
        super().__init__(n)
        self.payload = os.urandom(mib << 20)
        self.log = log

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\n")


class LocalObjects(Augmented):
    """decode returns, beside the sample, an object of a class defined inside a function: plain
    pickle cannot send it back from a process."""

    def decode(self, raw):
        class Local:
            pass

        x, i = super().decode(raw)
        return x, i, Local()


def keep_objects(samples):
    """A collate_fn that keeps each sample's third item as it is (default_collate refuses objects)."""
    return torch.stack([s[0] for s in samples]), [s[2] for s in samples]


def collate_with_lock(samples):
    """A collate_fn whose batch holds a lock, which nothing can pickle."""
    return torch.stack([s for s, _ in samples]), threading.Lock()


def failing_init(worker_id: int) -> None:
    """A worker_init_fn that fails, naming its worker."""
    raise ConnectionError(f"worker_init_fn could not connect in worker {worker_id}")


def tokens_held(hold: float) -> tuple[int, list]:
    """This process's pid and the loaders whose datasets it keeps, after keeping it busy
    ``hold`` seconds (so that the next such task goes to another process)."""
    from aioload._engine import executor_process as executor

    time.sleep(hold)
    return os.getpid(), executor.known_tokens()


class BlocksInRead(aioload.Dataset):
    """``read`` calls ``time.sleep``: a blocking call inside ``async def read``. With
    ``only_first``, only the first read blocks (a one-off set-up, not a habit)."""

    def __init__(self, n: int = 30, block: float = 0.06, only_first: bool = False):
        self.n, self.block, self.only_first = n, block, only_first
        self.blocked = False

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        if not (self.only_first and self.blocked):
            self.blocked = True
            time.sleep(self.block)
        await asyncio.sleep(0)
        return i

    def decode(self, i):
        return torch.tensor([i])


class SleepsInRead(Indices):
    """``read`` is ``time.sleep(seconds)`` and a return, with no await after it: read_timeout
    cannot fire while it runs, nor once it returned."""

    def __init__(self, n: int, seconds: float):
        super().__init__(n)
        self.seconds = seconds

    async def read(self, i):
        time.sleep(self.seconds)
        return i

    def decode(self, i):
        return torch.tensor([i])


def datasets_alive(hold: float) -> tuple[int, int]:
    """This process's pid and how many :class:`Big` datasets live in it, after keeping it busy
    ``hold`` seconds (so that the next such task goes to another process)."""
    import gc

    time.sleep(hold)
    gc.collect()
    return os.getpid(), sum(type(thing) is Big for thing in gc.get_objects())  # type(): no __class__ lookups
