"""What the ``torch.profiler`` range around each batch costs when no profiler runs.

torch's iterators enter ``record_function`` on every ``__next__``; aioload's enter it only
while a profiler runs (``aioload._front.compat.profiled``). Printed: microseconds per call of an
empty loop, of aioload's range and of torch's, then per batch of a loader over a trivial
in-memory dataset (``num_workers=0``, where the per-batch cost is the loader's own), torch's
and aioload's, in interleaved rounds (median).

Run (a few seconds)::

    .venv/bin/python benchmarks/profiler_range.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.autograd.profiler import record_function

import aioload
from aioload._front.compat import WAITING, profiled

NAME = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


class Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2000

    def __getitem__(self, index: int) -> int:
        return index


def per_call(fn, n: int = 50_000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def empty() -> None:
    pass


def aioload_range() -> None:
    with profiled(WAITING):
        pass


def torch_range() -> None:
    with record_function(NAME):
        pass


def per_batch(loader) -> float:
    started = time.perf_counter()
    batches = sum(1 for _ in loader)
    return (time.perf_counter() - started) / batches * 1e6


def main(rounds: int = 5) -> None:
    calls: dict[str, list[float]] = {"empty loop": [], "aioload's range": [], "torch's record_function": []}
    batches: dict[str, list[float]] = {"torch DataLoader": [], "aioload DataLoader": []}
    torch_loader = torch.utils.data.DataLoader(Tiny(), batch_size=None)
    with aioload.DataLoader(Tiny(), batch_size=None) as loader:
        for _ in range(rounds):
            for name, fn in zip(calls, (empty, aioload_range, torch_range)):
                calls[name].append(per_call(fn))
            batches["torch DataLoader"].append(per_batch(torch_loader))
            batches["aioload DataLoader"].append(per_batch(loader))
    for name, values in {**calls, **batches}.items():
        print(f"{name:28s} {statistics.median(values):8.2f} us")


if __name__ == "__main__":
    main()
