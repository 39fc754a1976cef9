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

import numpy as np
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


def delivered_places(kept: int, batch_size: int, segment: Segment) -> np.ndarray:
    """Which of a rank's first ``kept`` places (a share's slots in order) are in a batch that
    ``segment`` delivered."""
    done = np.zeros(kept, dtype=bool)
    done[:segment.low * batch_size] = True
    for number in segment.above:
        done[number * batch_size:(number + 1) * batch_size] = True
    return done


def remainder(length: int, deal: Deal, segment: Segment) -> torch.Tensor:
    """The positions of a sequence of ``length``, dealt by ``deal``, that ``segment`` did not
    deliver and that were in a batch, in sequence order. A position padded onto a second rank
    counts as delivered if either of its slots was.

    Computed over every rank's slots at once (no loop over ranks), so that its cost follows the
    sequence, whatever the world size a saved state names, and in numpy (one thread: torch's
    threads cost ten times as much CPU on these short steps, once per saved segment). The slots
    of all ranks, numbered as :meth:`Deal.positions` numbers them, are ``world x share`` of them:
    with ``"stride"`` place ``p`` of rank ``r`` is slot ``p * world + r``, with ``"blocks"``
    ``r * share + p``; a slot's position is its number modulo ``length``, and there are fewer
    than ``2 * length`` slots (padding repeats less than a rank's share), so each position has
    at most two. With more ranks than positions each rank holds one slot, in batch 0:
    ``length`` ranks of them cover the same positions."""
    share, kept = deal.per_rank(length), deal.kept(length)
    if length == 0 or kept == 0:
        return torch.zeros(0, dtype=torch.int64)
    world = min(deal.world_size, length) if share == 1 else deal.world_size
    done = delivered_places(kept, deal.batch_size, segment)
    if deal.kind == STRIDE:  # slot p * world + r: a place's slots are consecutive
        dealt = np.ones(kept * world, dtype=bool)
        seen = np.repeat(done, world)
    else:  # slot r * share + p: each rank's share in turn, its first `kept` places in a batch
        in_batch = np.arange(share) < kept
        dealt = np.tile(in_batch, world)
        seen = np.tile(np.concatenate([done, np.zeros(share - kept, dtype=bool)]), world)
    return torch.from_numpy(np.flatnonzero(_fold(dealt, length) & ~_fold(seen, length)))


def _fold(slots: np.ndarray, length: int) -> np.ndarray:
    """A mark per position: any of its slots (``slot mod length``) marked."""
    out = np.zeros(length, dtype=bool)
    head = slots[:length]
    out[:len(head)] = head
    wrapped = slots[length:]
    out[:len(wrapped)] |= wrapped
    return out


def rest_of_epoch(length: int, segments, deal_for) -> torch.Tensor:
    """What is left of an epoch of ``length`` after ``segments`` (oldest first): positions into
    the epoch's order. ``deal_for(world_size)`` is the :class:`Deal` a world of that size used."""
    rest = torch.arange(length, dtype=torch.int64)
    for segment in segments:
        rest = rest[remainder(rest.numel(), deal_for(segment.world_size), segment)]
    return rest
