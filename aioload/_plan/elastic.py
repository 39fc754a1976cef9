"""What is left of an epoch, dealt again on another number of ranks.

An epoch's order is computed (:mod:`aioload._plan.order`), and each rank's batches are a
function of it and the world size (:mod:`aioload._plan.deal`), so a position saved on ``N``
ranks names exactly which samples were delivered: the batches below ``delivered.low`` and those
in ``delivered.above``, on every rank (ranks move in lockstep; frameworks save rank 0's state).
The rest of the epoch is every position that was dealt into a batch and not delivered, in the
order of the sequence; a new world of ``M`` ranks deals that rest again, with the same
remainder rule, so each remaining sample is seen once (up to the padding that rule adds) and
every rank gets the same number of batches. An epoch resumed more than once is a list of such
*segments*, applied in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioload._plan.deal import Deal
from aioload._plan.order import STRIDE


@dataclass(frozen=True)
class Segment:
    """Part of an epoch run on one number of ranks: ``world_size`` and the batch sequence
    numbers delivered there (every one below ``low``, and ``above``)."""

    world_size: int
    low: int
    above: tuple[int, ...] = ()


def delivered_mask(batch_of: torch.Tensor, low: int, above) -> torch.Tensor:
    """Which entries of ``batch_of`` (a batch number per slot) name a delivered batch."""
    mask = batch_of < low
    if above:
        mask |= torch.isin(batch_of, torch.tensor(sorted(above), dtype=torch.int64))
    return mask


SLOTS_AT_ONCE = 1 << 22
"""Slots (a rank's place in its share) :func:`remainder` looks at in one step: its memory is a
few times this many int64s, whatever the epoch's length."""


def remainder(length: int, deal: Deal, segment: Segment) -> torch.Tensor:
    """The positions of a sequence of ``length``, dealt by ``deal``, that ``segment`` did not
    deliver and that were in a batch, in sequence order. A position padded onto a second rank
    counts as delivered if either of its slots was.

    Computed over every rank's slots at once (no loop over ranks), so that its cost follows the
    sequence, whatever the world size a saved state names. The slots of all ranks, numbered as
    :meth:`Deal.positions` numbers them, form a grid: with ``"stride"`` a row per place in a
    rank's share (rank ``r``'s slot there is ``place * world_size + r``), with ``"blocks"`` a
    row per rank (``r * share + place``); a slot's position is its number modulo ``length``.
    With more ranks than positions each rank holds one slot, in batch 0: ``length`` ranks of
    them cover the same positions."""
    share, kept = deal.per_rank(length), deal.kept(length)
    if length == 0 or kept == 0:
        return torch.zeros(0, dtype=torch.int64)
    world = min(deal.world_size, length) if share == 1 else deal.world_size
    places = torch.arange(kept, dtype=torch.int64)
    done = delivered_mask(places // deal.batch_size, segment.low, segment.above)  # by place in a share
    stride = deal.kind == STRIDE
    rows, width = (kept, world) if stride else (world, share)
    dealt = torch.zeros(length, dtype=torch.bool)
    seen = torch.zeros(length, dtype=torch.bool)
    step = max(1, SLOTS_AT_ONCE // width)
    for first in range(0, rows, step):
        last = min(first + step, rows)
        grid = (torch.arange(first * width, last * width, dtype=torch.int64) % length).view(last - first, width)
        if stride:
            dealt[grid] = True
            seen[grid[done[first:last]]] = True
        else:
            grid = grid[:, :kept]
            dealt[grid] = True
            seen[grid[:, done]] = True
    return torch.nonzero(dealt & ~seen).reshape(-1)


def rest_of_epoch(length: int, segments, deal_for) -> torch.Tensor:
    """What is left of an epoch of ``length`` after ``segments`` (oldest first): positions into
    the epoch's order. ``deal_for(world_size)`` is the :class:`Deal` a world of that size used."""
    rest = torch.arange(length, dtype=torch.int64)
    for segment in segments:
        rest = rest[remainder(rest.numel(), deal_for(segment.world_size), segment)]
    return rest
