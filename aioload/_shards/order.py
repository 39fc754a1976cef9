"""The order of an epoch over shards: a pure function of the shard sizes, the window, the seed
and the epoch (never of timing, the worker count or the rank).

``window=None``: a uniform shuffle of every sample (``torch.randperm`` seeded with
``seed + epoch``, as ``DistributedSampler`` does).

``window=k``: the shards in a shuffled sequence; ``k`` of them are *open* at a time; each next
sample is drawn uniformly from the samples not yet drawn of the open shards; when a shard's
last sample has been drawn, the next shard of the sequence opens. So at every point of the
order exactly ``k`` shards (fewer at the very end) have begun and not ended, which is what
bounds the memory of the window's fetcher, and each shard's samples come in a random order.

It is computed without a loop over samples. Give each open sample a clock that rings after an
exponential time (rate 1) from the moment its shard opened: the next ring is then uniform
among the samples not yet drawn (the exponential forgets how long it has waited), which is
the draw above. A shard ends at its latest ring, and the next shard of the sequence opens at
that moment; sorting every sample by its ring time gives the order. The loop is over shards
(a heap of the open shards' end times); the samples are one ``argsort``.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) + int(epoch))


def uniform_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Every index of ``range(n)`` once: shuffled uniformly, or in order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=_generator(seed, epoch))


def window_order(sizes: Sequence[int], k: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Every sample index once (shard ``j``'s samples are ``sum(sizes[:j]) + range(sizes[j])``),
    drawn from a window of ``k`` open shards as the module's docstring says; in order when
    ``shuffle`` is false."""
    counts = torch.as_tensor(list(sizes), dtype=torch.int64)
    n = int(counts.sum())
    if not shuffle or n == 0:
        return torch.arange(n)
    g = _generator(seed, epoch)
    sequence = torch.randperm(len(counts), generator=g).tolist()
    rings = torch.empty(n, dtype=torch.float64).exponential_(generator=g)
    firsts = torch.cumsum(counts, 0) - counts
    opened = torch.zeros(len(counts), dtype=torch.float64)
    # shards open in sequence order: the first k at time 0, each later one when an open one ends
    ends: list[float] = []
    for position, shard in enumerate(sequence):
        size = int(counts[shard])
        if position < k:
            start = 0.0
        else:
            start = heapq.heappop(ends)
        opened[shard] = start
        if size:
            first = int(firsts[shard])
            heapq.heappush(ends, start + float(rings[first:first + size].max()))
        else:
            heapq.heappush(ends, start)
    times = rings + torch.repeat_interleave(opened, counts)
    return torch.argsort(times, stable=True)
