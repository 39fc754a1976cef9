"""``aioload.Parquet`` under the loader's plan: equal batches on every rank, and exact resume
from a mid-epoch state on the same and on another world size, with 0 and 2 workers, in
uniform and window mode. Ranks are played one after another in this process by torch's fake
process group (the loader reads its rank and world size from it); the loaders are real, with
real worker processes."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

import aioload
from tests.parquet_data import image_samples, write_pyarrow

BATCH = 5
SEED = 7
K = 2  # batches delivered on each rank before the save


@pytest.fixture(scope="module", params=["row groups", "pages"])
def files(image_root, tmp_path_factory, request):
    """Without a page index (a uniform shuffle reads row groups), and with one and a page per
    row (it reads pages)."""
    options = {"write_page_index": True, "max_rows_per_page": 1} if request.param == "pages" else {}
    return write_pyarrow(image_samples(image_root), tmp_path_factory.mktemp("pq-resume"), per_file=20,
                         row_group_size=6, **options)


pytestmark = pytest.mark.usefixtures("private_cache")  # footers kept in the test's own folder


@contextlib.contextmanager
def world(size: int, rank: int):
    """Rank ``rank`` of ``size`` (no process group at all for one rank)."""
    if size == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def keys(rows) -> list[str]:
    return [row["key"] for row in rows]


def run(ds, workers: int, size: int, rank: int, *, state=None, stop: int | None = None):
    """Rank ``rank``'s batches of epoch 0 (from ``state`` if given), and its state after ``stop``."""
    with world(size, rank):
        with aioload.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=SEED, num_workers=workers,
                                collate_fn=keys) as loader:
            if state is not None:
                loader.load_state_dict(state)
            out = []
            for batch in loader:
                out.append(batch)
                if len(out) == stop:
                    return out, loader.state_dict()
            return out, None


@pytest.mark.parametrize("window", [None, 3])
def test_every_rank_gets_the_same_number_of_batches(files, window):
    ds = aioload.Parquet(files, columns=["key"], window=window)
    per_rank = [run(ds, 0, 5, rank)[0] for rank in range(5)]  # 48 rows: 10 a rank, 2 repeated
    assert [len(b) for b in per_rank] == [2] * 5 and all(len(b) == BATCH for r in per_rank for b in r)
    seen = Counter(k for r in per_rank for b in r for k in b)
    assert set(seen) == {ds[i]["key"] for i in range(len(ds))} and sum(seen.values()) == 50
    order = ds.epoch_order(SEED, 0, True).tolist()
    padded = order + order[:2]  # DistributedSampler's rule: the order's head repeated
    if window is None:  # uniform: every 5th row of the order; window: contiguous blocks
        assert per_rank[1][0] == [ds[i]["key"] for i in padded[1::5][:BATCH]]
    else:
        assert per_rank[1][0] == [ds[i]["key"] for i in padded[10:15]]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("window", [None, 3])
def test_a_state_resumes_the_epoch_exactly_on_the_same_world(files, workers, window):
    ds = aioload.Parquet(files, columns=["key"], window=window)
    full, _ = run(ds, workers, 1, 0)
    first, state = run(ds, workers, 1, 0, stop=K)
    rest, _ = run(ds, workers, 1, 0, state=state)
    assert first == full[:K] and rest == full[K:]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("window", [None, 3])
def test_a_state_saved_on_two_ranks_resumes_on_three(files, workers, window):
    ds = aioload.Parquet(files, columns=["key"], window=window)
    full = [run(ds, 0, 2, rank)[0] for rank in range(2)]
    saved = [run(ds, workers, 2, rank, stop=K) for rank in range(2)]
    assert [batches for batches, _ in saved] == [f[:K] for f in full]
    rest = Counter(k for f in full for b in f[K:] for k in b)
    resumed = [run(ds, workers, 3, rank, state=saved[0][1])[0] for rank in range(3)]  # rank 0's state
    counts = [len(r) for r in resumed]
    assert len(set(counts)) == 1, f"every rank gets the same number of batches, got {counts}"
    got = Counter(k for r in resumed for b in r for k in b)
    pad = -sum(rest.values()) % 3
    assert set(got) == set(rest) and sum(got.values()) == sum(rest.values()) + pad
