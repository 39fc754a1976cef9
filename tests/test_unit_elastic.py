"""Elastic resume (:mod:`aioload._plan`): a state saved on N ranks resumes on M.

# unit tests: no worker process

Each rank is played in this one process with torch's fake process group (as in
tests/test_unit_sampling.py), through the :class:`~aioload._plan.sampling.Planner` that
``aioload.DataLoader`` uses. The reference for "the rest of the epoch" is the uninterrupted run
itself: every rank's batches after the ones the saved run delivered.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from aioload._plan.deal import Deal
from aioload._plan import elastic
from aioload._plan.elastic import Segment, remainder, rest_of_epoch
from aioload._base.seeding import derive_seed
from tests.test_unit_sampling import make_planner, ranks  # noqa: F401 - ranks is a fixture

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

LENGTH, BATCH = 48, 2


class Blocks(torch.utils.data.Dataset):
    """A dataset that computes its own order and is dealt in contiguous blocks (as shards are)."""

    deal = "blocks"

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i

    def epoch_order(self, seed, epoch, shuffle):
        # runs of 4 in a shuffled order of runs, like samples of shards visited shard by shard
        runs = torch.randperm(self.n // 4, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))
        return (runs[:, None] * 4 + torch.arange(4)).reshape(-1) if shuffle else torch.arange(self.n)


def plan_rank(ranks, rank, world, *, state=None, epoch=0, drop_last=False, dataset=None, seed=5):
    """``(planner, progress, batches)`` of ``rank`` of ``world``, resumed from ``state``."""
    ranks(rank, world)
    planner = make_planner(LENGTH, BATCH, shuffle=True, seed=seed, drop_last=drop_last, dataset=dataset)
    resume = planner.load(state) if state is not None else None
    plan, progress = planner.plan(resume["epoch"] if resume else epoch, resume, False)
    return planner, progress, [list(b) for _, b in plan.batches]


def save_after(ranks, world, k, **kw):
    """Every rank's batches of an uninterrupted ``world``-rank epoch, and rank 0's state after
    it delivered its first ``k`` batches."""
    runs = [plan_rank(ranks, r, world, **kw)[2] for r in range(world)]
    planner, progress, _ = plan_rank(ranks, 0, world, **kw)
    for seq in range(k):
        progress.delivered.add(seq)
    return runs, planner.state_dict(1, progress)


def samples(batches_per_rank) -> Counter:
    return Counter(i for batches in batches_per_rank for batch in batches for i in batch)


@pytest.mark.parametrize("dataset", [None, Blocks(LENGTH)], ids=["stride", "blocks"])
@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (2, 4), (4, 3), (3, 2)])
def test_the_rest_of_an_epoch_is_dealt_over_the_new_ranks_each_sample_once(ranks, saved_on, resumed_on, dataset):
    runs, state = save_after(ranks, saved_on, 2, dataset=dataset)
    rest = samples(batches[2:] for batches in runs)
    resumed = [plan_rank(ranks, r, resumed_on, state=state, dataset=dataset)[2] for r in range(resumed_on)]
    assert len({len(b) for b in resumed}) == 1, "every rank gets the same number of batches"
    got = samples(resumed)
    pad = -sum(rest.values()) % resumed_on  # DistributedSampler's rule: repeat the head
    assert set(got) == set(rest) and all(got[i] >= rest[i] for i in rest)
    assert sum(got.values()) - sum(rest.values()) == pad
    assert len(resumed[0]) == -(-(sum(rest.values()) + pad) // resumed_on // BATCH)


def test_with_drop_last_the_tail_of_the_rest_is_cut_and_nothing_repeats(ranks):
    runs, state = save_after(ranks, 4, 1, drop_last=True)
    rest = samples(batches[1:] for batches in runs)  # 48 - 8 = 40 samples
    resumed = [plan_rank(ranks, r, 3, state=state, drop_last=True)[2] for r in range(3)]
    got = samples(resumed)
    assert max(got.values()) == 1 and set(got) <= set(rest)
    assert [len(b) for b in resumed] == [6, 6, 6]  # 40 // 3 = 13 samples each, in 6 full batches
    assert all(len(batch) == BATCH for batches in resumed for batch in batches)


def test_a_state_saved_on_the_new_world_after_a_resume_resumes_again_anywhere(ranks):
    runs, state = save_after(ranks, 4, 2)
    on_two = [plan_rank(ranks, r, 2, state=state)[2] for r in range(2)]
    planner, progress, _ = plan_rank(ranks, 0, 2, state=state)
    for seq in range(3):
        progress.delivered.add(seq)
    again = planner.state_dict(1, progress)
    assert again["progress"]["segments"] == [[4, 2, []]] and again["config"]["world_size"] == 2
    rest = samples(batches[3:] for batches in on_two)
    for world in (3, 2, 1):
        resumed = [plan_rank(ranks, r, world, state=again)[2] for r in range(world)]
        got = samples(resumed)
        assert set(got) == set(rest) and sum(got.values()) == sum(rest.values()) + (-sum(rest.values()) % world)


def test_batches_in_flight_when_saved_out_of_order_are_made_again(ranks):
    runs, _ = save_after(ranks, 4, 0)
    planner, progress, _ = plan_rank(ranks, 0, 4)
    for seq in (0, 1, 3):  # batch 2 was still in flight (in_order=False)
        progress.delivered.add(seq)
    state = planner.state_dict(1, progress)
    rest = samples([b for seq, b in enumerate(batches) if seq not in (0, 1, 3)] for batches in runs)
    got = samples(plan_rank(ranks, r, 2, state=state)[2] for r in range(2))
    assert got == rest  # 48 - 4 * 3 * 2 = 24 samples: no padding on two ranks


def test_the_epochs_after_an_elastic_resume_are_what_the_new_world_gives(ranks):
    _, state = save_after(ranks, 4, 2)
    for r in range(3):
        planner, _, _ = plan_rank(ranks, r, 3, state=state)
        plan, _ = planner.plan(1, None, False)
        fresh = plan_rank(ranks, r, 3, epoch=1)[2]
        assert [list(b) for _, b in plan.batches] == fresh, f"rank {r}"


def test_per_sample_seeds_survive_the_resplit(ranks):
    _, state = save_after(ranks, 4, 2)
    _, progress, _ = plan_rank(ranks, 1, 2, state=state)
    assert progress.base_seed == state["progress"]["base_seed"] == derive_seed(5, 0, 1)


def test_a_saved_position_is_checked_against_its_own_world_size(ranks):
    _, state = save_after(ranks, 4, 2)
    state["progress"]["delivered"]["below"] = 7  # an epoch has 6 batches per rank on 4 ranks
    ranks(0, 2)
    fresh = make_planner(LENGTH, BATCH, shuffle=True, seed=5)
    with pytest.raises(ValueError, match=r"progress.delivered.below must be an int in \[0, 6\] \(that part of "
                                         r"the epoch has 6 batches on 4 ranks\), got 7"):
        fresh.load(state)


def test_segments_are_checked_when_loaded(ranks):
    _, state = save_after(ranks, 4, 2)
    planner, progress, _ = plan_rank(ranks, 0, 2, state=state)
    progress.delivered.add(0)
    again = planner.state_dict(1, progress)
    ranks(0, 2)
    fresh = make_planner(LENGTH, BATCH, shuffle=True, seed=5)
    bad = {**again, "progress": {**again["progress"], "segments": [[4, 9, []]]}}
    with pytest.raises(ValueError, match=r"progress.segments\[0\]\[1\] must be an int in \[0, 6\]"):
        fresh.load(bad)
    bad = {**again, "progress": {**again["progress"], "segments": [[0, 1, []]]}}
    with pytest.raises(ValueError, match=r"progress.segments\[0\]\[0\] must be an int in \[1, 2147483647\], got 0"):
        fresh.load(bad)
    plain = make_planner(LENGTH, BATCH, seed=5, sampler=torch.utils.data.SequentialSampler(range(LENGTH)))
    with pytest.raises(ValueError, match=r"progress.segments must be empty: this loader's order"):
        plain.load({**again, "config": plain.config(), "progress": again["progress"]})


def test_a_state_naming_a_huge_world_is_checked_in_the_time_of_its_epoch(ranks):
    # A few bytes of state (issue 32 item 7): a part of the epoch run on 2**31 - 1 ranks. The
    # rest of the epoch is computed without a loop over ranks, so loading answers at once.
    _, state = save_after(ranks, 4, 2)
    huge = 2**31 - 1
    ranks(0, 2)
    fresh = make_planner(LENGTH, BATCH, shuffle=True, seed=5)
    # batch 0 on every one of those ranks covered the whole epoch: nothing is left for the 4
    # ranks that saved the state, so their 2 delivered batches cannot be
    late = {**state, "progress": {**state["progress"], "segments": [[huge, 1, []]]}}
    with pytest.raises(ValueError, match=r"progress.delivered.below must be an int in \[0, 0\] \(that part of "
                                         r"the epoch has 0 batches on 4 ranks\), got 2"):
        fresh.load(late)
    # on those ranks, nothing delivered: what is left is the whole epoch, dealt over 4 then 2
    early = {**state, "config": {**state["config"], "world_size": huge},
             "progress": {**state["progress"], "delivered": {"below": 0, "also": [5]}}}
    with pytest.raises(ValueError, match=rf"progress.delivered.also must be empty after 0 batches \(that part of "
                                         rf"the epoch has 1 batches on {huge} ranks\), got \[5\]"):
        fresh.load(early)
    early["progress"]["delivered"] = {"below": 0, "also": []}
    plan, _ = fresh.plan(0, fresh.load(early), False)
    assert samples([[b for _, b in plan.batches]]) == samples([plan_rank(ranks, 0, 2)[2]])


def test_world_sizes_and_parts_of_an_epoch_are_bounded(ranks):
    _, state = save_after(ranks, 4, 2)
    ranks(0, 2)
    fresh = make_planner(LENGTH, BATCH, shuffle=True, seed=5)
    for where, bad in ((("config", "world_size"), 2**31), (("progress", "segments"), [[2**31, 1, []]])):
        edited = {**state, where[0]: {**state[where[0]], where[1]: bad}}
        with pytest.raises(ValueError, match=r"(config.world_size|progress.segments\[0\]\[0\]) must be an int in "
                                             r"\[1, 2147483647\], got 2147483648"):
            fresh.load(edited)
    # a part of the epoch that delivered nothing is never saved: a state is at most one part a sample
    empty = {**state, "progress": {**state["progress"], "segments": [[3, 0, []]] * 10**5}}
    with pytest.raises(ValueError, match=r"progress.segments\[0\] delivers no batch: a part of the epoch is saved "
                                         r"only once it delivered one"):
        fresh.load(empty)


# ----------------------------------------------------------------------------- the pure parts
def test_remainder_counts_a_padded_position_delivered_if_either_slot_was():
    deal = Deal(3, batch_size=2)  # 7 positions, 3 per rank, position 0 and 1 padded onto ranks 1, 2
    # rank 0: 0 3 6 | rank 1: 1 4 0 | rank 2: 2 5 1 ; batch 0 of each: (0 3) (1 4) (2 5)
    assert remainder(7, deal, Segment(3, 1)).tolist() == [6]
    assert remainder(7, deal, Segment(3, 0)).tolist() == list(range(7))


@pytest.mark.parametrize("kind", ["stride", "blocks"])
def test_a_world_larger_than_the_sequence_is_computed_as_one_rank_a_position(kind):
    # 2**31 - 1 ranks of one slot each: the same positions as 20 ranks (no loop over ranks)
    for low in (0, 1):
        huge = remainder(20, Deal(2**31 - 1, 4, kind=kind), Segment(2**31 - 1, low))
        assert huge.tolist() == remainder(20, Deal(20, 4, kind=kind), Segment(20, low)).tolist()
        assert huge.tolist() == ([] if low else list(range(20)))
    assert remainder(20, Deal(2**31 - 1, 4, drop_last=True, kind=kind), Segment(2**31 - 1, 0)).tolist() == []


@pytest.mark.parametrize("blocks_as", ["runs", "marks"])
def test_remainder_is_what_each_ranks_positions_leave(blocks_as, monkeypatch):
    """Against the ranks one by one (Deal.positions): dealt into a batch, and no slot of the
    position delivered. Ranks holding blocks are computed as runs of slots or slot by slot."""
    monkeypatch.setattr(elastic, "_RANK_RUNS", 10**9 if blocks_as == "runs" else 0)
    cases = [(length, Deal(world, batch, drop_last, kind), Segment(world, low, above))
             for length in (0, 1, 7, 23) for world in (1, 3, 8, 30) for batch in (1, 2, 5)
             for drop_last in (False, True) for kind in ("stride", "blocks") for low, above in ((0, ()), (1, (2,)))]
    for length, deal, segment in cases:
        dealt, seen = set(), set()
        kept = deal.kept(length)
        for rank in range(deal.world_size):
            for place, position in enumerate(deal.positions(length, rank).tolist()[:kept]):
                dealt.add(position)
                if place // deal.batch_size < segment.low or place // deal.batch_size in segment.above:
                    seen.add(position)
        assert remainder(length, deal, segment).tolist() == sorted(dealt - seen), (length, deal, segment)


def test_rest_of_epoch_applies_segments_in_turn():
    deal_for = lambda w: Deal(w, batch_size=1)  # noqa: E731
    rest = rest_of_epoch(12, [Segment(4, 1), Segment(2, 2)], deal_for)
    # 4 ranks deliver positions 0-3; the rest (4..11) on 2 ranks: rank 0 4 6 8 10, rank 1 5 7 9 11
    assert rest.tolist() == [8, 9, 10, 11]


def _reference_rest(length, segments, deal_for):
    """Segments applied one by one over every rank's places (Deal.positions), position by position."""
    rest = list(range(length))
    for segment in segments:
        deal = deal_for(segment.world_size)
        n, kept = len(rest), deal.kept(len(rest))
        dealt, seen = set(), set()
        for rank in range(min(deal.world_size, max(n, 1))):
            for place, position in enumerate(deal.positions(n, rank).tolist()[:kept]):
                dealt.add(position)
                if place // deal.batch_size < segment.low or place // deal.batch_size in segment.above:
                    seen.add(position)
        rest = [rest[i] for i in sorted(dealt - seen)]
    return rest


@pytest.mark.parametrize("rest_as", ["pieces", "positions"])
@pytest.mark.parametrize("kind", ["stride", "blocks"])
def test_segments_applied_as_pieces_leave_what_each_ranks_positions_leave(kind, rest_as, monkeypatch):
    # what is left kept as pieces throughout, or as positions from the start
    monkeypatch.setattr(elastic, "_PIECE_COST", 0 if rest_as == "pieces" else 10**9)
    rng = np.random.default_rng(32)
    for case in range(300):
        length = int(rng.integers(0, 120))
        batch, drop_last = int(rng.integers(1, 5)), bool(rng.integers(2))
        deal_for = lambda w: Deal(w, batch, drop_last, kind)  # noqa: E731, B023
        segments, left = [], length
        for _ in range(int(rng.integers(1, 6))):
            world = int(rng.integers(1, 9))
            batches = deal_for(world).batches(left)
            if batches == 0:
                break
            low = int(rng.integers(0, batches))
            above = tuple(sorted(set(rng.integers(low + 1, batches + 1, size=int(rng.integers(0, 3))).tolist())
                                 - {batches}))
            if not low and not above:
                low = 1
            segments.append(Segment(world, low, above))
            left = len(_reference_rest(length, segments, deal_for))
        got = rest_of_epoch(length, segments, deal_for).tolist()
        assert got == _reference_rest(length, segments, deal_for), (case, length, batch, drop_last, segments)


def test_thousands_of_segments_are_applied_as_pieces():
    # each part of the epoch delivered one batch of one sample per rank: the first `world`
    # positions of what was left (the padding repeats them), so what is left is a tail
    worlds = [2 + i % 3 for i in range(5000)]
    segments = [Segment(w, 1) for w in worlds]
    rest = rest_of_epoch(100_000, segments, lambda w: Deal(w, 1))
    assert torch.equal(rest, torch.arange(sum(worlds), 100_000))


def test_a_state_cutting_the_rest_into_too_many_pieces_is_refused(ranks, monkeypatch):
    # ranks holding blocks of 2 deliver one sample each: the rest is every other position, 24
    # pieces; the budget (lowered here to one for each of the 48 positions) is passed by the parts after
    ranks(0, 24)
    planner = make_planner(LENGTH, 1, shuffle=True, seed=5, dataset=Blocks(LENGTH))
    plan, progress = planner.plan(0, None, False)
    progress.delivered.add(0)
    state = planner.state_dict(1, progress)
    state["progress"]["segments"] = [[24, 1, []]] + [[1, 1, []]] * 20
    state["progress"]["delivered"] = {"below": 0, "also": []}
    monkeypatch.setattr(elastic, "WORK_MAX", 0)
    monkeypatch.setattr(elastic, "WORK_PER_POSITION", 1)
    ranks(0, 2)
    fresh = make_planner(LENGTH, 1, shuffle=True, seed=5, dataset=Blocks(LENGTH))
    with pytest.raises(ValueError, match=r"progress.segments\[\d+\] cuts what is left of epoch 0 more finely than "
                                         r"a run resumed on other numbers of ranks does \([\d,]+ pieces and "
                                         r"positions handled, past a budget of 48\)"):
        fresh.load(state)
    monkeypatch.undo()
    plan, _ = fresh.plan(0, fresh.load(state), False)  # within the real budget it loads
    assert len(list(plan.batches)) == 2  # 24 - 20 samples left, over 2 ranks


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset that shards itself by rank, as torch asks of one."""

    def __iter__(self):
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank, 12, world))


def test_an_iterable_datasets_position_restarts_its_epoch_on_the_new_world(ranks):
    import aioload
    from aioload._plan.resume import ResumeWarning

    ranks(1, 2)
    with aioload.DataLoader(Stream(), batch_size=2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        del it
    assert state["stateful"]["world_size"] == 2 and state["config"]["world_size"] is None
    import torch.distributed as dist

    dist.destroy_process_group()
    with aioload.DataLoader(Stream(), batch_size=2) as loader:
        loader.load_state_dict(state)
        with pytest.warns(ResumeWarning, match="resumes epoch 0 from its start, not from where it was saved: it "
                                               "was saved on 2 ranks and this loader runs on 1"):
            assert [b.tolist() for b in loader] == [[i, i + 1] for i in range(0, 12, 2)]  # one process: all of it
