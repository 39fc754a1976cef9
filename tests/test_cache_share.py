"""One cache bound for a loader's processes together: each worker's part is the whole split
among the workers (real worker processes), and the whole follows the cgroup's memory limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aioload
from aioload._storage.cache import LOADER_CACHE_BYTES, LoaderShare, loader_cache_bytes, memory_limit

pytestmark = pytest.mark.timeout(120)


class Parts(torch.utils.data.Dataset):
    """Each sample is the part of ``share`` that the process loading it gets."""

    def __init__(self, share):
        self.share = share

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return int(self.share)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_each_worker_gets_its_part_of_the_loader_wide_bound(context):
    share = LoaderShare(total=1 << 30, fraction=0.5)
    assert int(share) == 1 << 29  # the training process (num_workers=0) has it all
    with aioload.DataLoader(Parts(share), batch_size=2, num_workers=2, multiprocessing_context=context) as loader:
        assert {n for batch in loader for n in batch.tolist()} == {(1 << 29) // 2}


@pytest.mark.unit
def test_the_default_bound_follows_the_cgroup_limit(tmp_path):
    (tmp_path / "memory.max").write_text("2147483648\n")  # a 2 GiB container
    assert memory_limit(str(tmp_path)) == 2 << 30
    assert loader_cache_bytes(str(tmp_path)) == (2 << 30) // 8
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's memory
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert memory_limit(str(tmp_path)) == total
    assert loader_cache_bytes(str(tmp_path)) == min(LOADER_CACHE_BYTES, total // 8)


@pytest.mark.unit
def test_a_parquet_dataset_bounds_its_caches_loader_wide_by_default(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": list(range(10))}), tmp_path / "a.parquet")
    ds = aioload.Parquet([str(tmp_path / "a.parquet")], columns=["key"], footer_cache=False)
    assert int(ds._cache.max_bytes) + int(ds._pages.max_bytes) == loader_cache_bytes()
    fixed = aioload.Parquet([str(tmp_path / "a.parquet")], columns=["key"], footer_cache=False, cache_bytes=1000)
    assert (fixed._cache.max_bytes, fixed._pages.max_bytes) == (1000, 1000)


@pytest.mark.unit
def test_what_a_datasets_caches_hold_is_found_through_its_attributes():
    from aioload._base.walk import caches_of, held_bytes
    from aioload._storage.cache import MemoryCache

    class Holder:
        def __init__(self):
            self.storage = aioload.Storage(cache=MemoryCache(1 << 20))
            self.names = ["x"] * 2000  # a large container: not looked into

    holder = Holder()
    caches = caches_of(holder)
    assert caches == [holder.storage.cache]
    holder.storage.cache.put("a", b"x" * 100)
    holder.storage.cache.put("b", b"y" * 28)
    assert held_bytes(caches) == {"memory_cache": 128} and holder.storage.cache.stats().bytes == 128


@pytest.mark.parametrize("window", [None, 2])
def test_stats_give_what_the_workers_parquet_caches_hold(tmp_path, window):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    rng = np.random.default_rng(0)  # incompressible: the caches hold about what the rows weigh
    pq.write_table(pa.table({"key": list(range(200)), "blob": [rng.bytes(1000) for _ in range(200)]}),
                   path, row_group_size=50, write_page_index=True, data_page_size=4096)
    ds = aioload.Parquet([str(path)], columns=["key", "blob"], footer_cache=False, window=window,
                         cache_bytes=1 << 20)
    with aioload.DataLoader(ds, batch_size=10, num_workers=2, shuffle=True, seed=0) as loader:
        assert sorted(k for batch in loader for k in batch["key"].tolist()) == list(range(200))
        s = loader.stats()
    held = s.parquet_page_bytes if window is None else s.parquet_row_group_bytes
    other = s.parquet_row_group_bytes if window is None else s.parquet_page_bytes
    # every row's bytes went through the workers' caches, each bounded at 1 MiB a worker
    assert 200 * 1000 <= held <= 2 * (1 << 20), s
    assert other == 0, s
