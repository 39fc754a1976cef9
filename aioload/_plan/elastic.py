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


def remainder(length: int, deal: Deal, segment: Segment) -> torch.Tensor:
    """The positions of a sequence of ``length``, dealt by ``deal``, that ``segment`` did not
    deliver and that were in a batch, in sequence order. A position padded onto a second rank
    counts as delivered if either of its slots was."""
    dealt = torch.zeros(length, dtype=torch.bool)
    seen = torch.zeros(length, dtype=torch.bool)
    kept = deal.kept(length)
    batch_of = torch.arange(kept, dtype=torch.int64) // deal.batch_size
    done = delivered_mask(batch_of, segment.low, segment.above)
    for rank in range(deal.world_size):
        positions = deal.positions(length, rank)[:kept]
        dealt[positions] = True
        seen[positions[done]] = True
    return torch.nonzero(dealt & ~seen).reshape(-1)


def rest_of_epoch(length: int, segments, deal_for) -> torch.Tensor:
    """What is left of an epoch of ``length`` after ``segments`` (oldest first): positions into
    the epoch's order. ``deal_for(world_size)`` is the :class:`Deal` a world of that size used."""
    rest = torch.arange(length, dtype=torch.int64)
    for segment in segments:
        rest = rest[remainder(rest.numel(), deal_for(segment.world_size), segment)]
    return rest
