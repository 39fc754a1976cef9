"""Sharding across ranks and the torchrun example, with real gloo process groups on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch

import aioload
from aioload._plan.sampling import ShardSampler
from tests.frameworks.launch import LAUNCH_TIMEOUT, ROOT, run, run_ranks, torchrun_args

# Launching ranks takes longer than the default per-test limit on a loaded machine.
pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 30), pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(ROOT / "tests" / "dist_ranks.py", [str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_shards_are_disjoint_complete_and_equal(ranks):
    for epoch in range(2):
        a, b = (r["even-shuffled"]["epochs"][epoch] for r in ranks)
        assert len(a) == len(b) == 19
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(38))
    assert ranks[0]["even-shuffled"]["len"] == math.ceil(19 / 4)


def test_shards_are_reshuffled_every_epoch_from_one_permutation(ranks):
    # Every rank cuts its shard from the permutation an unsharded loader with the same seed
    # uses, so a one-rank run and a many-rank run see the same order.
    for epoch in range(2):
        with aioload.DataLoader(range(38), batch_size=38, shuffle=True, seed=5) as loader:
            loader.set_epoch(epoch)
            order = next(iter(loader)).tolist()
        for rank in range(2):
            assert ranks[rank]["even-shuffled"]["epochs"][epoch] == order[rank::2]
    assert ranks[0]["even-shuffled"]["epochs"][0] != ranks[0]["even-shuffled"]["epochs"][1]


def test_uneven_shards_are_padded_or_dropped_like_distributed_sampler(ranks):
    for epoch in range(2):
        a, b = (r["padded-shuffled"]["epochs"][epoch] for r in ranks)
        assert len(a) == len(b) == 19
        assert sorted(set(a + b)) == list(range(37))  # one sample repeated to even the shards
        a, b = (r["dropped-sequential"]["epochs"][epoch] for r in ranks)
        # 18 each (the 37th sample dropped), then drop_last drops the incomplete 5th batch
        assert a == list(range(0, 32, 2)) and b == list(range(1, 33, 2))
    # Without seed= every rank still agrees on the order (seeded like DistributedSampler).
    assert ranks[0]["padded-shuffled"]["epochs"][0] != ranks[0]["padded-shuffled"]["epochs"][1]
    assert ranks[0]["padded-shuffled"]["len"] == 5 and ranks[0]["dropped-sequential"]["len"] == 4


def test_shard_false_and_a_users_distributed_sampler(ranks):
    for rank in range(2):
        assert ranks[rank]["unsharded"]["epochs"] == [list(range(37))] * 2
        assert ranks[rank]["unsharded"]["len"] == 10
        ds = range(37)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=rank, seed=2)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert ranks[rank]["distributed-sampler"]["epochs"][epoch] == list(sampler)


def test_a_sharded_loader_resumes(ranks):
    for rank in range(2):
        resumed = ranks[rank]["resumed"]
        assert resumed["head"] + resumed["rest"] == ranks[rank]["even-shuffled"]["epochs"][0]


def test_shard_sampler_alone():
    shards = [list(ShardSampler(10, r, 3, shuffle=False, drop_last=False, seed=0)) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert [len(ShardSampler(10, r, 3, shuffle=True, drop_last=True, seed=0)) for r in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match=r"^rank must be in \[0, world_size\), got rank=3, world_size=3$"):
        ShardSampler(10, 3, 3, shuffle=False, drop_last=False, seed=0)
    with pytest.raises(TypeError, match=r"^shard must be True or False, got 'yes'$"):
        aioload.DataLoader(range(3), shard="yes")


def load_example():
    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "examples" / "ddp_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_digests(example, root, steps: int, batch_size: int = 8) -> dict[tuple[int, int], str]:
    """What each rank's step should see, computed here without torch.distributed and without
    aioload's sharding: every epoch's samples from one unsharded loader (seed=0; a sample's crop
    is seeded by its index, so it is the same whichever batch it lands in), split by hand as
    DistributedSampler splits them: cut to a multiple of 2, rank r takes every second from r."""
    args = example.argparse.Namespace(data=str(root), image_size=64)
    ds = example.dataset(args)
    per_rank = len(ds) // 2
    steps_per_epoch = per_rank // batch_size
    out = {}
    with aioload.DataLoader(ds, batch_size=None, shuffle=True, seed=0) as loader:
        for epoch in range(math.ceil(steps / steps_per_epoch)):
            samples = list(loader)[: 2 * per_rank]
            for rank in range(2):
                mine = samples[rank::2]
                for b in range(steps_per_epoch):
                    step = epoch * steps_per_epoch + b + 1
                    chunk = mine[b * batch_size : (b + 1) * batch_size]
                    if step <= steps:
                        out[rank, step] = example.digest(torch.stack([image for image, _ in chunk]),
                                                         torch.tensor([label for _, label in chunk]))
    return out


def printed(output: str) -> dict[tuple[int, int], str]:
    return {(int(r), int(s)): d for r, s, d in re.findall(r"rank (\d) epoch \d+ step (\d+) batch (\w+)", output)}


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
def test_ddp_example_trains_and_resumes(image_root, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    example = str(ROOT / "examples" / "ddp_train.py")
    common = ["--data", str(image_root), "--workers", "1", "--batch-size", "8"]
    first = printed(run(torchrun_args(example, [*common, "--steps", "2", "--checkpoint", str(ckpt)])))
    second = printed(run(torchrun_args(example, [*common, "--steps", "5", "--resume", str(ckpt)])))
    expected = expected_digests(load_example(), image_root, 5)  # 48 images: 3 steps an epoch
    assert first == {k: v for k, v in expected.items() if k[1] <= 2}
    assert second == {k: v for k, v in expected.items() if k[1] > 2}
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 2
    for state in saved["loaders"]:  # each rank's position, saved with the world size it needs
        assert state["config"]["world_size"] == 2 and state["config"]["sampler"].startswith("BatchSampler(ShardByRank(")
