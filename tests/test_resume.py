"""loader.state_dict() / load_state_dict(): stop at batch k, save, restore in a new loader
(another num_workers, io_concurrency or in_order), and the rest matches an uninterrupted run."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

import aioload
from aioload._plan.resume import ResumeWarning
from tests.random_data import Augmented, Gated, Shuffled, Stream

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N, BATCH, EPOCHS = 23, 3, 2
PER_EPOCH = -(-N // BATCH)  # 8 batches


class Unsized(torch.utils.data.Sampler):
    """A sampler aioload cannot replay, without a len()."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Idx:
    """An index that counts how often it is converted to an int (as saving one does)."""

    conversions = 0

    def __init__(self, i: int):
        self.i = i

    def __index__(self) -> int:
        Idx.conversions += 1
        return self.i


class IdxSampler(Shuffled):
    def __iter__(self):
        return (Idx(i) for i in super().__iter__())


class ByIdx(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: Idx) -> int:
        return index.i


def key(batch) -> tuple:
    """A batch as comparable data: its indices and every augmented value."""
    return tuple(batch[0].flatten().tolist())


def indices(batch) -> tuple:
    """Only the batch's indices: without seed=, workers draw augmentations from per-worker
    streams as torch's do, so only the order is reproducible."""
    return tuple(batch[1].tolist())


def roundtrip(state: dict) -> dict:
    """What survives a checkpoint: JSON, then torch.save with weights_only loading."""
    state = json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def uninterrupted(make, key=key) -> list[list[tuple]]:
    torch.manual_seed(0)
    with make() as loader:
        return [[key(b) for b in loader] for _ in range(EPOCHS)]


def interrupted(make, k: int, between: bool = False, key=key):
    """Take ``k`` batches (counted across epochs), then save. ``between``: the k-th batch ends
    an epoch and the loop runs to its end (StopIteration) before saving."""
    torch.manual_seed(0)
    seen: list[list[tuple]] = []
    with make() as loader:
        taken = 0
        for epoch in range(EPOCHS):
            seen.append([])
            for batch in loader:
                seen[-1].append(key(batch))
                taken += 1
                if taken == k and not between:
                    return seen, epoch, roundtrip(loader.state_dict()), torch.get_rng_state()
            if taken == k:
                return seen, epoch + 1, roundtrip(loader.state_dict()), torch.get_rng_state()
    raise AssertionError(f"fewer than {k} batches")


def resumed(make, state: dict, epoch: int, rng: torch.Tensor, key=key) -> list[list[tuple]]:
    with make() as loader:
        loader.load_state_dict(state)
        torch.set_rng_state(rng)  # the training script restores its own RNG state
        return [[key(b) for b in loader] for _ in range(epoch, EPOCHS)]


def check_save_load(make_saved, make_resumed, k: int, between: bool = False, in_order: bool = True, key=key):
    """The torchdata habit: stop at k, save, restore into another loader, compare the rest."""
    full = uninterrupted(make_saved, key)
    seen, epoch, state, rng = interrupted(make_saved, k, between, key)
    rest = resumed(make_resumed, state, epoch, rng, key)
    stopped = len(seen) - 1
    if between:
        assert seen == full[: len(seen)]
        assert rest == full[len(seen):]
        return
    # The interrupted epoch: what was seen plus what the resumed loader yields is the whole
    # epoch, each batch once; the resumed loader yields the remainder in sampler order.
    whole = full[stopped]
    assert sorted(seen[stopped] + rest[0]) == sorted(whole)
    if in_order:
        assert seen[stopped] == whole[: len(seen[stopped])]
        assert rest[0] == [b for b in whole if b not in seen[stopped]]
        assert rest[1:] == full[stopped + 1:]
    else:
        # batches were handed out as they finished: the same batches, in some order
        assert [sorted(epoch) for epoch in rest[1:]] == [sorted(epoch) for epoch in full[stopped + 1:]]


def loader_factory(dataset=None, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    return lambda: aioload.DataLoader(dataset if dataset is not None else Augmented(N), **kwargs)


POINTS = [
    pytest.param(1, False, id="first-batch"),
    pytest.param(4, False, id="middle"),
    pytest.param(PER_EPOCH, False, id="last-batch"),
    pytest.param(PER_EPOCH, True, id="between-epochs"),
    pytest.param(PER_EPOCH + 3, False, id="second-epoch"),
]


@pytest.mark.parametrize("k, between", POINTS)
def test_seeded_resume_into_other_worker_counts(k, between):
    saved = loader_factory(shuffle=True, seed=3, num_workers=2, io_concurrency=1)
    restored = loader_factory(shuffle=True, seed=3, num_workers=0)
    check_save_load(saved, restored, k, between)
    check_save_load(restored, loader_factory(shuffle=True, seed=3, num_workers=3), k, between)


@pytest.mark.parametrize("k, between", [POINTS[1], POINTS[3]])
def test_user_generator_resume(k, between):
    def make(workers):
        return lambda: aioload.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, num_workers=workers,
                                          generator=torch.Generator().manual_seed(9))

    check_save_load(make(2), make(0), k, between, key=indices)


@pytest.mark.parametrize("k, between", [POINTS[1], POINTS[3], POINTS[4]])
def test_persistent_workers_resume(k, between):
    # Without seed=, persistent workers draw one base seed for the loader's life.
    def make(workers):
        return lambda: aioload.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, num_workers=workers,
                                          persistent_workers=True, generator=torch.Generator().manual_seed(9))

    check_save_load(make(1), make(2), k, between, key=indices)


@pytest.mark.parametrize("k, between", [POINTS[1], POINTS[4]])
def test_global_rng_resume(k, between):
    saved = loader_factory(shuffle=True, num_workers=1)
    # (num_workers=0 would decode on the global RNG too, moving the next epoch's order.)
    check_save_load(saved, loader_factory(shuffle=True, num_workers=3, io_concurrency=1), k, between, key=indices)


def test_weighted_sampler_on_the_global_rng():
    def make():
        weights = torch.linspace(0.1, 1.0, N)
        sampler = torch.utils.data.WeightedRandomSampler(weights, N, replacement=True)
        return aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=sampler, seed=1)

    check_save_load(make, make, 5)


def test_distributed_sampler_given_by_the_user():
    def make():
        ds = Augmented(N)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=1, seed=4)
        return aioload.DataLoader(ds, batch_size=BATCH, sampler=sampler, seed=1, num_workers=1)

    full = uninterrupted(make)
    assert full[0] != full[1]  # set_epoch reached the sampler
    check_save_load(make, make, 2)
    check_save_load(make, make, 5)


def test_unordered_delivery_resumes_without_loss_or_duplicates():
    saved = loader_factory(shuffle=True, seed=6, num_workers=3, in_order=False)
    check_save_load(saved, loader_factory(shuffle=True, seed=6, num_workers=1), 5, in_order=False)


def test_batches_in_flight_at_save_time_are_neither_lost_nor_duplicated(tmp_path):
    gate = str(tmp_path / "gate")
    open(gate, "w").close()
    kwargs = dict(batch_size=2, seed=1, num_workers=2, in_order=False)
    with aioload.DataLoader(Gated(16, gate, gated=4), **kwargs) as loader:
        assert len([b for b in loader]) == 8  # epoch 0 runs freely
        os.remove(gate)
        got = []
        iterator = iter(loader)
        while len(got) < 5:  # batch 2 cannot finish: its sample 4 waits for the gate
            got.append(next(iterator)[1].tolist())
        state = roundtrip(loader.state_dict())
        open(gate, "w").close()
    assert [4, 5] not in got
    # the state names exactly the batches delivered: those before the gated one and some after
    # it (which ones follows the workers' timing: a batch queued behind the gated sample waits too)
    delivered = state["progress"]["delivered"]
    assert state["epoch"] == 1 and delivered["below"] <= 2 and len(delivered["also"]) == 5 - delivered["below"]
    assert set(range(delivered["below"])) | set(delivered["also"]) == {b[0] // 2 for b in got}
    with aioload.DataLoader(Gated(16, gate, gated=4), **dict(kwargs, in_order=True, num_workers=0)) as loader:
        loader.load_state_dict(state)
        rest = [b[1].tolist() for b in loader]
    first = delivered["below"]  # the first batch not delivered: the gated one, or one before it
    assert rest[0] == [2 * first, 2 * first + 1] and [4, 5] in rest
    assert sorted(got + rest) == [[i, i + 1] for i in range(0, 16, 2)]


def test_sampler_that_cannot_be_replayed_is_saved_as_its_remaining_indices():
    sampler = Shuffled(N)  # an unseeded private RNG: a new order every run
    with aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=sampler, num_workers=2, seed=2) as loader:
        iterator = iter(loader)
        seen = [next(iterator)[1].tolist() for _ in range(3)]
        state = roundtrip(loader.state_dict())
    order = sampler.history[0]
    expected = [order[i : i + BATCH] for i in range(0, N, BATCH)]
    assert seen == expected[:3]
    assert state["progress"]["batches"] is not None
    with aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=Shuffled(N), num_workers=0, seed=2) as loader:
        loader.load_state_dict(state)
        assert [b[1].tolist() for b in loader] == expected[3:]
        # ...and a second save inside the resumed epoch still knows what is left.
        loader.load_state_dict(state)
        iterator = iter(loader)
        assert next(iterator)[1].tolist() == expected[3]
        again = roundtrip(loader.state_dict())
    with aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=Shuffled(N), num_workers=1, seed=2) as loader:
        loader.load_state_dict(again)
        assert [b[1].tolist() for b in loader] == expected[4:]
        assert sorted(i for b in loader for i in b[1].tolist()) == list(range(N))  # the next epoch


def test_save_twice_in_one_resumed_epoch():
    make = loader_factory(shuffle=True, seed=5, num_workers=1)
    full = uninterrupted(make)
    _, _, state, _ = interrupted(make, 2)
    with make() as loader:
        loader.load_state_dict(state)
        iterator = iter(loader)
        assert [key(next(iterator)) for _ in range(3)] == full[0][2:5]
        state = roundtrip(loader.state_dict())
    with make() as loader:
        loader.load_state_dict(state)
        assert [key(b) for b in loader] == full[0][5:]


def test_state_before_iterating_and_after_loading():
    make = loader_factory(shuffle=True, seed=5)
    full = uninterrupted(make)
    with make() as loader:
        fresh = roundtrip(loader.state_dict())
    assert fresh["progress"] is None and fresh["epoch"] == 0
    _, _, state, _ = interrupted(make, 3)
    with make() as loader:
        loader.load_state_dict(state)
        assert loader.state_dict() == state  # nothing happened since
        loader.load_state_dict(fresh)
        assert [key(b) for b in loader] == full[0]


def test_set_epoch_to_another_epoch_drops_the_loaded_state():
    make = loader_factory(shuffle=True, seed=5)
    full = uninterrupted(make)
    _, _, state, _ = interrupted(make, 3)
    with make() as loader:
        loader.load_state_dict(state)
        loader.set_epoch(0)  # the same epoch: the state still applies
        assert [key(b) for b in loader] == full[0][3:]
        loader.load_state_dict(state)
        loader.set_epoch(1)
        assert [key(b) for b in loader] == full[1]


def test_a_state_from_another_configuration_is_refused():
    _, _, state, _ = interrupted(loader_factory(shuffle=True, seed=5), 3)
    with aioload.DataLoader(Augmented(N), batch_size=4, shuffle=True, seed=5) as loader:
        with pytest.raises(ValueError, match=r"^this state was saved by a loader with batch_size=3, but this "
                                             r"loader has batch_size=4: exact resume needs the same dataset, "
                                             r"batching, sampler and seed \(num_workers, io_concurrency and "
                                             r"in_order may differ, and so may the world size: this loader shards "
                                             r"the dataset itself \(elastic resume\)\); load it into a loader "
                                             r"made as the one that saved it$"):
            loader.load_state_dict(state)
    with aioload.DataLoader(Augmented(N), batch_size=3, shuffle=True, seed=6) as loader:
        with pytest.raises(ValueError, match=r"^this state was saved by a loader with seed=5, but this loader has seed=6"):
            loader.load_state_dict(state)
    with aioload.DataLoader(Augmented(N), batch_size=3) as loader:
        with pytest.raises(ValueError, match=r"^not an aioload.DataLoader state of version 1"):
            loader.load_state_dict({"epoch": 1})


def test_iterable_dataset_saved_mid_epoch_resumes_by_fast_forwarding_its_copies():
    from aioload._plan.stateful import FastForwardWarning

    with aioload.DataLoader(Stream(10), batch_size=3, num_workers=1) as loader:
        first = [b.tolist() for b in loader]
        between = roundtrip(loader.state_dict())
        iterator = iter(loader)
        next(iterator)
        middle = roundtrip(loader.state_dict())  # the copy's position: 3 items taken
    assert between["epoch"] == 1 and between["progress"] is None
    assert middle["epoch"] == 1 and middle["progress"]["inexact"] is None
    assert middle["stateful"]["taken"] == [3]
    with aioload.DataLoader(Stream(10), batch_size=3, num_workers=1) as loader:
        loader.load_state_dict(between)  # between epochs: exact, no warning
        assert [b.tolist() for b in loader] == first
        loader.load_state_dict(middle)
        with pytest.warns(FastForwardWarning, match=r"^this state resumes epoch 1 of an IterableDataset that has "
                                                    r"no state_dict\(\)/load_state_dict\(\) .* drops the items it "
                                                    r"delivered before the save, 3 in all \(worker 0: 3\)"):
            rest = [b.tolist() for b in loader]
        assert rest == first[1:]  # the rest of the epoch, exactly
    with aioload.DataLoader(Stream(10), batch_size=3) as loader:  # another number of workers
        loader.load_state_dict(middle)
        with pytest.warns(ResumeWarning, match=r"^this state resumes epoch 1 from its start, not from where it "
                                               r"was saved: it was saved with num_workers=1 and this loader has "
                                               r"num_workers=0"):
            assert [b.tolist() for b in loader] == first  # the whole epoch, its first batch again


def test_a_sampler_that_cannot_be_written_out_saves_the_epochs_start():
    # Not replayable and no len(): its rest cannot be written out, so the state is the epoch's start.
    with aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=Unsized(N), seed=2) as loader:
        iterator = iter(loader)
        seen = [indices(next(iterator)) for _ in range(2)]
        state = roundtrip(loader.state_dict())
    assert seen == [(0, 1, 2), (3, 4, 5)]
    assert state["progress"]["inexact"].startswith("the sampler cannot be replayed and has no len()")
    with aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=Unsized(N), seed=2) as loader:
        with pytest.warns(ResumeWarning, match=r"^this state resumes epoch 0 from its start, not from where it "
                                               r"was saved: the sampler cannot be replayed and has no len\(\)"):
            loader.load_state_dict(state)
        assert [indices(b) for b in loader][:2] == seen


def test_saving_after_every_batch_does_not_redo_the_epoch():
    # A sampler aioload cannot replay is saved as the rest of its epoch: written out once, at the
    # first save; later saves (torchdata.nodes saves after every item) reuse it.
    Idx.conversions = 0
    with aioload.DataLoader(ByIdx(), batch_size=BATCH, sampler=IdxSampler(N)) as loader:
        counts = []
        for _ in loader:
            loader.state_dict()
            counts.append(Idx.conversions)
        final = loader.state_dict()
    assert counts == [N - BATCH] * PER_EPOCH  # the 20 indices after the first batch, converted once
    assert final["progress"] is None


def nodes(loader):
    """torchdata.nodes with the loader as its source, as its docs wrap any iterable."""
    from torchdata.nodes import IterableWrapper, Loader, Prefetcher

    return Loader(Prefetcher(IterableWrapper(loader), prefetch_factor=2))


TORCHDATA_SOURCES = {
    "iterable-in-process": lambda: aioload.DataLoader(Stream(10), batch_size=3),
    "iterable-workers": lambda: aioload.DataLoader(Stream(10), batch_size=3, num_workers=1),
    "unsized-sampler": lambda: aioload.DataLoader(Augmented(N), batch_size=BATCH, sampler=Unsized(N), seed=1),
    "map-style": loader_factory(shuffle=True, seed=4, num_workers=1),
}


@pytest.mark.parametrize("name", ["iterable-in-process", "iterable-workers", "unsized-sampler"])
def test_torchdata_nodes_take_the_loader_as_a_source(name):
    make = TORCHDATA_SOURCES[name]
    as_list = (lambda b: b.tolist()) if name.startswith("iterable") else key
    with make() as loader:
        expected = [as_list(b) for b in loader]
    with make() as loader:
        assert [as_list(b) for b in nodes(loader)] == expected


def test_torchdata_nodes_resume_through_the_loaders_state():
    make = TORCHDATA_SOURCES["map-style"]
    with make() as loader:
        full = [key(b) for b in loader]
    with make() as loader:
        pipe = nodes(loader)
        batches = iter(pipe)
        head = [key(next(batches)) for _ in range(3)]
        state = roundtrip(pipe.state_dict())
    with loader_factory(shuffle=True, seed=4, num_workers=0)() as loader:
        pipe = nodes(loader)
        pipe.load_state_dict(state)
        rest = [key(b) for b in pipe]
    assert head == full[:3] and rest == full[3:]
    # An IterableDataset's state, saved by torchdata after every item, resumes from the epoch's start.
    with TORCHDATA_SOURCES["iterable-workers"]() as loader:
        pipe = nodes(loader)
        batches = iter(pipe)
        assert [next(batches).tolist() for _ in range(2)] == [[0, 1, 2], [3, 4, 5]]
        state = roundtrip(pipe.state_dict())
    with TORCHDATA_SOURCES["iterable-in-process"]() as loader:
        pipe = nodes(loader)
        pipe.load_state_dict(state)
        with pytest.warns(ResumeWarning, match=r"^this state resumes epoch 0 from its start"):
            rest = [b.tolist() for b in pipe]
    assert rest == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_async_iteration_resumes_too():
    import anyio

    make = loader_factory(shuffle=True, seed=7, num_workers=1)
    full = uninterrupted(make)

    async def main():
        with make() as loader:
            got = []
            async for batch in loader:
                got.append(key(batch))
                if len(got) == 4:
                    break
            return got, roundtrip(loader.state_dict())

    got, state = anyio.run(main)
    assert got == full[0][:4]
    with make() as loader:
        loader.load_state_dict(state)
        assert [key(b) for b in loader] == full[0][4:]


def test_state_is_small_with_replayable_samplers():
    make = loader_factory(shuffle=True, seed=3, num_workers=1)
    _, _, state, _ = interrupted(make, 4)
    assert state["progress"]["batches"] is None
    assert len(json.dumps(state)) < 2000
