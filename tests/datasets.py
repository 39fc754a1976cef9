"""Small datasets used across the tests (module level, so every start method can import them)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

import aioload


class Squares(torch.utils.data.Dataset):
    """A plain map-style dataset: sample i is (a 3x4 tensor filled with i, i, "s{i}")."""

    def __init__(self, n: int = 103):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 4), float(i)), i, f"s{i}"


class SlowReads(aioload.Dataset):
    """A split dataset whose read awaits ``delay`` seconds and decode returns arange + i."""

    def __init__(self, n: int = 40, delay: float = 0.0, width: int = 5):
        self.n, self.delay, self.width = n, delay, width

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        if self.delay:
            await asyncio.sleep(self.delay)
        return i

    def read_blocking(self, i):
        if self.delay:
            time.sleep(self.delay)
        return i

    def decode(self, raw):
        return torch.arange(self.width) + raw, raw


class SlowSquares(Squares):
    """Squares whose every sample takes ``seconds`` of (sleeping) work."""

    def __init__(self, n: int = 80, seconds: float = 0.005):
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return super().__getitem__(i)


class Varying(torch.utils.data.Dataset):
    """Sample i is a 1-D tensor of length (i % 5) + 1: shapes vary from sample to sample."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i):
        return torch.full(((i % 5) + 1,), i, dtype=torch.int64)


class Mixed(torch.utils.data.Dataset):
    """Every kind default_collate handles: tensors, arrays, numbers, strings, dicts, nesting."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i):
        return {
            "image": torch.full((2, 2), i, dtype=torch.uint8),
            "array": np.full((3,), i, dtype=np.float32),
            "label": i,
            "score": i / 2,
            "name": f"n{i}",
            "pair": (torch.tensor([i, -i]), np.int64(i)),
        }


class FailsAt(aioload.Dataset):
    """Decode raises ValueError for one index; read raises OSError for another."""

    def __init__(self, bad_decode: int = 7, bad_read: int | None = None, n: int = 20):
        self.bad_decode, self.bad_read, self.n = bad_decode, bad_read, n

    def __len__(self) -> int:
        return self.n

    def describe(self, i) -> str:
        return f"/data/sample_{i}.bin"

    async def read(self, i):
        if i == self.bad_read:
            raise OSError(f"cannot read sample {i}")
        return i

    def decode(self, raw):
        if raw == self.bad_decode:
            raise ValueError(f"corrupt sample {raw}")
        return torch.tensor([raw])


def pad_collate(batch):
    """A custom collate_fn: pad 1-D tensors to the longest, return (padded, lengths)."""
    longest = max(len(t) for t in batch)
    out = torch.zeros(len(batch), longest, dtype=batch[0].dtype)
    for row, t in enumerate(batch):
        out[row, : len(t)] = t
    return out, torch.tensor([len(t) for t in batch])


class Numbers(torch.utils.data.Dataset):
    """Python numbers whose types vary inside a column: default_collate decides each batch's
    dtype from all of them (an int column with one float in it becomes float32)."""

    def __init__(self, n: int = 40, huge_at: int | None = None):
        self.n, self.huge_at = n, huge_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        label = i + 0.5 if i % 7 == 3 else i
        big = 2**70 if i == self.huge_at else 2**40 + i
        return torch.tensor([i]), label, i % 2 == 1, float(i) / 4, big
