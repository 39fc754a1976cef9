"""Construction order and resume under torch.distributed: two real gloo ranks on 127.0.0.1
(tests/dist_resume.py), launched once for the module.

* A loader built before ``init_process_group`` shards once the group exists, and ``len()``
  follows, as torch's ``DistributedSampler`` does.
* One state, saved by rank 0 (what Lightning and Accelerate checkpoint), resumes every rank
  exactly where it stopped.
* A state saved with another world size resumes on this one: the rest of its epoch is dealt
  over the ranks there are now (elastic resume; tests/test_elastic.py runs 2, 3 and 4 ranks).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from aioload._plan.sampling import ShardSampler
from tests.dist_resume import RESUME_CASES
from tests.frameworks.launch import LAUNCH_TIMEOUT, ROOT, run_ranks

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 30), pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(ROOT / "tests" / "dist_resume.py", [str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def reference(n: int, batch_size: int, rank: int, **kwargs) -> torch.utils.data.DataLoader:
    """torch's own loader over ``DistributedSampler`` for that rank: the independent reference."""
    sampler = DistributedSampler(range(n), num_replicas=2, rank=rank, **kwargs)
    return torch.utils.data.DataLoader(range(n), batch_size=batch_size, sampler=sampler,
                                       drop_last=kwargs.get("drop_last", False))


def flat(epoch: list[list[int]]) -> list[int]:
    return [i for batch in epoch for i in batch]


def test_a_loader_built_before_init_process_group_shards(ranks):
    for name, n in [("split-shuffled", 20), ("plain-padded", 21)]:
        for epoch in range(2):
            a, b = (flat(r[name]["epochs"][epoch]) for r in ranks)
            assert len(a) == len(b) == -(-n // 2)
            assert sorted(set(a) | set(b)) == list(range(n))  # together: the whole dataset
        a, b = (flat(r["split-shuffled"]["epochs"][0]) for r in ranks)
        assert not set(a) & set(b)  # disjoint halves
    for rank in range(2):
        # In order, the shards are DistributedSampler's: every other index, padded from the head.
        expected = [batch.tolist() for batch in reference(21, 4, rank, shuffle=False)]
        assert ranks[rank]["plain-padded"]["epochs"] == [expected, expected]
        dropped = [flat(epoch) for epoch in ranks[rank]["plain-dropped"]["epochs"]]
        assert [len(epoch) for epoch in dropped] == [8, 8]  # 10 of 21 per rank, then whole batches of 4
    for epoch in range(2):
        a, b = (flat(r["plain-dropped"]["epochs"][epoch]) for r in ranks)
        assert not set(a) & set(b)


def test_len_follows_the_world_size_at_the_time(ranks):
    for rank in range(2):
        got = {name: (ranks[rank][name]["len_before"], ranks[rank][name]["len_after"])
               for name in ("split-shuffled", "plain-padded", "plain-dropped")}
        one_process = {"split-shuffled": 7, "plain-padded": 6, "plain-dropped": 5}  # 20/3, 21/4 up, 21/4 down
        two_ranks = {"split-shuffled": len(reference(20, 3, rank)), "plain-padded": len(reference(21, 4, rank)),
                     "plain-dropped": len(reference(21, 4, rank, drop_last=True))}
        assert got == {name: (one_process[name], two_ranks[name]) for name in got}
        for name in got:
            assert len(ranks[rank][name]["epochs"][0]) == two_ranks[name]


@pytest.mark.parametrize("case", [*RESUME_CASES, "built-early"])
def test_rank_zeros_state_resumes_every_rank_exactly(ranks, case):
    for rank in range(2):
        got = ranks[rank][f"resume-{case}"]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        full = [b for epoch in got["full"] for b in epoch]
        # The batches after resume are those of the uninterrupted run on this rank, each once.
        assert got["head"] + [b for epoch in got["rest"] for b in epoch] == full
        assert got["head"] == full[: len(got["head"])]
    a, b = (flat(r[f"resume-{case}"]["full"][0]) for r in ranks)
    assert not set(a) & set(b)  # each rank resumed its own shard, not rank 0's


def _order(n: int, seed: int, epoch: int = 0) -> list[int]:
    """The epoch's order over every rank, as aioload computes it (ShardSampler over one rank)."""
    return list(ShardSampler(n, 0, 1, shuffle=True, drop_last=False, seed=seed))


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def test_a_state_from_another_world_size_resumes_on_this_one(ranks):
    order = _order(20, 3)
    for rank in range(2):
        # Saved in one process after 2 batches of 3: the other 14 samples, dealt over two ranks.
        assert ranks[rank]["load-one-process-state"] == {"loaded": _chunks(order[6:][rank::2], 3)}
        # Loaded before init_process_group, dealt when the epoch starts on the world it then has.
        assert ranks[rank]["iterate-one-process-state"] == ranks[rank]["load-one-process-state"]
        # Saved on two ranks after 2 batches each (positions 0-11), resumed alone: the rest in order.
        assert ranks[rank]["load-two-process-state-alone"] == {"loaded": _chunks(order[12:], 3)}


def test_a_state_listing_one_ranks_indices_is_refused_on_another(ranks):
    own = list(range(0, 20, 2))
    assert ranks[0]["load-other-ranks-indices"] == {"loaded": [own[i : i + 3] for i in range(3, 10, 3)]}
    assert ranks[1]["load-other-ranks-indices"] == {"error": (
        "ResumeError: this state lists the remaining indices of rank 0 (its sampler cannot be replayed, so "
        "they were written out), but this is rank 1: load into each rank the state it saved")}
