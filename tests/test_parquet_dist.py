"""``aioload.Parquet`` (uniform and ``window=2``) and ``aioload.PackedTokens`` over Parquet files
with real ``torchrun`` ranks (gloo on 127.0.0.1, two workers per rank): rank 0's mid-epoch
state resumes every rank exactly on the same number of ranks, and on another one the rest of
the epoch is dealt again, each sample once (up to the remainder rule's padding), in equal
numbers of batches (tests/frameworks/parquet_run.py).

The files are written here by pyarrow: rows with an ``id`` column (a Parquet row is read as
its id) and documents of token ids that say where they come from (``tests/test_tokens.py``'s
``documents``), packed into rows identified by their tokens. The reference is the epoch's
order computed here (the documents packed from memory for the tokens), dealt as the loader's
remainder rule says.
"""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import aioload
from aioload._plan.deal import Deal
from tests.frameworks.launch import LAUNCH_TIMEOUT, run, torchrun_args
from tests.frameworks.parquet_run import BATCH, EPOCH, K, KINDS, SEED, SEQ
from tests.test_tokens import documents

pytestmark = [pytest.mark.timeout(3 * LAUNCH_TIMEOUT + 60), pytest.mark.slow]
IDS = [7 * i + 3 for i in range(48)]  # ids that are not the row's index
DOCS = documents(n=22, seed=30)  # packed into 36 rows of SEQ + 1 tokens


def write(folder, name: str, column: str, values: list, parts, row_group_size: int, kind=None) -> None:
    for n, (a, b) in enumerate(parts):
        pq.write_table(pa.table({column: pa.array(values[a:b], type=kind)}), folder / f"{name}-{n}.parquet",
                       row_group_size=row_group_size)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    data, out = tmp_path_factory.mktemp("parquet-dist-data"), tmp_path_factory.mktemp("parquet-dist")
    write(data, "ids", "id", IDS, [(0, 30), (30, 48)], 7)  # row groups of 7 (the last of each file shorter)
    write(data, "docs", "input_ids", DOCS, [(0, 12), (12, 22)], 4, pa.list_(pa.int64()))
    for phase, world in (("first", 2), ("rest", 2), ("rest", 3)):
        cache = out / f"cache-{phase}{world}"  # each job's own footer cache
        run(torchrun_args("parquet_run.py", [phase, str(data), str(out)], nproc=world),
            env={"AIOLOAD_CACHE": str(cache)})

    def read(name: str, world: int) -> list[dict]:
        return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]

    return data, read("first", 2), read("rest2", 2), read("rest3", 3)


def epoch(kind: str, data) -> tuple[list, str]:
    """The epoch's samples in the order of the sequence dealt to the ranks (each once), and the deal."""
    if kind == "tokens":
        ds = aioload.PackedTokens(DOCS, SEQ)
        samples = [tuple(ds[r]["input_ids"].tolist()) for r in range(len(ds))]
    else:  # the rows' index space: the files' rows in turn, IDS's order
        ds = aioload.Parquet(sorted(str(p) for p in data.glob("ids-*.parquet")), columns=["id"],
                             window=2 if kind == "window" else None, footer_cache=False)
        samples = IDS
    return [samples[int(i)] for i in ds.epoch_order(SEED, EPOCH, True)], ds.deal


def flat(kind: str, batches: list) -> list:
    """The samples of ``batches``, in order: ids, or rows of token ids as tuples."""
    return [tuple(row) if kind == "tokens" else row for batch in batches for row in batch]


@pytest.mark.parametrize("kind", KINDS)
def test_the_ranks_share_the_epoch_each_sample_once_in_the_dealt_order(jobs, kind):
    data, first, _, _ = jobs
    order, deal = epoch(kind, data)
    assert len(order) % 2 == 0  # no padding on 2 ranks: the union below is the epoch itself
    per_rank = [flat(kind, run[kind]["full"]) for run in first]
    assert Counter(s for samples in per_rank for s in samples) == Counter(order)
    assert len(first[0][kind]["full"]) == len(first[1][kind]["full"]) > K
    for rank, samples in enumerate(per_rank):
        assert samples == [order[p] for p in Deal(2, BATCH, False, deal).positions(len(order), rank)]


@pytest.mark.parametrize("kind", KINDS)
def test_rank_0s_state_resumes_each_rank_of_the_same_world_exactly(jobs, kind):
    _, first, rest, _ = jobs
    for rank in range(2):
        full = first[rank][kind]["full"]
        assert first[rank][kind]["first"] == full[:K], rank
        assert rest[rank][kind] == full[K:], rank


@pytest.mark.parametrize("kind", KINDS)
def test_rank_0s_state_deals_the_rest_of_the_epoch_over_three_ranks(jobs, kind):
    data, first, _, rest = jobs
    order, deal = epoch(kind, data)
    delivered = [s for run in first for s in flat(kind, run[kind]["first"])]
    done = set(delivered)
    left = [s for s in order if s not in done]  # the rest, in the order of the epoch
    pad = -len(left) % 3
    assert pad > 0  # the data make the rule below pad: 3 ranks do not divide the rest
    resumed = [flat(kind, run[kind]) for run in rest]
    # every sample of the epoch once, and the rest's first `pad` samples again (drop_last=False)
    assert Counter(delivered) + Counter(s for r in resumed for s in r) == Counter(order) + Counter(left[:pad])
    counts = [len(run[kind]) for run in rest]
    assert len(set(counts)) == 1 and counts[0] > 0, f"every rank gets the same number of batches, got {counts}"
    for rank, samples in enumerate(resumed):  # dealt as a fresh epoch of the rest would be
        assert samples == [left[p] for p in Deal(3, BATCH, False, deal).positions(len(left), rank)], rank
