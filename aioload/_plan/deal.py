"""This rank's share of an epoch's order, and how it is cut into batches.

Every rank gets the same number of samples, so the same number of batches: no rank waits at
a collective for one that ran out. The remainder rule is ``DistributedSampler``'s: without
``drop_last`` the order is padded by repeating its head up to a multiple of the world size
(a few samples are seen twice); with it the tail is cut (a few are not seen this epoch), and
the batch sampler then drops each rank's last batch if it is short.

The share is a list of *positions* into the sequence being dealt (padding wraps around), so
that :mod:`aioload._plan.elastic` can tell which positions a delivered batch covered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aioload._plan.order import BLOCKS, DEALS, STRIDE


@dataclass(frozen=True)
class Deal:
    """How one epoch (or what is left of one) is split: ``world_size`` ranks, ``kind``
    ``"stride"`` or ``"blocks"``, batches of ``batch_size`` (1 without automatic batching) with
    the loader's ``drop_last``."""

    world_size: int
    batch_size: int = 1
    drop_last: bool = False
    kind: str = STRIDE

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.kind not in DEALS:
            raise ValueError(f"the deal must be 'stride' or 'blocks', got {self.kind!r}")

    def per_rank(self, length: int) -> int:
        """Samples each rank takes from a sequence of ``length``."""
        if self.drop_last:
            return length // self.world_size
        return math.ceil(length / self.world_size)

    def positions(self, length: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s positions in a sequence of ``length``, in the order it visits them."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={self.world_size}")
        share = self.per_rank(length)
        if length == 0 or share == 0:
            return torch.zeros(0, dtype=torch.int64)
        if self.kind == BLOCKS:
            slots = torch.arange(rank * share, (rank + 1) * share, dtype=torch.int64)
        else:
            slots = torch.arange(rank, share * self.world_size, self.world_size, dtype=torch.int64)
        return slots % length

    def batches(self, length: int) -> int:
        """Batches each rank gets from a sequence of ``length``."""
        share = self.per_rank(length)
        if self.drop_last:
            return share // self.batch_size
        return math.ceil(share / self.batch_size)

    def kept(self, length: int) -> int:
        """Samples of each rank's share that are in a batch (a short last batch is dropped
        with ``drop_last``)."""
        if self.drop_last:
            return self.batches(length) * self.batch_size
        return self.per_rank(length)
