"""Datasets, worker_init_fns and collate_fns for test_conformance.py.

They live in their own module, which imports only torch and numpy, so that spawn and
forkserver workers can import them by name without importing the test module.
"""

from __future__ import annotations

import collections
import math
import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Pair = collections.namedtuple("Pair", "x y")


class Opaque:
    """A sample type default_collate does not know."""

    def __init__(self, i):
        self.i = i

    def __eq__(self, other):
        return type(other) is Opaque and other.i == self.i


def make_sample(kind: str, i: int):
    if kind == "tensor":
        return torch.arange(3, dtype=torch.float32) + i
    if kind == "int":
        return i
    if kind == "float":
        return i / 2
    if kind == "bool":
        return i % 2 == 0
    if kind == "str":
        return f"s{i}"
    if kind == "bytes":
        return bytes([i, i])
    if kind == "numpy":
        return np.arange(4, dtype=np.int16).reshape(2, 2) + i
    if kind == "numpy_scalar":
        return np.float64(i) / 4
    if kind == "numpy_0d":
        return np.array(i * 1.5)
    if kind == "dict":
        return {"image": torch.full((2, 2), i, dtype=torch.uint8), "label": i, "name": f"n{i}"}
    if kind == "ordered_dict":
        return collections.OrderedDict([("b", torch.tensor([i])), ("a", float(i))])
    if kind == "tuple":
        return (torch.tensor([i]), i)
    if kind == "list":
        return [torch.tensor([i, i]), float(i)]
    if kind == "namedtuple":
        return Pair(torch.tensor(i), np.array([i, -i]))
    if kind == "nested":
        return {"a": [(torch.ones(2) * i, {"b": np.int32(i)})], "c": Pair(i, "x"), "d": (b"z", [1.5])}
    if kind == "dtypes":
        return {
            "f16": torch.ones(2, dtype=torch.float16) * i,
            "bf16": torch.ones(3, dtype=torch.bfloat16) * i,
            "bool": torch.tensor([i % 2 == 0]),
            "c64": torch.tensor([complex(i, 1)]),
            "i8": torch.tensor([-i], dtype=torch.int8),
            "f64": np.ones(2, dtype=np.float64) * i,
            "u8": np.full(3, i, dtype=np.uint8),
        }
    if kind == "empty":
        return torch.zeros(0, 3)
    if kind == "strided":
        return torch.arange(6.0).reshape(2, 3).t() + i
    if kind == "scalar_tensor":
        return torch.tensor(i * 2)
    if kind == "ragged":
        return torch.ones(1 + i % 3)
    if kind == "ragged_list":
        return [0] * (1 + i % 2)
    if kind == "opaque":
        return Opaque(i)
    if kind == "str_array":
        return np.array([f"a{i}"])
    raise ValueError(f"unknown sample kind {kind!r}")


class Samples(Dataset):
    """``n`` samples of one kind (see ``make_sample``)."""

    def __init__(self, kind: str, n: int = 7):
        self.kind = kind
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_sample(self.kind, i)


class ListIndexed(Dataset):
    """Accepts a list of indices as one index (used with ``batch_size=None``)."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return torch.tensor(index) * 10


class PaddedBatches(Dataset):
    """``__getitems__`` pads every sample to the longest one of the batch it was asked for."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        return torch.arange(1 + i % 4)

    def __getitems__(self, indices):
        longest = max(1 + i % 4 for i in indices)
        return [torch.nn.functional.pad(self[i], (0, longest - 1 - i % 4)) for i in indices]


class Range(IterableDataset):
    """torch's documented IterableDataset: yields ``start..end-1``, split across workers in
    ``__iter__`` (``shard=True``) or whole in every worker."""

    def __init__(self, start: int, end: int, shard: bool = True):
        self.start = start
        self.end = end
        self.shard = shard

    def __iter__(self):
        info = get_worker_info()
        lo, hi = self.start, self.end
        if info is not None and self.shard:
            per = int(math.ceil((hi - lo) / info.num_workers))
            lo = self.start + info.id * per
            hi = min(lo + per, self.end)
        return iter(range(lo, hi))


class SizedRange(Range):
    def __init__(self, start: int, end: int, shard: bool = True, reported: int | None = None):
        super().__init__(start, end, shard)
        self.reported = end - start if reported is None else reported

    def __len__(self):
        return self.reported


def shard_range(worker_id: int) -> None:
    """torch's documented worker_init_fn: configure each worker's copy of a Range."""
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per = int(math.ceil((overall_end - overall_start) / float(info.num_workers)))
    dataset.start = overall_start + worker_id * per
    dataset.end = min(dataset.start + per, overall_end)


class Uneven(IterableDataset):
    """Worker ``k`` yields ``3 * k + 1`` items: workers run out at different times."""

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        return iter([wid * 100 + j for j in range(3 * wid + 1)])


class FailingStream(IterableDataset):
    def __iter__(self):
        yield 0
        yield 1
        raise ValueError("stream is corrupt after 2 items")


class InfoStream(IterableDataset):
    """Each worker yields what it sees of itself: ``get_worker_info()``, its RNGs, and what
    ``record_init`` stored on its copy of the dataset. Two items per worker."""

    def __iter__(self):
        info = get_worker_info()
        for _ in range(2):
            yield {
                "id": -1 if info is None else info.id,
                "num_workers": 0 if info is None else info.num_workers,
                "seed": -1 if info is None else info.seed,
                "own_copy": info is not None and info.dataset is self,
                "torch": torch.rand(2),
                "random": random.random(),
                "numpy": float(np.random.rand()),
                "init": getattr(self, "init_record", None),
            }


def record_init(worker_id: int) -> None:
    """A worker_init_fn that stores what it saw on its worker's copy of the dataset."""
    info = get_worker_info()
    info.dataset.init_record = (
        worker_id,
        info.seed,
        torch.initial_seed(),
        random.random(),
        float(np.random.rand()),
        torch.rand(1).item(),
    )


class WorkerProbe(Dataset):
    """Map-style: each sample says which worker made it and what that worker was seeded with."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        if info is None:
            return (i, -1, 0, -1, None)
        return (i, info.id, info.num_workers, info.seed, getattr(info.dataset, "init_record", None))


class SampleError(Exception):
    """A user exception type, defined in the dataset's module."""


def make_error(kind: str, i: int) -> Exception:
    if kind == "value":
        return ValueError(f"sample {i} is corrupt")
    if kind == "key":
        return KeyError(f"missing {i}")
    if kind == "custom":
        return SampleError(f"sample {i} failed")
    raise ValueError(kind)


class Faulty(Dataset):
    def __init__(self, kind: str, bad=(3,), n: int = 8):
        self.kind, self.bad, self.n = kind, set(bad), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise make_error(self.kind, i)
        return torch.tensor([i])


class Dies(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            os._exit(3)
        return i


def failing_init(worker_id: int) -> None:
    raise SampleError(f"worker {worker_id} could not open its database")


class CustomBatch:
    """torch's documented custom batch type, with its own ``pin_memory``."""

    def __init__(self, samples):
        transposed = list(zip(*samples))
        self.inp = torch.stack(transposed[0], 0)
        self.tgt = torch.tensor(transposed[1])
        self.pinned = False

    def pin_memory(self):
        self.inp = self.inp.pin_memory()
        self.tgt = self.tgt.pin_memory()
        self.pinned = True
        return self


def as_list(samples):
    return list(samples)


def numpy_collate(samples):
    return np.stack([np.asarray(s) for s in samples])


def broken_collate(samples):
    raise ValueError(f"cannot collate {len(samples)} samples")
