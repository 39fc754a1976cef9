"""Order and augmentation depend only on (seed, epoch, index): never on num_workers,
io_concurrency or in_order."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import aioload
from aioload._base.seeding import sample_seed
from tests.random_data import Augmented, BatchedAugmented, Keyed, KeySampler, PlainAugmented

# More workers than this machine has cores is the point of some cases, not a mistake.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

EPOCHS = 2
ROOT = Path(__file__).resolve().parent.parent


def run(dataset, epochs: int = EPOCHS, **kwargs) -> list[list[torch.Tensor]]:
    """Every epoch's batches (the sample tensors), as delivered."""
    kwargs.setdefault("batch_size", 4)
    with aioload.DataLoader(dataset, **kwargs) as loader:
        return [[batch[0] for batch in loader] for _ in range(epochs)]


def sorted_batches(epoch: list[torch.Tensor]) -> list[torch.Tensor]:
    return sorted(epoch, key=lambda batch: batch[:, 0].tolist())


def assert_same(expected, got, in_order: bool = True) -> None:
    assert len(expected) == len(got)
    for want, have in zip(expected, got):
        if not in_order:
            want, have = sorted_batches(want), sorted_batches(have)
        assert len(want) == len(have)
        for a, b in zip(want, have):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def reference():
    return run(Augmented(), shuffle=True, seed=11, num_workers=0)


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("io_concurrency", [1, 64])
@pytest.mark.parametrize("in_order", [True, False])
def test_same_seed_same_batches_whatever_the_workers(reference, num_workers, io_concurrency, in_order):
    got = run(Augmented(), shuffle=True, seed=11, num_workers=num_workers,
              io_concurrency=io_concurrency, in_order=in_order)
    assert_same(reference, got, in_order)


def test_augmentation_draws_from_every_rng(reference):
    samples = torch.cat(reference[0])
    for column in (1, 2, 3):  # torch, random, numpy: each differs from sample to sample
        assert len(set(samples[:, column].tolist())) == len(samples)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_plain_dataset_same_as_in_process(num_workers):
    expected = run(PlainAugmented(), shuffle=True, seed=4, num_workers=0)
    assert_same(expected, run(PlainAugmented(), shuffle=True, seed=4, num_workers=num_workers))


def test_split_and_plain_datasets_agree():
    assert_same(run(Augmented(), shuffle=True, seed=4, num_workers=0),
                run(PlainAugmented(), shuffle=True, seed=4, num_workers=2))


def test_batched_fetch_is_seeded_per_sample_with_seed():
    # __getitems__ draws once per call, and calls are split across workers: with seed= every
    # sample is fetched and seeded alone, so the worker count cannot show.
    expected = run(BatchedAugmented(), shuffle=True, seed=2, num_workers=0)
    assert_same(expected, run(BatchedAugmented(), shuffle=True, seed=2, num_workers=3))


def test_string_keys_seed_the_same_in_a_fresh_interpreter():
    # forkserver workers are fresh interpreters with their own str hash salt: a key's seed
    # must not come from hash().
    kwargs = dict(sampler=KeySampler(12), seed=8, batch_size=3)
    expected = run(Keyed(), epochs=1, num_workers=0, **kwargs)
    got = run(Keyed(), epochs=1, num_workers=2, multiprocessing_context="forkserver", **kwargs)
    assert_same(expected, got)
    assert sample_seed(1, "k3") != sample_seed(1, "k4")


def test_a_string_keys_seed_does_not_depend_on_the_hash_salt():
    code = "from aioload._base.seeding import sample_seed; print(sample_seed(1, 'k3'), sample_seed(1, ('k', 3)))"
    seen = set()
    for salt in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=salt, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        seen.add(done.stdout.strip())
    assert seen == {f"{sample_seed(1, 'k3')} {sample_seed(1, ('k', 3))}"}


def test_epochs_differ_and_set_epoch_replays():
    with aioload.DataLoader(Augmented(), batch_size=4, shuffle=True, seed=3, num_workers=1) as loader:
        first = torch.cat([b[0] for b in loader])
        second = torch.cat([b[0] for b in loader])
        loader.set_epoch(0)
        again = torch.cat([b[0] for b in loader])
    assert not torch.equal(first[:, 0], second[:, 0])  # reshuffled
    assert not torch.equal(first[:, 1:], second[first_position(first, second), 1:])  # new draws
    assert torch.equal(first, again)


def first_position(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``b`` in the order of ``a``'s indices."""
    where = {int(i): row for row, i in enumerate(b[:, 0].tolist())}
    return torch.tensor([where[int(i)] for i in a[:, 0].tolist()])


def test_different_seeds_differ():
    a = torch.cat(run(Augmented(), epochs=1, shuffle=True, seed=1)[0])
    b = torch.cat(run(Augmented(), epochs=1, shuffle=True, seed=2)[0])
    assert not torch.equal(a[:, 0], b[:, 0])
    assert not torch.equal(a[first_position(b, a), 1:], b[:, 1:])


def test_seed_leaves_the_callers_rngs_alone():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    run(PlainAugmented(), epochs=1, shuffle=True, seed=5, num_workers=0)
    run(Augmented(), epochs=1, shuffle=True, seed=5, num_workers=0)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_seed_the_global_rng_decides_the_order_as_in_torch(num_workers):
    # No seed=: the order comes from torch's global RNG (or generator=), drawn as torch's
    # DataLoader draws it, so torch.manual_seed repeats it whatever the worker count.
    torch.manual_seed(21)
    order = [b[1].tolist() for b in torch.utils.data.DataLoader(PlainAugmented(), batch_size=4, shuffle=True)]
    torch.manual_seed(21)
    with aioload.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=num_workers) as loader:
        assert [b[1].tolist() for b in loader] == order
