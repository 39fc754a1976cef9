"""Local reads answered from the page cache in the calling thread (aioload._storage.nowait)."""

from __future__ import annotations

import os
import pickle

import pytest

import aioload
from aioload._data.dataset import NOT_READY
from aioload._storage import nowait as _nowait
from aioload._storage.cache import MemoryCache
from aioload._storage.nowait import NoWait
from aioload._storage.storage import Storage

pytestmark = pytest.mark.skipif(not NoWait().supported, reason="preadv2(RWF_NOWAIT) is Linux's")


def open_fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd")))


def test_a_cached_local_range_is_read_whole_and_other_reads_are_left_to_the_usual_way(tmp_path):
    path = tmp_path / "data.bin"
    data = os.urandom(300_000)
    path.write_bytes(data)
    reader = NoWait()
    got = reader.read(Storage(), str(path), 1000, 150_000)
    assert got == data[1000:151_000]
    assert reader.read(Storage(), str(path), 299_000, 5000) is None  # past the end: short, the usual read says so
    assert reader.read(Storage(), "http://127.0.0.1:1/data.bin", 0, 10) is None
    assert reader.read(Storage(), str(tmp_path / "missing.bin"), 0, 10) is None
    cached = Storage(cache=MemoryCache(1 << 20))
    assert reader.read(cached, str(path), 0, 10) is None  # a storage that caches local reads keeps doing so
    reader.close()


def test_descriptors_are_bounded_closed_with_the_reader_and_not_copied(tmp_path, monkeypatch):
    monkeypatch.setattr(_nowait, "MAX_OPEN", 3)
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * 100)
    before = open_fds()
    reader = NoWait()
    for p in paths:
        assert reader.read(Storage(), str(p), 10, 5) == bytes([int(p.name[1])]) * 5
    assert len(open_fds() - before) == 3
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.read(Storage(), str(paths[0]), 0, 1) == b"\x00"
    assert len(open_fds() - before) == 4
    del reader, copy
    assert open_fds() - before == set()


def test_parquet_pages_in_the_page_cache_are_read_without_the_loop(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"k": list(range(1000)), "blob": [os.urandom(3000) for _ in range(1000)]}), path,
                   row_group_size=250, data_page_size=4096, write_page_index=True)
    expected = pq.read_table(path).to_pylist()
    ds = aioload.Parquet(str(path))
    assert ds.read_nowait(0) is NOT_READY  # the page index is fetched by the first read
    assert [ds[i] for i in (0, 999, 517)] == [expected[i] for i in (0, 999, 517)]
    for index in (333, 334, 700):  # pages never read before: read here, from the page cache
        raw = ds.read_nowait(index)
        assert raw is not NOT_READY and ds.decode(raw) == expected[index]
