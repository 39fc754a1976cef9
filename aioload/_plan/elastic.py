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

What is left is kept as *pieces*: runs of consecutive positions of the epoch, as sorted
``(starts, ends)`` arrays. A segment's delivered batches are a few runs of each rank's places,
so what it leaves is a few runs of the sequence it was dealt from (one per batch delivered out
of turn, and one per rank where ranks hold blocks), and applying it costs in the pieces, not in
the epoch's length: a state of thousands of segments loads in a second. Where the pieces are
many (a state that cut the rest finely), the positions themselves are kept instead, and a
segment costs one pass over them. Either way the work is bounded (:data:`WORK_MAX`): a state
that passes it is refused (:class:`TooManyPieces`), so no state costs more than about
:data:`WORK_PER_POSITION` passes over its epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aioload._base.errors import ResumeError
from aioload._plan.deal import Deal
from aioload._plan.order import STRIDE

WORK_MAX = 1 << 22
WORK_PER_POSITION = 64
"""What applying the segments of a saved state may cost, in pieces or positions handled:
:data:`WORK_MAX`, and ``WORK_PER_POSITION`` for each position of the epoch. A real run adds a
few pieces per resume (a rank's worth where ranks hold blocks): thousands of resumes of
thousands of ranks fit."""

_PIECE_COST = 8  # a piece handled costs about as much as this many positions gathered
_RANK_RUNS = 1024  # blocks: runs of slots worth handling as runs (beyond, a mark per slot)


@dataclass(frozen=True)
class Segment:
    """Part of an epoch run on one number of ranks: ``world_size`` and the batch sequence
    numbers delivered there (every one below ``low``, and ``above``)."""

    world_size: int
    low: int
    above: tuple[int, ...] = ()


class TooManyPieces(ResumeError):
    """Applying a state's segments would pass the budget (:data:`WORK_MAX`): ``index`` is the
    segment that did, ``work`` what it had handled, ``budget`` the bound."""

    def __init__(self, message: str, index: int = 0, work: int = 0, budget: int = 0):
        super().__init__(message)
        self.index, self.work, self.budget = index, work, budget

    @classmethod
    def at(cls, index: int, work: int, budget: int) -> "TooManyPieces":
        return cls(f"segment {index} of the state cuts what is left of its epoch more finely than a run resumed on "
                   f"other numbers of ranks does ({work:,} pieces and positions handled, past a budget of "
                   f"{budget:,}); pass what loader.state_dict() returned", index, work, budget)

    def __reduce__(self):
        return (type(self), (str(self), self.index, self.work, self.budget), {"__notes__": getattr(self, "__notes__", [])})


_EMPTY = np.zeros(0, dtype=np.int64)


def _runs(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[starts[i], ends[i])`` (any order, overlapping or touching):
    sorted, disjoint runs."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    keep = starts < ends
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return _EMPTY, _EMPTY
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    new = np.ones(starts.size, dtype=bool)
    new[1:] = starts[1:] > ends[:-1]
    last = np.flatnonzero(np.append(new[1:], True))
    return starts[new], ends[last]


def _marked_runs(marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs of marked places."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], marks, [False]]).astype(np.int8)))
    return edges[0::2].astype(np.int64), edges[1::2].astype(np.int64)


def _runs_of(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Increasing positions as runs: a run ends where the next position is not the one after."""
    if positions.size == 0:
        return _EMPTY, _EMPTY
    cut = np.flatnonzero(np.diff(positions) != 1) + 1
    return positions[np.concatenate([[0], cut])], positions[np.concatenate([cut - 1, [positions.size - 1]])] + 1


def _delivered(kept: int, batch_size: int, segment: Segment) -> tuple[np.ndarray, np.ndarray]:
    """Runs of a rank's first ``kept`` places (a share's slots in order) in a batch that
    ``segment`` delivered."""
    above = np.asarray(segment.above, dtype=np.int64)
    starts = np.concatenate([[0], above * batch_size])
    ends = np.concatenate([[segment.low * batch_size], (above + 1) * batch_size])
    return _runs(np.minimum(starts, kept), np.minimum(ends, kept))


def _left(length: int, deal: Deal, segment: Segment) -> tuple[np.ndarray, np.ndarray]:
    """The runs of positions of a sequence of ``length``, dealt by ``deal``, that ``segment``
    did not deliver and that were in a batch. A position padded onto a second rank counts as
    delivered if either of its slots was.

    The slots of all ranks, numbered as :meth:`Deal.positions` numbers them, are ``world x
    share`` of them: with ``"stride"`` place ``p`` of rank ``r`` is slot ``p * world + r``, so a
    run of places of every rank is one run of slots; with ``"blocks"`` it is ``r * share + p``,
    a run per rank (marked slot by slot where that is cheaper). A slot's position is its number
    modulo ``length``, and there are fewer than ``2 * length`` slots (padding repeats less than
    a rank's share). With more ranks than positions each rank holds one slot, in batch 0:
    ``length`` ranks of them cover the same positions, so no step loops over ranks beyond the
    sequence's length."""
    share, kept = deal.per_rank(length), deal.kept(length)
    if length == 0 or kept == 0:
        return _EMPTY, _EMPTY
    world = min(deal.world_size, length) if share == 1 else deal.world_size
    done = _delivered(kept, deal.batch_size, segment)
    if deal.kind == STRIDE:
        dealt = (np.array([0]), np.array([kept * world]))
        seen = (done[0] * world, done[1] * world)
    elif world * (done[0].size + 1) <= _RANK_RUNS:
        base = np.arange(world, dtype=np.int64) * share
        dealt = _runs(base, base + kept)
        seen = _runs((base[:, None] + done[0]).ravel(), (base[:, None] + done[1]).ravel())
    else:  # many ranks: a mark per slot (fewer than 2 * length of them)
        slots = np.zeros((2, world, share), dtype=bool)
        slots[0, :, :kept] = True
        slots[1, :, _positions(done)] = True
        folded = np.zeros((2, length), dtype=bool)
        for mark, flat in zip(folded, slots.reshape(2, -1)):
            mark[:min(length, flat.size)] = flat[:length]
            mark[:max(0, flat.size - length)] |= flat[length:]
        return _marked_runs(folded[0] & ~folded[1])
    return _minus(_fold(dealt, length), _fold(seen, length))


def _inside(points: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which ``points`` lie in the runs ``starts, ends`` (sorted, disjoint)."""
    if starts.size == 0:
        return np.zeros(points.size, dtype=bool)
    at = np.searchsorted(starts, points, side="right") - 1
    return (at >= 0) & (points < ends[np.maximum(at, 0)])


def _minus(a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The runs ``a`` without the runs ``b`` (both few): cut at every boundary of either, the
    parts in ``a`` and not in ``b`` kept and joined again."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    cuts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = cuts[:-1], cuts[1:]
    keep = _inside(lo, *a) & ~_inside(lo, *b)
    return _runs(lo[keep], hi[keep])


def _fold(runs: tuple, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of slots (fewer than ``2 * length``) as runs of positions: slot ``s`` is position
    ``s mod length``."""
    starts, ends = runs
    wrap = ends > length
    return _runs(np.concatenate([np.minimum(starts, length), np.maximum(starts[wrap], length) - length]),
                 np.concatenate([np.minimum(ends, length), ends[wrap] - length]))


def _positions(runs: tuple) -> np.ndarray:
    """Every position in ``runs``, in order."""
    starts, ends = runs
    sizes = ends - starts
    total = int(sizes.sum())
    if total == 0:
        return _EMPTY
    offsets = np.cumsum(sizes) - sizes
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, sizes)


def remainder(length: int, deal: Deal, segment: Segment) -> torch.Tensor:
    """The positions of a sequence of ``length``, dealt by ``deal``, that ``segment`` did not
    deliver and that were in a batch, in sequence order (see :func:`_left`)."""
    return torch.from_numpy(_positions(_left(length, deal, segment)))


def _select(rest: tuple, picked: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of ``rest`` (runs of epoch positions) at the places ``picked`` (runs of
    places in ``rest``, counted from 0 along its pieces): each picked run, cut where it crosses
    from one piece to the next. Pieces are never touching, so neither are the parts."""
    starts, ends = rest
    offsets = np.concatenate([[0], np.cumsum(ends - starts)])
    first = np.searchsorted(offsets, picked[0], side="right") - 1  # the piece each picked run starts in
    after = np.searchsorted(offsets, picked[1], side="left")  # ... and the one after it ends in
    count = after - first
    piece = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
    lo = np.maximum(offsets[piece], np.repeat(picked[0], count))
    hi = np.minimum(offsets[piece + 1], np.repeat(picked[1], count))
    begin = starts[piece] + (lo - offsets[piece])
    return begin, begin + (hi - lo)


def rest_runs(length: int, segments, deal_for, check=None) -> tuple[np.ndarray, np.ndarray]:
    """What is left of an epoch of ``length`` after ``segments`` (oldest first), as runs of
    positions into the epoch's order. ``deal_for(world_size)`` is the :class:`Deal` a world of
    that size used; ``check(i, segment, left)``, where given, is called before segment ``i`` is
    applied to the ``left`` positions the ones before it left. Raises :class:`TooManyPieces`
    where the work passes the budget (:data:`WORK_MAX`)."""
    runs = (np.array([0], dtype=np.int64), np.array([length], dtype=np.int64)) if length else (_EMPTY, _EMPTY)
    dense = None  # the positions themselves, once the pieces are too many
    left = length
    budget, work = WORK_MAX + WORK_PER_POSITION * length, 0
    for i, segment in enumerate(segments):
        if check is not None:
            check(i, segment, left)
        picked = _left(left, deal_for(segment.world_size), segment)
        if dense is None and _PIECE_COST * (runs[0].size + picked[0].size) > left:
            dense = _positions(runs)
            work += left
        work += left if dense is not None else _PIECE_COST * (runs[0].size + picked[0].size)
        if work > budget:
            raise TooManyPieces.at(i, work, budget)
        if dense is not None:
            dense = dense[_positions(picked)]
        else:
            runs = _select(runs, picked)
        left = int((picked[1] - picked[0]).sum())
    return _runs_of(dense) if dense is not None else runs


def rest_of_epoch(length: int, segments, deal_for, check=None) -> torch.Tensor:
    """:func:`rest_runs` as the positions themselves, in order."""
    return torch.from_numpy(_positions(rest_runs(length, segments, deal_for, check)))
