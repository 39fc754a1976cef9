"""WebDataset shards with real ``torchrun`` ranks (gloo on 127.0.0.1, two workers per rank):
every rank gets the same number of batches, every sample is read once per epoch across ranks
and workers, the order is the dataset's (dealt by stride in uniform mode, in blocks in window
mode), and any rank's mid-epoch state resumes every rank exactly
(tests/frameworks/shards_run.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import aioload
from aioload._plan.deal import Deal
from tests.frameworks.launch import LAUNCH_TIMEOUT, torchrun
from tests.frameworks.shards_run import BATCH, K, SEED
from tests.httpserver import Server
from tests.shards_data import image_samples, write_webdataset

pytestmark = [pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60), pytest.mark.slow]
WORLD = 2


@pytest.fixture(scope="module")
def jobs(image_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards-dist")
    local = write_webdataset(image_samples(image_root), out / "shards", 10)
    mp = pytest.MonkeyPatch()
    mp.setenv("AIOLOAD_CACHE", str(out / "cache"))
    try:
        with Server(out / "shards") as server:  # over HTTP, so that window mode fetches whole shards
            pattern = server.url("wds-{000000..000004}.tar")
            torchrun("shards_run.py", ["first", pattern, str(out)], nproc=WORLD)
            torchrun("shards_run.py", ["rest", pattern, str(out)], nproc=WORLD)
    finally:
        mp.undo()
    first = [json.loads((out / f"first.rank{r}.json").read_text()) for r in range(WORLD)]
    rest = [json.loads((out / f"rest.rank{r}.json").read_text()) for r in range(WORLD)]
    return local, first, rest  # the same shards, read here from the disk


@pytest.mark.parametrize("mode", ["uniform", "window"])
def test_every_sample_once_per_epoch_and_equal_batches_on_every_rank(jobs, mode):
    pattern, first, _ = jobs
    ds = aioload.WebDataset(pattern)
    for epoch in range(2):
        per_rank = [run[mode]["full"][epoch] for run in first]
        assert len(per_rank[0]) == len(per_rank[1]) == first[0][mode]["len"] == 6  # 24 samples a rank
        seen = Counter(key for batches in per_rank for batch in batches for key in batch)
        assert seen == Counter(ds.key(i) for i in range(len(ds)))  # 48 = 2 x 24: no padding, no drop
        # the dataset's order, dealt as its `deal` says
        order = ds.epoch_order(SEED, epoch, True) if mode == "uniform" else \
            aioload.WebDataset(pattern, window=2).epoch_order(SEED, epoch, True)
        deal = Deal(WORLD, BATCH, False, "stride" if mode == "uniform" else "blocks")
        for rank, batches in enumerate(per_rank):
            expected = [ds.key(int(order[p])) for p in deal.positions(len(ds), rank)]
            assert [key for batch in batches for key in batch] == expected
    assert first[0]["uniform"]["full"][0] != first[0]["uniform"]["full"][1]  # set_epoch reshuffles


def test_window_mode_keeps_each_rank_on_shards_of_its_own(jobs):
    pattern, first, _ = jobs
    ds = aioload.WebDataset(pattern)
    shard_of = {ds.key(i): int(ds.shard_of(i)) for i in range(len(ds))}
    touched = [{shard_of[k] for batch in run["window"]["full"][0] for k in batch} for run in first]
    # 5 shards; in blocks, only the shards open where rank 0's block ends are read by both ranks
    assert len(touched[0] & touched[1]) <= 2 and touched[0] | touched[1] == set(range(5))
    for rank, run in enumerate(first):
        epochs_touched = sum(len({shard_of[k] for b in epoch for k in b}) for epoch in run["window"]["full"])
        assert run["window"]["fetches"] == epochs_touched  # each shard it reads, fetched once an epoch
        assert run["uniform"]["requests_per_sample"] == 1.0  # a range request per sample


@pytest.mark.parametrize("mode", ["uniform", "window"])
def test_any_ranks_state_resumes_every_rank_exactly(jobs, mode):
    _, first, rest = jobs
    for rank in range(WORLD):
        full_epoch = first[rank][mode]["full"][1]
        assert first[rank][mode]["first"] == full_epoch[:K]
        for source in (0, 1):
            assert rest[rank][mode][f"rest_from_{source}"] == full_epoch[K:], (rank, source)
    assert torch.tensor([len(r[mode]["rest_from_0"]) for r in rest]).unique().numel() == 1
