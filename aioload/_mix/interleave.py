"""Which source each sample of a mixed epoch comes from, and which of its samples it is.

The epoch's order is computed, never drawn as it goes: position ``k`` of epoch ``e`` depends
only on ``(seed, e)``, the sources' lengths and the weight schedule, so every rank and a
resumed run compute the same order.

**Choosing the source.** Within a stretch of the epoch where the weights ``w`` hold, source
``s`` gets the keys ``(j + u_j) / w_s`` (``j = 0, 1, ...``, ``u_j`` uniform in [0, 1), seeded
by the stretch's start), and positions go to the sources in the order of their keys. After
``t`` positions source ``s`` has had ``t * w_s`` of them to within ``1 + w_s * (sources)``,
whatever ``t``: the proportions hold in every window of the epoch, not only on average (an
i.i.d. draw misses them by ``sqrt(t w (1 - w))``: 0.4 % of 10,000 samples at ``w = 0.25``).
Without shuffling ``u_j = 0.5``: a fixed interleave. A stretch's first ``n`` positions do not
depend on where it ends, so adding a weight change at ``p`` leaves every position before ``p``
as it was.

**Choosing the sample.** The ``j``-th time source ``s`` is chosen in the epoch it gives the
``j``-th index of its own order (its ``epoch_order`` if it has one, else a ``randperm``
seeded from ``(seed, epoch, s)``). A source that runs out starts a fresh order
(``exhausted="repeat"``) or ends the epoch there (``"stop"``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from aioload._mix.weights import Schedule, Weights, normalised
from aioload._base.seeding import derive_seed

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def uniforms(seed: int, count: int) -> np.ndarray:
    """``count`` floats in [0, 1): element ``j`` depends only on ``(seed, j)`` (splitmix64), so
    a longer draw starts with a shorter one."""
    with np.errstate(over="ignore"):
        z = (np.arange(count, dtype=np.uint64) + np.uint64(seed & (2**64 - 1))) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def choose(weights: Weights, count: int, bound: int, seed: int, shuffle: bool) -> np.ndarray:
    """The source of each of a stretch's first ``count`` positions (``bound``: the most the
    stretch could ever hold, so that these do not depend on where it ends)."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    weights = normalised(weights)
    live = [s for s, w in enumerate(weights) if w > 0]
    keys, labels = [], []
    for s in live:
        need = math.ceil((bound + len(live)) * weights[s]) + 2
        jitter = uniforms(derive_seed(seed, s), need) if shuffle else np.full(need, 0.5)
        keys.append((np.arange(need, dtype=np.float64) + jitter) / weights[s])
        labels.append(np.full(need, s, dtype=np.int64))
    order = np.argsort(np.concatenate(keys), kind="stable")
    return np.concatenate(labels)[order[:count]]


def natural_length(lengths: Sequence[int], weights: Weights, seed: int, shuffle: bool) -> int:
    """How many samples an epoch drawn with ``weights`` holds before any source would be drawn
    once more than it has: the default length of a mixed epoch."""
    shares = normalised(weights)
    live = [s for s, w in enumerate(shares) if w > 0]
    bound = min(math.ceil((lengths[s] + 2) / shares[s]) for s in live) + 2 * len(live) + 2
    sources = choose(weights, bound, bound, seed, shuffle)
    return _first_overrun(sources, lengths, bound)


def _first_overrun(sources: np.ndarray, lengths: Sequence[int], default: int) -> int:
    """The first position where a source is drawn more often than its length (``default``
    where none is)."""
    first = default
    for s, length in enumerate(lengths):
        at = np.flatnonzero(sources == s)
        if at.size > length:
            first = min(first, int(at[length]))
    return first


def sources_of(lengths: Sequence[int], schedule: Schedule, length: int, seed: int, epoch: int,
               shuffle: bool, stop: bool) -> np.ndarray:
    """The source of each position of the epoch (shorter than ``length`` when ``stop`` and a
    source ran out)."""
    pieces = []
    for i, (start, weights) in enumerate(schedule):
        if start >= length:
            break
        end = schedule[i + 1][0] if i + 1 < len(schedule) else length
        end = min(end, length)
        pieces.append(choose(weights, end - start, length - start, derive_seed(seed, epoch, start), shuffle))
    sources = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if stop:
        sources = sources[: _first_overrun(sources, lengths, sources.size)]
    return sources


def mixed_order(lengths: Sequence[int], source_order: Callable[[int, int], torch.Tensor], schedule: Schedule,
                length: int, seed: int, epoch: int, shuffle: bool, stop: bool) -> torch.Tensor:
    """The epoch's order as indices into the sources laid end to end (source ``s``'s sample
    ``i`` is ``offset[s] + i``). ``source_order(s, p)`` is pass ``p`` over source ``s``."""
    sources = torch.from_numpy(sources_of(lengths, schedule, length, seed, epoch, shuffle, stop))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = torch.empty(sources.numel(), dtype=torch.int64)
    for s in range(len(lengths)):
        where = torch.nonzero(sources == s).reshape(-1)
        if where.numel() == 0:
            continue
        passes, drawn = [], 0
        while drawn < where.numel():
            one = source_order(s, len(passes))
            if one.numel() == 0:
                raise ValueError(f"source {s} of the mix has no samples to draw")
            passes.append(one)
            drawn += one.numel()
        order[where] = torch.cat(passes)[: where.numel()] + int(offsets[s])
    return order
