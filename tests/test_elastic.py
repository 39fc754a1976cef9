"""Elastic resume with real ``torchrun`` ranks (gloo on 127.0.0.1): a state saved on 4 ranks
resumes on 2 and on 3, one saved on 2 resumes on 4 (tests/frameworks/elastic_run.py), for a
map-style dataset, an ``aioload.Mix`` whose weights changed before the save, and WebDataset
shards in window mode (dealt to ranks in contiguous blocks).

The reference is the uninterrupted run on the saving world: its batches after the ones the
saved run had delivered are the rest of the epoch, which the new ranks share, each sample once
(up to the padding the remainder rule adds) and the same number of batches on every rank; the
next epoch is what a fresh run on the new world gives (computed here from the same plan).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.frameworks.elastic_run import BATCH, LATER, SEED, datasets, loader_of, write_shards
from tests.frameworks.launch import LAUNCH_TIMEOUT, torchrun

pytestmark = [pytest.mark.timeout(5 * LAUNCH_TIMEOUT), pytest.mark.slow]
K = 3  # batches delivered on each rank before the save


@pytest.fixture(scope="module", autouse=True)
def shards(tmp_path_factory):
    """The WebDataset kind's shards, named to the ranks (and to this process) by the environment."""
    os.environ["AIOLOAD_ELASTIC_SHARDS"] = write_shards(str(tmp_path_factory.mktemp("elastic-shards")))
    yield
    del os.environ["AIOLOAD_ELASTIC_SHARDS"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards):
    out = tmp_path_factory.mktemp("elastic")
    torchrun("elastic_run.py", [str(out), "--save", str(K)], nproc=4)
    torchrun("elastic_run.py", [str(out), "--resume", str(out / "state.4.json"), "--tag", "4to2",
                                "--save", str(K)], nproc=2)
    torchrun("elastic_run.py", [str(out), "--resume", str(out / "state.4.json"), "--tag", "4to3"], nproc=3)
    torchrun("elastic_run.py", [str(out), "--resume", str(out / "state.2.json"), "--tag", "2to4"], nproc=4)

    def read(name: str, world: int) -> list[dict]:
        return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]

    return read


def samples(batches_per_rank) -> Counter:
    return Counter(i for batches in batches_per_rank for batch in batches for i in batch)


def fresh_epoch(kind: str, world: int, rank: int, epoch: int) -> list[list[int]]:
    """Epoch ``epoch`` of rank ``rank`` of a fresh ``world``-rank run, from the loader's plan in
    this process (torch's fake process group plays the rank), each index loaded as ``dataset[i]``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dataset = datasets()[kind]
    try:
        with loader_of(dataset) as loader:
            if kind == "mix":
                loader.set_weights(LATER)  # in force since the first epoch's first batch
            plan = loader._planner.plan(epoch, None, False)[0]
            return [[dataset[i] for i in b] for _, b in plan.batches]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["map", "mix", "shards"])
@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (4, 3), (2, 4)])
def test_the_rest_of_the_epoch_is_shared_by_the_new_ranks(runs, kind, saved_on, resumed_on):
    full = [rank[kind] for rank in runs(f"full.{saved_on}", saved_on)]
    resumed = [rank[kind] for rank in runs(f"resume.{saved_on}to{resumed_on}", resumed_on)]
    rest = samples(epochs[0][K:] for epochs in full)
    got = samples(epochs[0] for epochs in resumed)
    counts = [len(epochs[0]) for epochs in resumed]
    assert len(set(counts)) == 1, f"every rank gets the same number of batches, got {counts}"
    pad = -sum(rest.values()) % resumed_on
    assert set(got) == set(rest), "the union of the resumed ranks' samples is the rest of the epoch"
    assert sum(got.values()) == sum(rest.values()) + pad and all(got[i] >= n for i, n in rest.items())
    assert counts[0] == -(-(sum(rest.values()) + pad) // resumed_on // BATCH)


@pytest.mark.parametrize("kind", ["map", "mix", "shards"])
@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (4, 3), (2, 4)])
def test_the_next_epoch_is_what_the_new_world_gives(runs, kind, saved_on, resumed_on):
    resumed = [rank[kind] for rank in runs(f"resume.{saved_on}to{resumed_on}", resumed_on)]
    for rank in range(resumed_on):
        assert resumed[rank][1] == fresh_epoch(kind, resumed_on, rank, 1), f"rank {rank}"


def test_an_uninterrupted_run_on_the_new_world_is_the_reference_for_its_own_saves(runs):
    # The 2-rank job resumed from 4 ranks and then saved itself: its own full run is the plain
    # 2-rank run, whose first epoch every rank computes alike.
    full = runs("full.2", 2)
    for rank in range(2):
        assert full[rank]["map"][0] == fresh_epoch("map", 2, rank, 0)
    assert SEED == 3
