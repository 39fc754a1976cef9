"""An ``IterableDataset`` resumes where it was saved, with workers: a ``Stateful`` dataset (or
iterator) through the state each worker's copy returned with the last batch delivered, one
without state by fast-forwarding (its ``__iter__`` run again and the items each worker had
delivered dropped). Each case compares a run stopped, saved through a checkpoint and resumed
in a new loader (once, and again from the resumed run, Hugging Face datasets #8308) with the
same run uninterrupted (tests/resumption.py).

The datasets (tests/iterable_data.py) give worker ``w`` the items ``1000 * w + i``; ``SIZES``
leaves worker 1 without any.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import aioload
from aioload._plan.stateful import FastForwardWarning
from tests.iterable_data import Counted, CountedIter, Noisy, Plain, items
from tests.resumption import may_fast_forward, piece, resumed, roundtrip, uninterrupted

# three workers on a two-core machine: torch (and aioload, in its words) warn that it is too many
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

SIZES = [13, 0, 9]  # batches of 4: worker 0 makes 4, worker 1 none, worker 2 makes 3
KINDS = {"stateful": Counted, "stateful-iterator": CountedIter, "plain": Plain}


def loading(kind: str):
    """What loading a mid-epoch state of ``kind`` says: nothing for a Stateful dataset; for
    one without state, that the epoch is read again up to the saved position."""
    if kind == "plain" or kind == "noisy":
        return lambda: pytest.warns(FastForwardWarning, match="by fast-forwarding")
    return contextlib.nullcontext


def factory(kind: str, sizes=SIZES, **kwargs):
    dataset = {**KINDS, "noisy": Noisy}[kind]
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", len(sizes))

    def make():
        torch.manual_seed(0)  # the base seed each epoch draws without seed=
        return aioload.DataLoader(dataset(sizes), **kwargs)

    return make


def torch_batches(kind: str, sizes=SIZES, epochs: int = 1, **kwargs) -> list:
    """The same epochs from torch's DataLoader, the reference of the uninterrupted run."""
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", len(sizes))
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader({**KINDS, "noisy": Noisy}[kind](sizes), **kwargs)
    return [items(b) for _ in range(epochs) for b in loader]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stop", [1, 4, 6])
def test_a_resumed_epoch_delivers_exactly_the_rest(kind, stop):
    make = factory(kind)
    full = uninterrupted(make, items)
    assert full == torch_batches(kind)
    assert resumed(make, items, [stop], loading=loading(kind)) == full


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_state_saved_after_the_epochs_last_batch_resumes_into_an_empty_rest(kind):
    make = factory(kind)
    full = uninterrupted(make, items, epochs=2)
    # Saved with the epoch's last batch, before the loop saw its end: the resumed loader's first
    # iteration yields nothing, the second is the next epoch. Every copy had run out, so nothing
    # is read again: no fast-forward to warn of.
    assert resumed(make, items, [len(full) // 2], epochs=2) == full


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_second_resume_goes_on_from_the_first_resumed_runs_position(kind):
    # Hugging Face datasets #8308: a run resumed once, saved again and resumed again restarted
    # its epoch from zero.
    make = factory(kind)
    full = uninterrupted(make, items, epochs=2)
    assert resumed(make, items, [2, 2, 4], epochs=2, loading=loading(kind)) == full
    assert resumed(make, items, [5, 4], epochs=2, loading=loading(kind)) == full  # the second save in epoch 1


@pytest.mark.parametrize("kind", ["stateful", "stateful-iterator", "plain"])
def test_batch_size_none_resumes_item_by_item(kind):
    make = factory(kind, batch_size=None)
    full = uninterrupted(make, items)
    assert full == torch_batches(kind, batch_size=None)
    assert resumed(make, items, [7, 9], loading=loading(kind)) == full


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_persistent_workers_resume_over_several_epochs(kind):
    make = factory(kind, persistent_workers=True)
    full = uninterrupted(make, items, epochs=3)
    assert full == torch_batches(kind, epochs=3, persistent_workers=True)
    per_epoch = len(full) // 3
    # stopped in epoch 1, then in epoch 2, each time in the middle
    assert resumed(make, items, [per_epoch + 3, per_epoch], epochs=3, loading=loading(kind)) == full


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_persistent_workers_take_a_state_loaded_into_the_same_loader(kind):
    # The workers (and their copies of the dataset) outlive the epoch: a state loaded into the
    # loader that runs them must reach those copies, not leave them where the last epoch ended.
    make = factory(kind, persistent_workers=True)
    full = uninterrupted(make, items, epochs=2)
    per_epoch = len(full) // 2
    with make() as loader:
        head = []
        for batch in loader:
            head.append(items(batch))
            if len(head) == 3:
                state = roundtrip(loader.state_dict())
        assert head == full[:per_epoch]
        with loading(kind)():
            loader.load_state_dict(state)
            rest = [items(b) for b in loader]
        again = [items(b) for b in loader]
    assert rest == full[3:per_epoch]
    assert again == full[per_epoch:]


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_out_of_order_delivery_resumes_every_item_once(kind):
    # in_order=False: batches come as they finish, so which were delivered at the save depends
    # on timing; each worker's state is the one its last delivered batch came with.
    make = factory(kind, in_order=False)
    expected = sorted(i for batch in uninterrupted(make, items) for i in batch)
    for stops in ([2], [3, 1]):
        # Whether a copy without state has items to drop depends on which batches came first
        # (three of worker 2's leave it run out and nothing to replay): the warning may or may not come.
        got = resumed(make, items, stops, loading=may_fast_forward)
        assert sorted(i for batch in got for i in batch) == expected, stops


def test_a_worker_without_items_leaves_the_others_resuming():
    # Every worker but one is empty, in the middle of the workers.
    make = factory("stateful", sizes=[0, 10, 0])
    full = uninterrupted(make, items)
    assert full == [[1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007], [1008, 1009]]
    assert resumed(make, items, [1], loading=loading("stateful")) == full


@pytest.mark.parametrize("seed", [None, 3])
def test_fast_forward_replays_each_workers_random_draws(seed):
    # Noisy draws from torch's global RNG in each worker: replayed from the epoch's start with the
    # same worker seeds, the items after the save carry the draws of the uninterrupted run.
    make = factory("noisy", batch_size=None, seed=seed)
    full = uninterrupted(make, items, epochs=2)
    if seed is None:
        assert full == torch_batches("noisy", batch_size=None, epochs=2)
    assert resumed(make, items, [5, 20], epochs=2, loading=loading("noisy")) == full


def test_a_stateful_dataset_starts_where_its_state_says_instead_of_replaying():
    make = factory("stateful", sizes=[20], num_workers=0)
    full = uninterrupted(make, items)
    head, state, _ = piece(make, items, 1, stop=2)
    with make() as loader:
        loader.load_state_dict(state["loader"])
        rest = [items(b) for b in loader]
        starts = loader.dataset.starts
    assert head + rest == full
    assert starts == [8]  # its own state put it after the 8 items delivered: nothing read twice


def test_a_state_saved_before_the_first_batch_resumes_the_whole_epoch():
    make = factory("stateful")
    full = uninterrupted(make, items)
    with make() as loader:
        iterator = iter(loader)
        state = roundtrip(loader.state_dict())  # after iter(), before the first next()
        del iterator
    with make() as loader:
        loader.load_state_dict(state)
        assert [items(b) for b in loader] == full


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_workers_zero_resumes_in_the_loading_process(kind):
    make = factory(kind, num_workers=0)
    full = uninterrupted(make, items, epochs=2)
    assert full == torch_batches(kind, num_workers=0, epochs=2)
    assert resumed(make, items, [3, 4], epochs=2, loading=loading(kind)) == full


@pytest.mark.parametrize("kind", ["stateful", "stateful-iterator", "plain"])
@pytest.mark.parametrize("workers", [0, 3])
def test_a_state_saved_between_epochs_resumes_the_next_epoch_whole(kind, workers):
    # Saved after the loop saw the epoch's end: the next epoch is a new one, as in the
    # uninterrupted run. A Stateful copy's state at that point says "at the end of the stream"
    # (torchdata's protocol: load_state_dict sets where the next __iter__ starts); handed to the
    # next epoch's copy, it leaves nothing to yield, and the copy starts its stream again.
    resume_after_a_whole_epoch(factory(kind, num_workers=workers))


def test_persistent_workers_resume_the_epoch_after_a_state_saved_between_epochs_whole():
    # Persistent workers carry their copies' states to the next epoch (an epoch counter); a
    # carried state that leaves a copy nothing to yield was the end of the last epoch's stream,
    # and the copy starts its stream again, as the uninterrupted run's copy did.
    resume_after_a_whole_epoch(factory("stateful", persistent_workers=True))


def resume_after_a_whole_epoch(make) -> None:
    """A state saved between epochs 0 and 1 resumes into what the uninterrupted run's epoch 1 gave."""
    full = uninterrupted(make, items, epochs=2)
    with make() as loader:
        first = [items(b) for b in loader]
        state = roundtrip(loader.state_dict())
    assert state["progress"] is None
    with make() as loader:
        loader.load_state_dict(state)
        assert first + [items(b) for b in loader] == full
