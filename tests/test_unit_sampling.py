"""The epoch plan (:mod:`aioload._plan.sampling`): index order, seeds, rank shards and resume skipping.

# unit tests: no worker process

Each test builds a :class:`~aioload._plan.sampling.Planner` over a plain torch ``DataLoader`` the
way ``aioload.DataLoader`` does (its ``shard_sampler`` in place of torch's default sampler)
and reads the plan's numbered batches directly. torch's own samplers and DataLoader are the
reference wherever an order must equal theirs. Rank shards under ``torch.distributed`` use
torch's in-process fake process group, so one process can be rank ``r`` of ``W``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from aioload._plan.sampling import Planner, ShardByRank, ShardSampler, distributed_rank, shard_sampler
from aioload._base.seeding import derive_seed

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds


# ----------------------------------------------------------------------------- helpers
def make_planner(length=10, batch_size=3, *, shuffle=False, drop_last=False, seed=None, generator=None,
                 sampler=None, batch_sampler=None, dataset=None, num_workers=0, persistent_workers=False):
    """A Planner over a torch DataLoader built as ``aioload.DataLoader`` builds its own."""
    dataset = range(length) if dataset is None else dataset
    seed_generator = torch.Generator() if seed is not None else None
    gen = generator if seed is None else seed_generator
    shard = shard_sampler(True, dataset, sampler, batch_sampler, shuffle, drop_last, seed, gen)
    if shard is not None:
        sampler, shuffle = shard, None
    if batch_sampler is not None:
        batch_size, drop_last = 1, False  # torch's rule: batch_sampler excludes both
    torch_loader = TorchDataLoader(dataset, batch_size, shuffle, sampler, batch_sampler,
                                   num_workers, drop_last=drop_last, generator=gen,
                                   persistent_workers=persistent_workers)
    return Planner(torch_loader, seed, seed_generator, iterable=False)


def batches(planner, epoch=0, resume=None, per_sample=False):
    plan, _ = planner.plan(epoch, resume, per_sample)
    return list(plan.batches)


def indices_of(numbered):
    return [list(b) for _, b in numbered]


def chunks(order, size, drop_last=False):
    out = [order[i : i + size] for i in range(0, len(order), size)]
    return out[:-1] if drop_last and out and len(out[-1]) < size else out


@pytest.fixture
def ranks():
    """``rank_of(rank, world)``: this process becomes that rank of torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def rank_of(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield rank_of
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- index order
@pytest.mark.parametrize("drop_last", [False, True])
def test_without_shuffle_batches_are_numbered_in_dataset_order(drop_last):
    got = batches(make_planner(10, 3, drop_last=drop_last))
    expected = chunks(list(range(10)), 3, drop_last)
    assert [seq for seq, _ in got] == list(range(len(expected)))
    assert indices_of(got) == expected
    assert len(got) == (3 if drop_last else 4)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_order_and_base_seeds_equal_torchs_for_the_same_generator(drop_last):
    ours = make_planner(11, 4, shuffle=True, drop_last=drop_last, generator=torch.Generator().manual_seed(7))
    theirs = TorchDataLoader(range(11), 4, shuffle=True, drop_last=drop_last,
                             generator=torch.Generator().manual_seed(7))
    for epoch in range(3):
        plan, _ = ours.plan(epoch, None, False)
        it = iter(theirs)
        expected = [b.tolist() for b in it]
        assert indices_of(plan.batches) == expected, f"epoch {epoch}"
        assert plan.base_seed == it._base_seed, f"epoch {epoch}"
    flat = sum(expected, [])
    assert len(set(flat)) == len(flat) == (8 if drop_last else 11)


def test_shuffled_order_from_the_global_rng_equals_torchs():
    ours = make_planner(9, 2, shuffle=True)
    torch.manual_seed(123)
    plan, _ = ours.plan(0, None, False)
    got, base = indices_of(plan.batches), plan.base_seed
    torch.manual_seed(123)
    it = iter(TorchDataLoader(range(9), 2, shuffle=True))
    assert got == [b.tolist() for b in it]
    assert base == it._base_seed


def test_seed_makes_each_epoch_a_function_of_seed_and_epoch_only():
    def epoch_of(seed, epoch):
        torch.manual_seed(epoch * 1000 + 17)  # the global RNG must not matter
        plan, _ = make_planner(20, 5, shuffle=True, seed=seed).plan(epoch, None, True)
        return indices_of(plan.batches), plan.base_seed, plan.per_sample_seeds

    first = epoch_of(3, 0)
    assert epoch_of(3, 0) == first
    assert first[1] == derive_seed(3, 0, 1) and first[2] is True
    assert epoch_of(3, 1)[0] != first[0], "another epoch must shuffle differently"
    assert epoch_of(4, 0)[0] != first[0], "another seed must shuffle differently"
    assert sorted(sum(first[0], [])) == list(range(20))
    # one planner going through epochs gives what a fresh one gives for each epoch
    planner = make_planner(20, 5, shuffle=True, seed=3)
    assert [indices_of(batches(planner, e)) for e in range(3)] == [epoch_of(3, e)[0] for e in range(3)]


def test_persistent_workers_draw_one_base_seed_and_derive_the_later_ones():
    gen = torch.Generator().manual_seed(21)
    planner = make_planner(6, 2, generator=gen, num_workers=2, persistent_workers=True)
    first = batches_and_base(planner, 0)[1]
    assert first == int(torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(21)))
    state = gen.get_state()
    assert [batches_and_base(planner, e)[1] for e in (1, 2)] == [derive_seed(first, 1), derive_seed(first, 2)]
    assert torch.equal(gen.get_state(), state), "later epochs draw nothing from the generator"
    per_epoch = make_planner(6, 2, generator=torch.Generator().manual_seed(21), num_workers=2)
    bases = [batches_and_base(per_epoch, e)[1] for e in range(2)]
    assert bases[0] == first and bases[1] != derive_seed(first, 1), "without persistence: a draw per epoch"


def batches_and_base(planner, epoch):
    plan, _ = planner.plan(epoch, None, False)
    return list(plan.batches), plan.base_seed


def test_seed_without_shuffle_keeps_dataset_order():
    assert indices_of(batches(make_planner(7, 3, seed=5), 2)) == chunks(list(range(7)), 3)


def test_a_batch_sampler_is_planned_as_given():
    groups = [[4, 1], [0], [2, 3, 5]]
    got = batches(make_planner(6, batch_sampler=groups))
    assert got == list(enumerate(groups))


# ----------------------------------------------------------------------------- resume
def _save_after(planner, epoch, delivered):
    """Plan ``epoch``, pull every batch, mark ``delivered`` received, and save the state."""
    plan, progress = planner.plan(epoch, None, False)
    pulled = list(plan.batches)
    for seq in delivered:
        progress.delivered.add(seq)
    return pulled, planner.state_dict(epoch + 1, progress)


@pytest.mark.parametrize("delivered", [[0, 1], [0, 2, 3], [1], []])
def test_a_resumed_epoch_skips_exactly_the_delivered_batches(delivered):
    saved = make_planner(17, 3, shuffle=True, generator=torch.Generator().manual_seed(1))
    batches(saved, 0)  # the saved run is in its second epoch
    pulled, state = _save_after(saved, 1, delivered)
    assert state["epoch"] == 1
    fresh = make_planner(17, 3, shuffle=True, generator=torch.Generator().manual_seed(99))
    resume = fresh.load(state)
    plan, _ = fresh.plan(resume["epoch"], resume, False)
    assert list(plan.batches) == [(seq, b) for seq, b in pulled if seq not in delivered]
    assert set(plan.delivered.above) | set(range(plan.delivered.low)) == set(delivered)


def test_a_state_saved_between_epochs_starts_the_next_epoch_as_the_saved_run_would():
    saved = make_planner(8, 3, shuffle=True, generator=torch.Generator().manual_seed(4))
    batches(saved, 0)
    state = saved.state_dict(1, None)
    following = batches(saved, 1)
    fresh = make_planner(8, 3, shuffle=True, generator=torch.Generator().manual_seed(5))
    resume = fresh.load(state)
    assert resume["epoch"] == 1
    assert batches(fresh, 1, resume) == following


class _Drawing(Sampler[int]):
    """A sampler aioload cannot replay: its order comes from Python's ``random``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


def test_a_sampler_that_cannot_be_replayed_resumes_from_its_written_out_batches():
    random.seed(0)
    saved = make_planner(10, 3, sampler=_Drawing(10))
    pulled, state = _save_after(saved, 0, [0, 2])
    assert state["progress"]["batches"] is not None, "the rest of the epoch must be written out"
    random.seed(1)  # the sampler would now draw another order
    fresh = make_planner(10, 3, sampler=_Drawing(10))
    resume = fresh.load(state)
    assert batches(fresh, 0, resume) == [(seq, b) for seq, b in pulled if seq not in (0, 2)]


# ----------------------------------------------------------------------------- rank shards
CASES = [  # (length, world size, shuffle, drop_last, epoch)
    (10, 3, False, False, 0), (10, 3, False, True, 0), (10, 3, True, False, 2), (10, 3, True, True, 1),
    (2, 4, False, False, 0), (2, 4, True, False, 3), (3, 4, False, True, 0), (16, 4, True, False, 0),
    (1, 1, True, False, 5), (7, 2, True, True, 4), (0, 2, False, False, 0),
]


@pytest.mark.parametrize("length,world,shuffle,drop_last,epoch", CASES)
def test_shards_equal_distributed_samplers(length, world, shuffle, drop_last, epoch):
    seed = 11
    # DistributedSampler seeds its permutation with seed + epoch; aioload with derive_seed(seed, epoch)
    theirs_seed = derive_seed(seed, epoch) - epoch
    shards = []
    for rank in range(world):
        ours = ShardSampler(length, rank, world, shuffle=shuffle, drop_last=drop_last, seed=seed)
        ours.set_epoch(epoch)
        theirs = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=shuffle,
                                    seed=theirs_seed, drop_last=drop_last)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs), f"rank {rank}"
        assert len(ours) == len(theirs)
        shards.append(list(ours))
    assert len({len(s) for s in shards}) <= 1, "every rank gets a shard of the same length"
    flat = sum(shards, [])
    if drop_last:
        assert len(set(flat)) == len(flat), "with drop_last no index is loaded twice"
    elif length:
        assert set(flat) == set(range(length)), "without drop_last every index is loaded"


def test_shard_order_is_one_permutation_per_epoch_cut_between_ranks():
    world, length = 3, 8
    for epoch in range(3):
        gen = torch.Generator().manual_seed(derive_seed(2, epoch))
        order = torch.randperm(length, generator=gen).tolist()
        padded = order + order[: 9 - length]
        for rank in range(world):
            s = ShardSampler(length, rank, world, shuffle=True, drop_last=False, seed=2)
            s.set_epoch(epoch)
            assert list(s) == padded[rank::world]


def test_shard_by_rank_without_distributed_is_torchs_own_sampler():
    assert distributed_rank() is None
    data = range(12)
    ours = ShardByRank(data, shuffle=True, drop_last=False, seed=None, generator=torch.Generator().manual_seed(8))
    assert ours.world_size == 1 and len(ours) == 12
    assert type(ours.active()) is RandomSampler
    reference = RandomSampler(data, generator=torch.Generator().manual_seed(8))
    assert [list(ours) for _ in range(2)] == [list(reference) for _ in range(2)]
    plain = ShardByRank(data, shuffle=False, drop_last=True, seed=None, generator=None)
    assert type(plain.active()) is SequentialSampler and list(plain) == list(range(12))


def test_shard_by_rank_decides_the_world_each_time_it_is_iterated(ranks):
    data = range(10)
    sampler = ShardByRank(data, shuffle=True, drop_last=False, seed=6, generator=torch.Generator().manual_seed(0))
    planner = make_planner(10, 2, shuffle=True, seed=6)
    assert planner.world_size() == 1 and sampler.world_size == 1 and len(sampler) == 10
    ranks(1, 3)  # init_process_group after the sampler and the loader were made
    sampler.set_epoch(2)
    expected = ShardSampler(10, 1, 3, shuffle=True, drop_last=False, seed=6)
    expected.set_epoch(2)
    assert sampler.world_size == 3 and len(sampler) == 4
    assert list(sampler) == list(expected)
    assert planner.world_size() == 3
    for epoch in range(2):
        expected.set_epoch(epoch)
        assert indices_of(batches(planner, epoch)) == chunks(list(expected), 2), f"epoch {epoch}"
    ranks(0, 2)  # another world: the shard follows it
    assert len(sampler) == 5 and sampler.active().rank == 0 and sampler.active().world_size == 2


def test_a_state_whose_order_the_ranks_cannot_compute_does_not_resume_another_world_size(ranks):
    planner = make_planner(10, 2, shuffle=True, generator=torch.Generator().manual_seed(3))
    _, state = _save_after(planner, 0, [0])  # one process, shuffled by RandomSampler's own draws
    assert state["progress"]["order_seed"] is None
    ranks(0, 2)
    fresh = make_planner(10, 2, shuffle=True, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"world_size=1, but this loader runs with world_size=2, and its "
                                         r"epoch was shuffled by torch's RandomSampler .* pass seed="):
        fresh.load(state)


def test_a_users_distributed_sampler_does_not_resume_another_world_size():
    saved = make_planner(12, 2, sampler=DistributedSampler(range(12), num_replicas=2, rank=0, seed=1))
    _, state = _save_after(saved, 0, [0])
    fresh = make_planner(12, 2, sampler=DistributedSampler(range(12), num_replicas=3, rank=0, seed=1))
    with pytest.raises(ValueError, match="world_size=2, but this loader runs with world_size=3"):
        fresh.load(state)


def test_shard_sampler_is_used_only_where_aioload_chooses_the_sampler():
    data = range(5)
    assert isinstance(shard_sampler(True, data, None, None, True, False, None, None), ShardByRank)
    assert shard_sampler(False, data, None, None, True, False, None, None) is None
    assert shard_sampler(True, data, SequentialSampler(data), None, None, False, None, None) is None
    assert shard_sampler(True, data, None, [[0, 1]], None, False, None, None) is None

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert shard_sampler(True, Stream(), None, None, None, False, None, None) is None
    with pytest.raises(TypeError, match=r"^shard must be True or False, got 1$"):
        shard_sampler(1, data, None, None, None, False, None, None)


def test_planner_reports_no_world_size_for_a_sampler_of_the_users():
    assert make_planner(6, 2, sampler=SequentialSampler(range(6))).world_size() is None
    user = DistributedSampler(range(6), num_replicas=3, rank=0)
    assert make_planner(6, 2, sampler=user).world_size() == 3


def test_generators_saved_are_the_loaders_and_the_samplers():
    gen = torch.Generator().manual_seed(1)
    assert make_planner(6, 2, shuffle=True, generator=gen).generators() == {"loader": gen}
    assert make_planner(6, 2, shuffle=True, seed=3).generators() == {}, "seed= reseeds its generator per epoch"
    own = torch.Generator()
    found = make_planner(6, 2, sampler=RandomSampler(range(6), generator=own)).generators()
    assert found == {"loader": None, "sampler": own}
    assert list(itertools.islice(found, 2)) == ["loader", "sampler"]
