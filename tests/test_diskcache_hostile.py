"""The disk cache against a hostile local user, foreign files, odd entries and other processes.

Every test works on real files in ``tmp_path`` and finds the cache's files by walking the
folder, so it states what a user sees, whatever the layout. The suite runs as root: "another
user" is simulated with ``os.chown`` to uid 65534 and mode 0777.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
import threading
import time

import fsspec
import pytest
import torch
from torchvision.transforms import v2

import aioload
from tests.httpserver import Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = 65534


def entry_paths(directory) -> list[str]:
    """The cache's entries: the files that hold an object (not temporaries, not the lock)."""
    return sorted(os.path.join(d, f) for d, _, files in os.walk(directory) for f in files
                  if not f.startswith(".") and f != "lock")


def entry_bytes(directory) -> int:
    return sum(os.path.getsize(p) for p in entry_paths(directory))


def only_entry(directory) -> str:
    (path,) = entry_paths(directory)
    return path


def sibling(path: str) -> str:
    """A name next to the entry ``path`` that looks like another entry of the same subfolder."""
    folder, base = os.path.split(path)
    return os.path.join(folder, base[:2] + "0" * 62 + base[64:])


def memory_urls(tmp_path, n: int, size: int = 1000) -> dict[str, bytes]:
    """``n`` objects in fsspec's in-process memory filesystem (a remote store to the cache)."""
    fs = fsspec.filesystem("memory")
    objects = {f"memory://{tmp_path.name}/obj{i}": bytes([i % 256]) * size for i in range(n)}
    for url, data in objects.items():
        fs.pipe(url.removeprefix("memory://"), data)
    return objects


def read_all(storage: aioload.Storage, urls) -> list[bytes]:
    async def main():
        return [await storage.read_bytes(u) for u in urls]
    return asyncio.run(main())


# -- foreign files ------------------------------------------------------------------------------
def test_files_of_a_project_folder_are_never_evicted_or_cleared(tmp_path):
    project = tmp_path / "project"
    files = {"go/go.mod": b"module x\n", "go/go.sum": b"x v1 h1:abc\n", "js/.eslintrc": b"{}\n",
             "ab/notes.txt": b"notes\n", "README": b"read me\n"}
    for rel, content in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(content)
    old = time.time() - 30 * 86400  # older than anything the cache writes: first to be evicted
    for rel in files:
        os.utime(project / rel, (old, old))
    cache = aioload.DiskCache(project, 2000)
    for i in range(40):  # many evictions
        cache.put(f"http://h/{i}", bytes(500))
    assert cache.stats().evictions > 0
    cache.clear()
    assert {rel: (project / rel).read_bytes() for rel in files} == files


# -- a folder someone else can write in ----------------------------------------------------------
@pytest.mark.parametrize("owner, mode, message", [
    (NOBODY, 0o777, "belongs to uid 65534, not to this user"),
    (NOBODY, 0o755, "belongs to uid 65534, not to this user"),
    (None, 0o777, r"is writable by group or others \(mode 0777\)"),
    (None, 0o775, r"is writable by group or others \(mode 0775\)"),
])
def test_a_folder_others_can_write_in_is_refused(tmp_path, owner, mode, message):
    shared = tmp_path / "aioload-cache"
    shared.mkdir()
    os.chmod(shared, mode)
    if owner is not None:
        os.chown(shared, owner, owner)
    with pytest.raises(PermissionError, match=f"^DiskCache folder {shared} {message}") as info:
        aioload.DiskCache(shared, 10_000)
    assert "pass a folder of your own" in str(info.value).lower()
    assert os.listdir(shared) == []  # nothing was written there


def test_an_entry_planted_in_a_shared_folder_is_never_served(tmp_path):
    url = f"memory://{tmp_path.name}/photo.jpg"
    fsspec.filesystem("memory").pipe(url.removeprefix("memory://"), b"the real photo")
    shared = tmp_path / "shared"
    shared.mkdir()
    # The victim's cache wrote the entry once; another user, who made the folder, then replaces
    # its content with a well-formed entry of their own.
    aioload.DiskCache(shared, 10_000).put(url, b"the real photo")
    path = only_entry(shared)
    with open(path, "rb") as f:
        header = f.read()[: -len(b"the real photo")]
    with open(path, "wb") as f:
        f.write(header + b"forged bytes!!")  # same length, so a length check alone passes
    os.chmod(shared, 0o777)
    os.chown(shared, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        read_all(aioload.Storage(cache=aioload.DiskCache(shared, 10_000)), [url])


def test_a_planted_symlink_never_redirects_a_write(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    cache = aioload.DiskCache(tmp_path / "cache", 1 << 20)
    cache.put("http://h/a", b"v1")
    path = only_entry(tmp_path / "cache")
    folder, base = os.path.split(path)
    name = base.split(".")[0]
    # Links at the temporary names a writer of this process could predict, and at the entry's.
    for tmp in (f".{name}.{os.getpid()}.{threading.get_ident()}.tmp", f".{name}.tmp", f"{name}.tmp"):
        os.symlink(victim, os.path.join(folder, tmp))
    cache.put("http://h/a", b"v2")
    assert victim.read_bytes() == b"precious"
    assert aioload.DiskCache(tmp_path / "cache", 1 << 20).get("http://h/a") == b"v2"
    os.unlink(path)
    os.symlink(victim, path)  # the entry itself a link: a miss, and replaced by the next write
    fresh = aioload.DiskCache(tmp_path / "cache", 1 << 20)
    assert fresh.get("http://h/a") is None
    fresh.put("http://h/a", b"v3")
    assert victim.read_bytes() == b"precious" and fresh.get("http://h/a") == b"v3"


def test_a_symlinked_subfolder_is_never_scanned(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    cache_dir = tmp_path / "cache"
    aioload.DiskCache(cache_dir, 1 << 20).put("http://h/a", bytes(100))
    path = only_entry(cache_dir)
    store = os.path.dirname(os.path.dirname(path))
    pair = "cd" if os.path.basename(os.path.dirname(path)) != "cd" else "ce"
    # The victim's files, one named like an entry of that subfolder, all older than any entry.
    entry_like = pair + "0" * 62 + os.path.basename(path)[64:]
    victims = {"secret.txt": b"s" * 5000, entry_like: b"e" * 5000}
    for rel, content in victims.items():
        (home / rel).write_bytes(content)
        os.utime(home / rel, (1, 1))
    os.symlink(home, os.path.join(store, pair))
    cache = aioload.DiskCache(cache_dir, 1000)  # over budget: eviction at the first scan
    for i in range(20):
        cache.put(f"http://h/{i}", bytes(200))
    cache.clear()
    assert {rel: (home / rel).read_bytes() for rel in victims} == victims


# -- odd entries are misses, and the read goes to the storage -----------------------------------
def test_a_dangling_symlink_does_not_break_reads(tmp_path):
    objects = memory_urls(tmp_path, 3)
    urls = list(objects)
    read_all(aioload.Storage(cache=aioload.DiskCache(tmp_path / "cache", 1 << 20)), urls)
    first = entry_paths(tmp_path / "cache")[0]
    os.symlink(tmp_path / "gone", sibling(first))
    cache = aioload.DiskCache(tmp_path / "cache", 1 << 20)
    for _ in range(2):
        assert read_all(aioload.Storage(cache=cache), urls) == list(objects.values())
    assert cache.stats().hits == 2 * len(urls)


CHURN = """
import os, sys
files = {os.path.join(d, f): b"" for d, _, fs in os.walk(sys.argv[1])
         for f in fs if not f.startswith(".") and f != "lock"}
for path in files:
    with open(path, "rb") as f:
        files[path] = f.read()
folders = sorted({os.path.dirname(path) for path in files})
print("ready", flush=True)
while True:  # another program removing and rewriting files, moving folders away and back
    for path, content in files.items():
        try:
            os.unlink(path)
            with open(path, "wb") as f:
                f.write(content)
        except OSError:
            pass
    for folder in folders:
        try:
            os.rename(folder, folder + "-away")
            os.rename(folder + "-away", folder)
        except OSError:
            pass
"""


def test_entries_that_vanish_during_the_scan_are_misses(tmp_path):
    objects = memory_urls(tmp_path, 1000, size=10)
    urls = list(objects)
    read_all(aioload.Storage(cache=aioload.DiskCache(tmp_path / "cache", 1 << 30)), urls)
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path / "cache")], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert churn.stdout.readline() == "ready\n"
        for i in range(100):  # a new cache object scans the folder on its first read
            storage = aioload.Storage(cache=aioload.DiskCache(tmp_path / "cache", 1 << 30))
            assert read_all(storage, urls[i::200]) == [objects[u] for u in urls[i::200]]
    finally:
        churn.kill()
        churn.wait(timeout=30)
        churn.stdout.close()


def test_a_cache_that_cannot_work_falls_back_to_the_storage_and_says_so_once(tmp_path, caplog):
    objects = memory_urls(tmp_path, 4)
    urls = list(objects)
    cache = aioload.DiskCache(tmp_path / "cache", 1 << 20)
    read_all(aioload.Storage(cache=cache), urls[:1])
    subfolder = os.path.dirname(only_entry(tmp_path / "cache"))
    for p in os.listdir(subfolder):
        os.unlink(os.path.join(subfolder, p))
    os.rmdir(subfolder)
    with open(subfolder, "wb") as f:  # a file where the cache needs a folder: every access fails
        f.write(b"x")
    with caplog.at_level(logging.WARNING, logger="aioload"):
        for _ in range(3):
            assert read_all(aioload.Storage(cache=cache), urls) == list(objects.values())
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "cache") in warnings[0].getMessage()


def test_a_corrupt_entry_is_a_miss_and_is_removed(tmp_path):
    cache = aioload.DiskCache(tmp_path, 1 << 20)
    cache.put("http://h/a", b"0123456789")
    path = only_entry(tmp_path)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"X")  # one flipped byte, length unchanged
    assert cache.get("http://h/a") is None and not os.path.exists(path)
    assert cache.stats().entries == 0 and cache.stats().bytes == 0


@pytest.fixture
def image_server(image_root):
    with Server(image_root) as srv:
        yield srv


def test_a_loader_reads_past_a_corrupt_entry(image_server, image_root, tmp_path):
    names = sorted(os.path.relpath(os.path.join(d, f), image_root) for d, _, fs in os.walk(image_root)
                   for f in fs if f.endswith(".jpg"))[:8]
    urls, labels = [image_server.url(n) for n in names], list(range(len(names)))

    def epoch() -> dict[int, torch.Tensor]:
        ds = aioload.ImageFiles(urls, labels, transform=v2.CenterCrop(32), cache=aioload.DiskCache(tmp_path, 1 << 26))
        with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
            return {int(t): img for images, targets in loader for img, t in zip(images, targets)}

    first = epoch()
    assert sum(image_server.requests.values()) == len(urls)
    damaged = entry_paths(tmp_path)[3]
    with open(damaged, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(bytes(50))  # zeros inside the JPEG's scan data
    second = epoch()
    assert sum(image_server.requests.values()) == len(urls) + 1  # the damaged one, read again
    assert all(torch.equal(first[k], second[k]) for k in labels)


# -- permissions, one budget per folder ---------------------------------------------------------
def test_folders_are_private_and_files_are_0600(tmp_path):
    cache_dir = tmp_path / "new" / "cache"
    cache = aioload.DiskCache(cache_dir, 1 << 20)
    for i in range(5):
        cache.put(f"http://h/{i}", bytes(10))
    paths = [str(cache_dir)] + [os.path.join(d, n) for d, dirs, files in os.walk(cache_dir) for n in dirs + files]
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in paths}
    assert len(paths) > 5
    assert {p: oct(m) for p, m in modes.items() if m != (0o700 if os.path.isdir(p) else 0o600)} == {}


SHARER = """
import sys
import aioload
cache = aioload.DiskCache(sys.argv[1], 200_000)
cache.stats()  # the folder is scanned now, as by a loader already running
print("ready", flush=True)
sys.stdin.readline()
for i in range(20):
    cache.put(f"http://h/{sys.argv[2]}/{i}", bytes(10_000))
print("done", flush=True)
"""


def test_two_processes_sharing_a_folder_share_its_budget(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), tag], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) for tag in "ab"]
    try:
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        assert [p.stdout.readline() for p in procs] == ["done\n"] * 2
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
            p.stdout.close()
    size = os.path.getsize(entry_paths(tmp_path)[0])
    assert entry_bytes(tmp_path) <= 200_000
    assert len(entry_paths(tmp_path)) == 200_000 // size  # the budget is used, not wasted
    stats = aioload.DiskCache(tmp_path, 200_000).stats()
    assert (stats.bytes, stats.entries) == (entry_bytes(tmp_path), len(entry_paths(tmp_path)))


def test_a_hit_in_another_process_counts_as_a_use(tmp_path):
    cache = aioload.DiskCache(tmp_path, 3 * (100 + 20))
    for key in "abc":
        cache.put(f"http://h/{key}", bytes(100))
    hit = "import sys, aioload; sys.exit(aioload.DiskCache(sys.argv[1], 360).get('http://h/a') is None)"
    subprocess.run([sys.executable, "-c", hit, str(tmp_path)], env={**os.environ, "PYTHONPATH": REPO}, check=True,
                   timeout=120)
    cache.put("http://h/d", bytes(100))  # evicts b, the least recently used in the folder
    assert [cache.get(f"http://h/{k}") is not None for k in "abcd"] == [True, False, True, True]


# -- keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_name_that_looks_like_a_range_key_gets_its_own_content(tmp_path, kind):
    fs = fsspec.filesystem("memory")
    base = f"memory://{tmp_path.name}-{kind}/a"
    fs.pipe(base.removeprefix("memory://"), b"0123456789")
    fs.pipe(f"{base}#bytes=0+4".removeprefix("memory://"), b"another file")
    cache = aioload.MemoryCache(1 << 20) if kind == "memory" else aioload.DiskCache(tmp_path, 1 << 20)
    storage = aioload.Storage(cache=cache)

    async def main():
        return await storage.read_range(base, 0, 4), await storage.read_bytes(f"{base}#bytes=0+4")

    assert asyncio.run(main()) == (b"0123", b"another file")


def test_a_local_file_named_like_a_range_key_gets_its_own_content(tmp_path):
    (tmp_path / "a").write_bytes(b"0123456789")
    (tmp_path / "a#bytes=0+4").write_bytes(b"another file")
    storage = aioload.Storage(cache=aioload.MemoryCache(1 << 20))

    async def main():
        return (await storage.read_range(tmp_path / "a", 0, 4),
                await storage.read_bytes(tmp_path / "a#bytes=0+4"))

    assert asyncio.run(main()) == (b"0123", b"another file")
