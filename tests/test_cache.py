"""Caches of raw bytes: hits, byte budgets, eviction, restarts, and use by loaders."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import time

import pytest
import torch
from torchvision.transforms import v2

import aioload
from tests.httpserver import Server


def blob(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def disk_paths(directory) -> list[str]:
    """Every file under the cache's subfolders (entries and temporaries), found by walking."""
    return [os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f != "lock"]


def disk_bytes(directory) -> int:
    return sum(os.path.getsize(p) for p in disk_paths(directory) if p.endswith(".entry"))


def disk_files(directory) -> list[str]:
    return [os.path.basename(p) for p in disk_paths(directory)]


# -- memory -----------------------------------------------------------------------------------
def test_memory_cache_hits_and_misses():
    cache = aioload.MemoryCache(1000)
    assert cache.get("a") is None
    cache.put("a", blob(1))
    assert cache.get("a") == blob(1)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 1, 1, 100)
    assert stats.hit_rate == 0.5


def test_memory_cache_keeps_the_first_objects_within_budget():
    cache = aioload.MemoryCache(350)
    for i in range(6):
        cache.put(f"k{i}", blob(i))
    stats = cache.stats()
    assert stats.bytes <= 350 and stats.entries == 3 and stats.rejected == 3 and stats.evictions == 0
    assert [cache.get(f"k{i}") is not None for i in range(6)] == [True] * 3 + [False] * 3


def test_memory_cache_lru_evicts_the_least_recently_used():
    cache = aioload.MemoryCache(300, eviction="lru")
    for key in ("a", "b", "c"):
        cache.put(key, blob(0))
    cache.get("a")  # now b is the least recently used
    cache.put("d", blob(0))
    assert [cache.get(k) is not None for k in "abcd"] == [True, False, True, True]
    stats = cache.stats()
    assert stats.bytes <= 300 and stats.evictions == 1


def test_memory_cache_rejects_objects_larger_than_the_budget():
    cache = aioload.MemoryCache(50, eviction="lru")
    cache.put("big", blob(0, 51))
    assert cache.get("big") is None and cache.stats().rejected == 1


def test_memory_cache_validates():
    with pytest.raises(ValueError, match=r"^max_bytes must be >= 0, got -1$"):
        aioload.MemoryCache(-1)
    with pytest.raises(ValueError, match=r"^eviction must be 'none' or 'lru', got 'fifo'$"):
        aioload.MemoryCache(10, eviction="fifo")
    with pytest.raises(TypeError, match=r"^cache must be an aioload.MemoryCache or aioload.DiskCache, got dict$"):
        aioload.Storage(cache={})


def test_caches_travel_to_workers_without_their_contents(tmp_path):
    cache = aioload.MemoryCache(10_000_000)
    for i in range(50):
        cache.put(str(i), blob(i, 100_000))
    ds = aioload.ImageFiles(["a.jpg"], cache=cache)
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 10_000
    assert copy.storage.cache.max_bytes == 10_000_000 and copy.storage.cache.stats().entries == 0
    disk = pickle.loads(pickle.dumps(aioload.DiskCache(tmp_path, 1000)))
    assert disk.directory == str(tmp_path) and disk.max_bytes == 1000


# -- disk -------------------------------------------------------------------------------------
def test_disk_cache_survives_a_restart(tmp_path):
    aioload.DiskCache(tmp_path, 10_000).put("http://h/a", blob(7))
    again = aioload.DiskCache(tmp_path, 10_000)
    assert again.get("http://h/a") == blob(7)
    assert again.stats().entries == 1 and again.stats().hits == 1


def test_disk_cache_evicts_least_recently_used_within_budget(tmp_path):
    size = 100 + 20  # object + header (magic, length, checksum)
    cache = aioload.DiskCache(tmp_path, 3 * size)
    for key in "abc":
        cache.put(key, blob(0))
    cache.get("a")
    cache.put("d", blob(0))  # evicts b
    assert [cache.get(k) is not None for k in "abcd"] == [True, False, True, True]
    assert cache.stats().bytes == disk_bytes(tmp_path) <= 3 * size
    # Recency is kept on disk: after a restart, c is now the least recently used.
    restarted = aioload.DiskCache(tmp_path, 3 * size)
    restarted.get("a")
    restarted.get("d")
    restarted.put("e", blob(0))
    assert [restarted.get(k) is not None for k in "acde"] == [True, False, True, True]
    assert disk_bytes(tmp_path) <= 3 * size


def test_disk_cache_budget_holds_under_many_writes(tmp_path):
    cache = aioload.DiskCache(tmp_path, 5000)
    for i in range(200):
        cache.put(f"k{i}", blob(i, 50 + i * 7 % 300))
        assert disk_bytes(tmp_path) <= 5000
    stats = cache.stats()
    assert stats.bytes == disk_bytes(tmp_path) and stats.evictions > 0
    assert not [n for n in disk_files(tmp_path) if n.startswith(".")]  # no temporary file left


def test_disk_cache_drops_damaged_files_and_stale_temporaries(tmp_path):
    cache = aioload.DiskCache(tmp_path, 10_000)
    cache.put("x", blob(1))
    (path,) = disk_paths(tmp_path)
    name = os.path.basename(path).removesuffix(".entry")
    with open(path, "r+b") as f:
        f.truncate(50)  # as a torn write would leave it
    assert cache.get("x") is None and not os.path.exists(path)
    assert cache.stats().entries == 0 and cache.stats().bytes == 0
    folder = os.path.dirname(path)
    stale = os.path.join(folder, f".{name}.{'1' * 16}.tmp")
    fresh = os.path.join(folder, f".{name}.{'2' * 16}.tmp")
    for p, content in ((stale, b"partial"), (fresh, b"being written")):
        with open(p, "wb") as f:
            f.write(content)
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert aioload.DiskCache(tmp_path, 10_000).stats().entries == 0
    assert not os.path.exists(stale) and os.path.exists(fresh)


def test_disk_cache_skips_local_files_but_memory_cache_keeps_them(tmp_path):
    (tmp_path / "f.bin").write_bytes(blob(3))
    disk = aioload.DiskCache(tmp_path / "cache", 10_000)
    memory = aioload.MemoryCache(10_000)

    async def main():
        await aioload.read_bytes(tmp_path / "f.bin", storage=aioload.Storage(cache=disk))
        await aioload.read_bytes(tmp_path / "f.bin", storage=aioload.Storage(cache=memory))

    asyncio.run(main())
    assert disk.stats().entries == 0 and memory.stats().entries == 1


# -- with loaders -----------------------------------------------------------------------------
@pytest.fixture
def image_server(image_root):
    with Server(image_root) as srv:
        yield srv


def urls_and_labels(server, root):
    names = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".jpg"))
    return [server.url(n) for n in names], list(range(len(names)))


def epoch(ds, **kwargs) -> dict[int, torch.Tensor]:
    out = {}
    with aioload.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, **kwargs) as loader:
        for images, labels in loader:
            out.update(zip(labels.tolist(), images))
    return out


def test_memory_cache_serves_later_epochs_from_ram(image_server, image_root):
    urls, labels = urls_and_labels(image_server, image_root)
    cache = aioload.MemoryCache(64 << 20)
    ds = aioload.ImageFiles(urls, labels, transform=v2.CenterCrop(32), cache=cache)
    first = epoch(ds)
    assert sum(image_server.requests.values()) == len(urls)
    second = epoch(ds)
    assert sum(image_server.requests.values()) == len(urls)  # no request in epoch 2
    assert first.keys() == second.keys() == set(labels)
    assert all(torch.equal(first[k], second[k]) for k in labels)
    stats = cache.stats()
    assert stats.hits == len(urls) and stats.entries == len(urls)


def test_memory_cache_smaller_than_the_dataset_holds_its_budget(image_server, image_root):
    urls, labels = urls_and_labels(image_server, image_root)
    sizes = sorted(os.path.getsize(os.path.join(image_root, u.split("/", 3)[3])) for u in urls)
    budget = sum(sizes[: len(sizes) // 3])
    cache = aioload.MemoryCache(budget)
    ds = aioload.ImageFiles(urls, labels, transform=v2.CenterCrop(32), cache=cache)
    with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
        for _ in range(2):
            assert sum(len(lab) for _, lab in loader) == len(urls)
    stats = cache.stats()
    assert 0 < stats.bytes <= budget
    assert sum(image_server.requests.values()) == 2 * len(urls) - stats.entries


def test_memory_cache_on_a_local_folder_reads_each_file_once(image_root, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(image_root, root)
    ds = aioload.ImageFolder(root, transform=v2.CenterCrop(32), cache=aioload.MemoryCache(64 << 20))

    def targets() -> list[int]:
        with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
            return [t for _, labels in loader for t in labels.tolist()]

    first = targets()
    shutil.rmtree(root)  # a second epoch that read the disk would fail now
    assert targets() == first == ds.targets


def test_disk_cache_is_reused_by_a_later_loader(image_server, image_root, tmp_path):
    urls, labels = urls_and_labels(image_server, image_root)
    crop = v2.CenterCrop(32)
    first = epoch(aioload.ImageFiles(urls, labels, transform=crop, cache=aioload.DiskCache(tmp_path, 64 << 20)))
    assert sum(image_server.requests.values()) == len(urls)
    # A new cache object over the same directory: what a restarted job sees.
    cache = aioload.DiskCache(tmp_path, 64 << 20)
    second = epoch(aioload.ImageFiles(urls, labels, transform=crop, cache=cache))
    assert sum(image_server.requests.values()) == len(urls)
    assert all(torch.equal(first[k], second[k]) for k in labels)
    assert cache.stats().hits == len(urls)


def test_ranges_and_whole_objects_are_cached_apart(image_server, image_root):
    urls, _ = urls_and_labels(image_server, image_root)
    storage = aioload.Storage(cache=aioload.MemoryCache(1 << 20))

    async def main():
        head = await storage.read_range(urls[0], 0, 10)
        whole = await storage.read_bytes(urls[0])
        again = await storage.read_range(urls[0], 0, 10)
        return head, whole, again

    head, whole, again = asyncio.run(main())
    assert head == again == whole[:10] and len(whole) > 10
    assert image_server.requests[urls[0].split("/", 3)[3]] == 2
