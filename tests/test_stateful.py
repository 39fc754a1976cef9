"""The Stateful protocol: an IterableDataset (or its iterator) with ``state_dict()`` /
``load_state_dict()`` has its state captured in each worker with every batch, saved by
``loader.state_dict()`` as of the last batch delivered, and given back to each worker before it
yields anything; one without resumes by fast-forwarding. Real worker processes throughout."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import aioload
from aioload._plan.resume import ResumeWarning
from aioload._plan.stateful import FastForwardWarning
from tests.stateful_data import Counted, Epoched, RandomWalk, Uneven, identity, worker_slice

SIZES = [0, 100, 37]  # uneven, one worker empty

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def make(dataset, **kwargs):
    kwargs.setdefault("collate_fn", identity)
    return aioload.DataLoader(dataset, **kwargs)


def saved(state: dict) -> dict:
    """What a checkpoint keeps: ``torch.save`` and a full load (the dataset's states may hold tensors)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def interrupted(factory, k: int, epochs_before: int = 0):
    """``(batches before the save, state)``: ``epochs_before`` whole epochs, then ``k`` batches."""
    with factory() as loader:
        head = [b for _ in range(epochs_before) for b in loader]
        it = iter(loader)
        head += [next(it) for _ in range(k)]
        return head, saved(loader.state_dict())


def resumed(factory, state, epochs: int = 1):
    with factory() as loader:
        loader.load_state_dict(state)
        return [b for _ in range(epochs) for b in loader]


@pytest.mark.parametrize("batch_size", [None, 4])
@pytest.mark.parametrize("k", [0, 1, 7, 60])
def test_a_stateful_iterable_resumes_exactly_with_uneven_workers(batch_size, k):
    def factory():
        return make(Counted(SIZES), num_workers=3, batch_size=batch_size)

    with factory() as loader:
        full = list(loader)
    assert full == list(torch.utils.data.DataLoader(Counted(SIZES), num_workers=3, batch_size=batch_size,
                                                    collate_fn=identity))
    head, state = interrupted(factory, min(k, len(full)))
    if k:  # at k=0 the state is the epoch's start, with nothing of the copies
        assert state["stateful"]["num_workers"] == 3
        assert state["stateful"]["workers"]["worker_1"]["dataset_state"]["position"] > 0
    assert head + resumed(factory, state) == full


def test_every_step_is_a_snapshot_however_far_the_workers_ran_ahead():
    # the state after batch k is that of batch k, not of what the workers made meanwhile
    with make(Counted([50, 50]), num_workers=2, batch_size=2, queue_depth=8) as loader:
        states = []
        for batch in loader:
            states.append((batch, loader.state_dict()))
    for batch, state in states[:20]:
        records = state["stateful"]["workers"]
        (last, _), wid = batch[-1], (batch[-1][0] >= 50)
        assert records[f"worker_{int(wid)}"]["dataset_state"]["position"] == last - 50 * wid + 1


def test_torchdatas_snapshot_every_n_steps_is_accepted_and_every_step_is_still_a_snapshot():
    # code written for torchdata's StatefulDataLoader passes it; aioload snapshots every batch anyway
    with make(Counted([20]), num_workers=1, batch_size=2, snapshot_every_n_steps=5) as loader:
        assert loader.snapshot_every_n_steps == 5
        for i, batch in enumerate(loader):
            assert loader.state_dict()["stateful"]["workers"]["worker_0"]["dataset_state"]["position"] == 2 * i + 2
    assert make(Counted([4]), snapshot_every_n_steps=None).snapshot_every_n_steps is None
    with pytest.raises(ValueError, match=r"^snapshot_every_n_steps must be >= 1, got 0$"):
        make(Counted([4]), snapshot_every_n_steps=0)
    with pytest.raises(TypeError, match=r"^snapshot_every_n_steps must be an int >= 1, got 2.5$"):
        make(Counted([4]), snapshot_every_n_steps=2.5)


@pytest.mark.parametrize("in_order", [True, False])
def test_persistent_workers_resume_mid_epoch_across_epochs_and_twice(in_order):
    def factory():
        return make(Counted(SIZES), num_workers=3, batch_size=4, persistent_workers=True, in_order=in_order)

    with factory() as loader:
        full = [b for _ in range(3) for b in loader]  # each epoch's items carry its epoch number
    assert {epoch for b in full for _, epoch in b} == {0, 1, 2}
    head, first = interrupted(factory, 5, epochs_before=1)
    with factory() as loader:  # a resumed run, saved again mid-epoch
        loader.load_state_dict(first)
        it = iter(loader)
        middle = [next(it) for _ in range(3)]
        second = saved(loader.state_dict())
    rest = resumed(factory, second, epochs=2)
    got = head + middle + rest
    if in_order:
        assert got == full
    else:  # any interleaving of the workers, each worker's items in its own order, nothing twice
        assert sorted(i for b in got for i in b) == sorted(i for b in full for i in b)
        for low, high in ((0, 100), (100, 137)):
            mine = [i for b in got for i in b if low <= i[0] < high]
            assert mine == sorted(mine, key=lambda item: (item[1], item[0]))


def test_between_epochs_the_copies_states_carry_to_the_next_epoch():
    def factory():
        return make(Counted([3, 4]), num_workers=2, persistent_workers=True)

    with factory() as loader:
        full = [b for _ in range(2) for b in loader]
    with factory() as loader:
        list(loader)
        end_of_first = saved(loader.state_dict())
    assert end_of_first["progress"] is None
    assert resumed(factory, end_of_first) == full[len(full) // 2:]  # epoch 1's items, numbered 1


def test_in_process_the_dataset_itself_is_resumed():
    def factory():
        return make(Counted([37]), batch_size=5)

    with factory() as loader:
        full = list(loader)
    head, state = interrupted(factory, 3)
    assert state["stateful"]["num_workers"] == 0
    assert state["stateful"]["workers"]["worker_0"]["dataset_state"] == {"position": 15, "epoch": 0}
    assert head + resumed(factory, state) == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_holding_tensors_resumes_the_iterators_random_draws(num_workers):
    def factory():
        torch.manual_seed(5)  # in process, the walk draws from torch's global RNG: the same at each start
        return make(RandomWalk(30), num_workers=num_workers, generator=torch.Generator().manual_seed(3))

    with factory() as loader:
        full = list(loader)
    head, state = interrupted(factory, 9)
    record = state["stateful"]["workers"]["worker_0"]
    assert record["dataset_state"] is None  # the dataset is its own iterator: saved once, as torchdata does
    assert isinstance(record["fetcher_state"]["dataset_iter_state"]["rng"], torch.Tensor)
    assert head + resumed(factory, state) == full


def test_without_a_state_the_copies_are_fast_forwarded_and_the_cost_named():
    def factory():
        return make(Uneven(SIZES), num_workers=3, batch_size=4)

    with factory() as loader:
        full = list(loader)
    head, state = interrupted(factory, 9)
    assert state["stateful"]["taken"] == [0, 20, 16]
    with factory() as loader:
        loader.load_state_dict(state)
        with pytest.warns(FastForwardWarning, match=r"drops the items it delivered before the save, 36 in all "
                                                    r"\(worker 1: 20, worker 2: 16\)"):
            rest = list(loader)
    assert head + rest == full


def test_another_number_of_workers_restarts_the_epoch_with_a_warning():
    head, state = interrupted(lambda: make(Counted([10, 10, 10]), num_workers=3), 5)
    with make(Counted([10, 10, 10]), num_workers=2) as loader:
        whole = list(loader)
    with make(Counted([10, 10, 10]), num_workers=2) as loader:
        loader.load_state_dict(state)
        with pytest.warns(ResumeWarning, match=r"saved with num_workers=3 and this loader has num_workers=2"):
            batches = list(loader)
    assert batches == whole  # the whole epoch again, as 2 workers load it


def test_the_state_is_checked_at_load():
    _, state = interrupted(lambda: make(Counted(SIZES), num_workers=3), 5)
    state["stateful"]["workers"]["worker_2"]["worker_id"] = 7
    with make(Counted(SIZES), num_workers=3) as loader:
        with pytest.raises(ValueError, match=r"^cannot load this state: stateful.workers.worker_2.worker_id must "
                                             r"be 2, got 7; pass what loader.state_dict\(\) returned$"):
            loader.load_state_dict(state)


TURNS = [9, 4, 0, 13]  # in batches of 2: workers run out after 5, 2, 0 and 7 batches (two partial)


def test_every_state_of_an_epoch_in_turn_resumes_exactly_and_says_so():
    # next_worker is cross-checked against taken where the batches came in turn: no real state
    # may be refused by that, at any step (workers running out at different points included)
    def factory():
        return make(Counted(TURNS), num_workers=4, batch_size=2)

    with factory() as loader:
        full = list(loader)
    assert len(full) == 14
    for k in range(len(full) + 1):
        head, state = interrupted(factory, k)
        assert k == 0 or state["stateful"]["in_order"] is True
        assert head + resumed(factory, state) == full, k


def test_a_next_worker_that_is_not_the_turn_taken_says_is_refused():
    def factory():
        return make(Counted(TURNS), num_workers=4, batch_size=2)

    _, state = interrupted(factory, 6)  # rounds 0 1 3 | 0 1 3: worker 2 ran out with nothing
    assert state["stateful"]["taken"] == [4, 4, 0, 4] and state["stateful"]["next_worker"] == 0
    swapped = dict(state, stateful=dict(state["stateful"], next_worker=1))
    with factory() as loader:
        with pytest.raises(ValueError, match=r"stateful.next_worker must be 0 \(in_order=True: the workers "
                                             r"delivered in turn, and stateful.taken \[4, 4, 0, 4\] in batches of 2 "
                                             r"says whose turn is next\), got 1"):
            loader.load_state_dict(swapped)
    _, state = interrupted(factory, 7)
    assert state["stateful"]["taken"] == [6, 4, 0, 4] and state["stateful"]["next_worker"] == 1
    for nxt in (0, 2, 3):
        with factory() as loader, pytest.raises(ValueError, match=rf"stateful.next_worker must be 1 .*, got {nxt};"):
            loader.load_state_dict(dict(state, stateful=dict(state["stateful"], next_worker=nxt)))
    added = dict(state, stateful=dict(state["stateful"], taken=[6, 4, 0, 6]))  # a batch added to worker 3
    with factory() as loader, pytest.raises(ValueError, match=r"stateful.taken must count the batches of workers "
                                                              r"that delivered in turn"):
        loader.load_state_dict(added)


def test_states_whose_batches_came_out_of_turn_are_not_cross_checked():
    def factory(in_order=True):
        return make(Counted(TURNS), num_workers=4, batch_size=2, in_order=in_order)

    with factory() as loader:
        full = list(loader)
    head, state = interrupted(lambda: factory(False), 7)
    assert state["stateful"]["in_order"] is False
    nxt = state["stateful"]["next_worker"]
    state["stateful"]["next_worker"] = (nxt + 1) % 4  # any worker may have delivered last
    with factory(False) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert sorted(map(repr, head + rest)) == sorted(map(repr, full))  # every item once, in some order
    # a state saved before the field existed loads as it did
    head, state = interrupted(factory, 7)
    del state["stateful"]["in_order"]
    assert head + resumed(factory, state) == full


class Hiccup(torch.utils.data.IterableDataset):
    """Worker ``w`` yields ``sizes[w]`` ints; worker 1's third item raises once, and its
    iterator goes on after it."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        return _HiccupIter(worker_slice(self.sizes), torch.utils.data.get_worker_info().id)


class _HiccupIter:
    def __init__(self, items, wid):
        self.items, self.wid, self.at = items, wid, 0

    def __next__(self):
        if self.at >= len(self.items):
            raise StopIteration
        self.at += 1
        if self.wid == 1 and self.at == 3:
            raise ValueError("a bad record")
        return self.items[self.at - 1]


def test_a_batch_lost_to_an_error_ends_the_cross_check_for_that_epoch():
    with make(Hiccup([6, 6, 6]), num_workers=3, batch_size=2) as loader:
        it = iter(loader)
        got, errors = [], 0
        while len(got) < 5:
            try:
                got.append(next(it))
            except ValueError:
                errors += 1
        state = loader.state_dict()
        del it
    assert errors == 1  # worker 1's second batch: its turn passed with nothing counted
    assert state["stateful"]["in_order"] is False
    with make(Hiccup([6, 6, 6]), num_workers=3, batch_size=2) as loader:
        loader.load_state_dict(state)  # accepted: the turns no longer follow from taken


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_before_the_first_batch_resumes_that_epochs_order(num_workers):
    # RandomSampler without a generator draws from torch's global RNG when the epoch starts
    # (its first next()): the state saved after iter() holds the RNG that epoch draws from
    torch.manual_seed(11)
    with make(Numbers(), shuffle=True, num_workers=num_workers) as loader:
        it = iter(loader)
        state = saved(loader.state_dict())
        expected = list(it)
    assert state["progress"] is not None and "loader" in state["rng"] and state["rng"]["loader"]["global"]
    with make(Numbers(), shuffle=True, num_workers=num_workers) as loader:
        loader.load_state_dict(state)
        assert list(loader) == expected


def test_a_stateful_iterable_saved_before_the_first_batch_starts_from_the_datasets_state():
    dataset = Counted([10])
    dataset.epoch = 4
    with make(dataset) as loader:  # in process: the copy is the dataset itself
        it = iter(loader)
        state = saved(loader.state_dict())
        expected = list(it)
    assert {epoch for b in expected for _, epoch in b} == {4}
    assert state["stateful"]["workers"]["worker_0"]["dataset_state"] == {"position": 0, "epoch": 4}
    with make(Counted([10])) as loader:
        loader.load_state_dict(state)
        assert list(loader) == expected


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_dataset_that_is_its_own_iterator_is_iterated_once_per_epoch(num_workers):
    from tests.stateful_data import OwnIterator

    expected = list(torch.utils.data.DataLoader(OwnIterator(10), batch_size=4, num_workers=num_workers))
    with aioload.DataLoader(OwnIterator(10), batch_size=4, num_workers=num_workers) as loader:
        got = list(loader)
    assert [b.tolist() for b in got] == [b.tolist() for b in expected] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_stateful_map_style_datasets_state_is_given_back_to_each_worker(num_workers, persistent):
    from tests.stateful_data import RandomMap

    def factory():
        torch.manual_seed(2)  # in process the samples draw from the global RNG
        return make(RandomMap(), batch_size=3, num_workers=num_workers, persistent_workers=persistent and num_workers > 0,
                    generator=torch.Generator().manual_seed(9))

    with factory() as loader:
        full = [b for _ in range(2) for b in loader]
    head, state = interrupted(factory, 5, epochs_before=1)
    assert state["stateful"]["num_workers"] == num_workers
    assert isinstance(state["stateful"]["workers"]["worker_0"]["dataset_state"]["rng"], torch.Tensor)
    assert head + resumed(factory, state) == full


@pytest.mark.parametrize("num_workers", [0, 3])
def test_a_torchdata_stateful_dataloader_state_converts(num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sizes = [0, 100, 37] if num_workers else [137]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's worker-count warning
        theirs = StatefulDataLoader(Counted(sizes), num_workers=num_workers, batch_size=4, collate_fn=identity)
        it = iter(theirs)
        head = [next(it) for _ in range(9)]
        state = theirs.state_dict()
        rest = list(it)
    with make(Counted(sizes), num_workers=num_workers, batch_size=4) as loader:
        loader.load_state_dict(loader.state_from_torchdata(state))
        assert list(loader) == rest
    assert head + rest == list(torch.utils.data.DataLoader(Counted(sizes), num_workers=num_workers, batch_size=4,
                                                           collate_fn=identity))


def test_a_torchdata_state_of_a_map_style_dataset_is_refused_with_the_reason():
    with make(list(range(10)), batch_size=2) as loader:
        with pytest.raises(ValueError, match="^a torchdata StatefulDataLoader state of a map-style dataset does "
                                             "not convert"):
            loader.state_from_torchdata({"_snapshot": {}})


def test_an_epoch_with_the_same_base_seed_draws_the_same_in_reused_workers():
    # A resumed epoch replays its base seed; workers kept from the last epoch (an epoch that ran
    # to its end keeps them) are seeded again from it, as torch's fresh workers are.
    from tests.stateful_data import RandomMap

    generator = torch.Generator()
    with make(RandomMap(), batch_size=4, num_workers=2, generator=generator) as loader:
        epochs = []
        for _ in range(2):
            generator.manual_seed(21)
            epochs.append(list(loader))
    generator.manual_seed(21)
    expected = list(torch.utils.data.DataLoader(RandomMap(), batch_size=4, num_workers=2, generator=generator,
                                                collate_fn=identity))
    assert epochs[0] == epochs[1] == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_between_epochs_a_datasets_state_carries_over_only_where_its_copies_would(persistent):
    # torch gives fresh workers fresh copies each epoch: their random state starts from the seed
    from tests.stateful_data import RandomMap

    def factory():
        return make(RandomMap(), batch_size=4, num_workers=2, persistent_workers=persistent,
                    generator=torch.Generator().manual_seed(5))

    with factory() as loader:
        first = list(loader)
        state = saved(loader.state_dict())
        second = list(loader)
    assert state["progress"] is None and "stateful" in state
    assert first != second
    assert resumed(factory, state) == second


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)],
                         ids=["in-process", "fresh-workers", "persistent-workers"])
def test_each_epochs_copies_get_set_epoch_with_the_loaders_epoch(num_workers, persistent):
    # as Accelerate's loader and the Hugging Face Trainer do for a streaming dataset
    dataset = Epoched([3, 4])
    with make(dataset, num_workers=num_workers, persistent_workers=persistent) as loader:
        loader.set_epoch(5)
        epochs = [{epoch for b in loader for _, epoch in b} for _ in range(2)]
    assert epochs == [{5}, {6}]
    assert dataset.epochs == [5, 6]  # the dataset itself (in the training process), once each epoch


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_copies_sharing_their_epoch_do_not_each_add_it(persistent):
    # A Hugging Face streaming dataset's epoch is a tensor in shared memory that set_epoch moves
    # by an in-place add: three copies setting it at once made epoch 1 into 2 or 3 (another
    # shuffle of its files in an unshuffled stream).
    from tests.stateful_data import SharedEpoch

    dataset = SharedEpoch([2, 2, 2])
    with make(dataset, num_workers=3, persistent_workers=persistent) as loader:
        epochs = [sorted({epoch for b in loader for _, epoch in b}) for _ in range(3)]
    assert epochs == [[0], [1], [2]]
    assert dataset.epoch == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_samplers_own_state_at_the_epochs_start_is_given_back(num_workers):
    # The sampler's order depends on its own epoch count: the resumed epoch replays it from the
    # state it had at the epoch's start, and the next epoch goes on from there.
    from tests.stateful_data import EpochSampler

    def factory():
        return make(list(range(20)), sampler=EpochSampler(20), batch_size=3, num_workers=num_workers)

    with factory() as loader:
        full = [b for _ in range(3) for b in loader]
    head, state = interrupted(factory, 4, epochs_before=1)
    assert state["sampler"] == {"epochs": 1}
    assert state["progress"]["batches"] is None  # replayed from its state, not written out
    assert head + resumed(factory, state, epochs=2) == full
    with factory() as loader:
        list(loader)
        assert loader.state_dict()["sampler"] == {"epochs": 1}  # between epochs: the next one's start
