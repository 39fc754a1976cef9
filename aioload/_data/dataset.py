"""The split dataset protocol: ``read`` (I/O, on the event loop) and ``decode`` (CPU, in a worker)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from aioload._storage.cache import MemoryCache
from aioload._storage.diskcache import DiskCache


class _NotReady:
    def __repr__(self) -> str:
        return "aioload.NOT_READY"


NOT_READY = _NotReady()
"""Returned by :meth:`Dataset.read_nowait` when the item needs a real read."""


class Dataset(torch.utils.data.Dataset):
    """A map-style dataset whose loading is split in two.

    * ``async def read(self, index)`` does the I/O. It runs on an event loop, up to
      ``io_concurrency`` at once; return raw bytes and whatever small metadata ``decode``
      needs (a label, a path).
    * ``def decode(self, raw)`` does the CPU work (decode, augment). It runs in a worker
      process and returns the sample: tensors, numbers, strings, and dicts/tuples of them.

    With ``num_workers > 0`` the reads, too, run in the worker processes by default, each on
    the worker's own event loop (``DataLoader(read_in_workers=...)``): the training process
    then spends no CPU on them. A dataset whose reads must share one process -- an in-memory
    cache shared by every read (a storage with a cache keeps its reads here by itself), one
    rate limit for all of them -- says so with
    :attr:`read_in_workers`; ``read`` then runs on the loader's event loop in the main process.

    ``__getitem__`` runs both in the calling thread, so the same object also works with
    ``torch.utils.data.DataLoader``. Override :meth:`read_blocking` when a blocking read is
    cheaper than running ``read`` on a fresh event loop (the built-in datasets do).
    """

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def read_in_workers(self) -> bool:
        """Whether ``read`` may run in the worker processes (each on its own event loop).
        ``False`` when the dataset holds an :class:`aioload.Storage` with a cache: a
        :class:`aioload.MemoryCache` lives in one process, and a :class:`aioload.DiskCache`
        counts its hits and misses (``cache.stats()``) in the process that reads. Override it
        (a class attribute will do) when ``read`` needs state shared by every read."""
        held = getattr(self, "__dict__", {}).values()
        return not any(isinstance(getattr(value, "cache", None), (MemoryCache, DiskCache)) for value in held)

    async def read(self, index: int) -> Any:
        raise NotImplementedError

    def decode(self, raw: Any) -> Any:
        raise NotImplementedError

    def read_nowait(self, index: int) -> Any:
        """The raw item, when it is at hand without waiting for any I/O (a local path the
        worker will open, a value already in memory); else :data:`NOT_READY`, and the loader
        awaits :meth:`read`. Items ready this way skip the event loop's per-read cost."""
        return NOT_READY

    def describe(self, index: int) -> str | None:
        """Where sample ``index`` lives (a path or URL), for error messages."""
        return None

    def read_blocking(self, index: int) -> Any:
        return asyncio.run(self.read(index))

    def __getitem__(self, index: int) -> Any:
        return self.decode(self.read_blocking(index))


def is_split(dataset) -> bool:
    """Whether ``dataset`` implements the split protocol (its own ``read`` and ``decode``)."""
    read = getattr(type(dataset), "read", None)
    decode = getattr(type(dataset), "decode", None)
    if read is None or decode is None:
        return False
    return read is not Dataset.read and decode is not Dataset.decode and asyncio.iscoroutinefunction(read)


def fetches_batches(dataset) -> bool:
    """Whether ``dataset`` fetches a batch in one ``__getitems__`` call, as torch's fetcher
    then calls it (a ``Subset`` merely forwards to the dataset it wraps)."""
    if getattr(dataset, "__getitems__", None) is None:
        return False
    if isinstance(dataset, torch.utils.data.Subset):
        return fetches_batches(dataset.dataset)
    return True
