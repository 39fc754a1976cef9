"""A state of an epoch's start (saved between epochs, before any ``iter()``, or after ``iter()``
and before the first batch) resumes that epoch exactly: its order, drawn from torch's global RNG
as the state holds it, and, with persistent workers, the workers' random streams as the saved
run's workers had gone on drawing them. Real worker processes throughout."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

import aioload
from aioload._plan.resume import ResumeError
from tests.stateful_data import Noisy, NoisyStream, identity

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def roundtrip(state: dict) -> dict:
    """What survives a checkpoint: JSON, then torch.save loaded with weights_only."""
    buf = io.BytesIO()
    torch.save(json.loads(json.dumps(state)), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def noisy(persistent: bool, iterable: bool = False):
    if iterable:
        return aioload.DataLoader(NoisyStream([0, 9, 14]), batch_size=4, num_workers=3,
                                  persistent_workers=persistent, collate_fn=identity)
    return aioload.DataLoader(Noisy(24), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent,
                              collate_fn=identity)


def order(epoch: list) -> list:
    return [[sample[0] for sample in batch] for batch in epoch]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_state_saved_between_epochs_resumes_the_next_epoch_under_another_global_rng(persistent, iterable):
    torch.manual_seed(5)
    with noisy(persistent, iterable) as loader:
        first = list(loader)
        state = roundtrip(loader.state_dict())
        expected = list(loader)
    assert ("worker_streams" in state) is persistent
    torch.manual_seed(77)  # the resumed run's global RNG is another: the state holds what the epoch draws
    with noisy(persistent, iterable) as loader:
        loader.load_state_dict(state)
        got = list(loader)
    # the order, and every sample's draws: with persistent workers those of streams that went
    # on from the first epoch (the same worker seeds, and not the first epoch's draws again)
    assert got == expected
    assert got != first


@pytest.mark.parametrize("persistent", [False, True])
def test_a_script_that_draws_between_the_save_and_the_next_epoch_resumes_exactly(persistent):
    def run(state=None):
        with noisy(persistent) as loader:
            if state is None:
                list(loader)
                state = {"loader": roundtrip(loader.state_dict()), "rng": torch.get_rng_state()}
            else:
                loader.load_state_dict(state["loader"])
                torch.set_rng_state(state["rng"])  # the training script's own, from its checkpoint
            torch.rand(5)  # the script draws from the global RNG before the next epoch
            return state, [list(loader), list(loader)]

    torch.manual_seed(3)
    state, expected = run()
    torch.manual_seed(4)
    assert run(state)[1] == expected


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_state_saved_before_the_first_batch_resumes_persistent_workers_streams(iterable):
    torch.manual_seed(8)
    with noisy(True, iterable) as loader:
        before_any = roundtrip(loader.state_dict())  # no worker has started: new workers
        assert before_any["worker_streams"] == "new"
        first = list(loader)
        it = iter(loader)
        state = roundtrip(loader.state_dict())  # after iter(): the streams the first epoch left
        expected = list(it)
        assert len(state["worker_streams"]) == loader.num_workers
        # the same loader, whose persistent workers have drawn since: each resumed epoch gives
        # its workers the streams the state holds (new workers for the first epoch's)
        loader.load_state_dict(state)
        assert list(loader) == expected
        loader.load_state_dict(before_any)
        assert list(loader) == first
    torch.manual_seed(9)
    with noisy(True, iterable) as loader:
        loader.load_state_dict(state)
        assert list(loader) == expected


def test_worker_streams_are_checked_at_load():
    torch.manual_seed(1)
    with noisy(True) as loader:
        list(loader)
        state = roundtrip(loader.state_dict())
    broken = copy.deepcopy(state)
    broken["worker_streams"][1]["torch"] = broken["worker_streams"][1]["torch"][:40]
    with noisy(True) as loader, pytest.raises(ResumeError, match=r"worker_streams\[1\] is not a worker's random"):
        loader.load_state_dict(broken)
    broken = copy.deepcopy(state)
    del broken["worker_streams"][0]["numpy"]
    with noisy(True) as loader, pytest.raises(ResumeError, match=r"worker_streams\[0\] has no 'numpy'"):
        loader.load_state_dict(broken)
    with noisy(False) as loader:
        list(loader)
        plain = roundtrip(loader.state_dict())
    assert "worker_streams" not in plain  # workers seeded afresh each epoch carry no streams
    with noisy(False) as loader, pytest.raises(ResumeError, match="worker_streams must be absent"):
        loader.load_state_dict(dict(plain, worker_streams=state["worker_streams"]))


@pytest.mark.parametrize("persistent", [False, True])
def test_saving_between_epochs_leaves_the_global_rng_where_a_run_without_saves_leaves_it(persistent):
    def run(save: bool):
        torch.manual_seed(6)
        with noisy(persistent) as loader:
            epochs = [list(loader)]
            if save:
                loader.state_dict()
                loader.state_dict()  # twice: the same pinned snapshot
            it = iter(loader)
            if save:
                loader.state_dict()
            epochs.append(list(it))
            return epochs, torch.get_rng_state()

    plain, plain_rng = run(False)
    saving, saving_rng = run(True)
    assert saving == plain
    assert torch.equal(saving_rng, plain_rng)
