"""Window mode's shards fetched by the workers (``window_fetch="workers"``, the default with
workers; :mod:`aioload._workers.fetches`): the training process receives none of a shard's
bytes, the batches are those the loader's own fetches give, a shard that cannot be fetched
fails each of its samples naming its URL, and an epoch left with fetches in flight leaves
nothing behind (in the training process nor in the workers) and the next epoch runs."""

from __future__ import annotations

import os
import re
import time

import pytest

import aioload
from tests.httpserver import Server
from tests.resources import gone, wait_until
from tests.shards_data import fingerprint, image_samples, write_webdataset
from tests.test_shards_shm import none_left

PATTERN = "wds-{000000..000004}.tar"


@pytest.fixture(scope="module")
def folder(image_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("fetch-shards")
    write_webdataset(image_samples(image_root), root, 10)  # 48 images: 5 shards
    return root


@pytest.fixture
def server(folder):
    with Server(folder) as s:
        yield s


pytestmark = pytest.mark.usefixtures("private_cache")  # indexes kept in the test's own folder


def dataset(server, fetch: str = "workers", **kwargs) -> aioload.WebDataset:
    return aioload.WebDataset(server.url(PATTERN), decode=fingerprint, window=2, window_fetch=fetch, **kwargs)


def loader_of(ds, workers: int = 2, **kwargs) -> aioload.DataLoader:
    return aioload.DataLoader(ds, shuffle=True, seed=3, batch_size=4, num_workers=workers, **kwargs)


def read_bytes_of_this_process() -> int:
    """Bytes this process has read with read() and its kind (sockets included), all threads."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def batches(loader) -> list:
    return [[tuple(x) for x in zip(k, d, c.tolist())] for k, d, c in loader]


def test_the_workers_receive_the_shards_and_the_batches_are_the_loaders_own(server):
    shard_bytes = int(dataset(server).shard_sizes.sum())
    got, received = {}, {}
    for fetch in ("loader", "workers"):
        ds = dataset(server, fetch)
        assert ds.fetch_in_workers == (fetch == "workers")
        with loader_of(ds) as loader:
            before = read_bytes_of_this_process()
            got[fetch] = batches(loader)
            received[fetch] = read_bytes_of_this_process() - before
            stats = loader.stats()
        assert stats.shard_fetches == 5 and stats.shard_fetch_bytes == shard_bytes and stats.shard_window_bytes == 0
    assert got["workers"] == got["loader"]  # the same samples, in the same batches and order
    assert received["loader"] >= shard_bytes  # the loader's loop received every shard here...
    assert received["workers"] < shard_bytes // 4  # ...the workers did, and this process only the batches


def test_without_workers_or_on_a_local_disk_nothing_is_fetched_by_workers(server, folder):
    assert not aioload.WebDataset(str(folder / PATTERN), decode=fingerprint, window=2).fetch_in_workers
    ds = dataset(server)
    with loader_of(ds, workers=0) as loader:  # the loader's own loop receives the shards
        assert sum(len(b) for b in batches(loader)) == len(ds)
    with pytest.raises(ValueError, match="window_fetch must be 'workers' or 'loader'"):
        dataset(server, "main")


def test_a_shard_that_cannot_be_fetched_fails_its_samples_naming_its_url(server):
    once = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=30))
    ds = dataset(server, storage=once)
    server.script("wds-000002.tar", "truncate")  # its one fetch of the epoch
    with loader_of(ds, on_error="skip") as loader:
        seen = sum(len(b) for b in batches(loader))
        stats = loader.stats()
    assert seen == len(ds) - ds.shard_lengths[2]  # every other shard's samples arrived
    assert stats.skipped_total == ds.shard_lengths[2]
    with loader_of(ds) as loader:
        server.script("wds-000002.tar", "truncate")
        with pytest.raises(aioload.RemoteReadError, match=r"wds-000002\.tar.*truncated body") as raised:
            batches(loader)
    assert any(re.match(r"while reading dataset index 2\d \(shard .*wds-000002\.tar", note)
               for note in raised.value.__notes__)


@pytest.mark.serial  # no /dev/shm entry of aioload's, whoever made it
@pytest.mark.parametrize("persistent", [False, True])
def test_an_epoch_left_with_fetches_in_flight_leaves_nothing_and_the_next_runs(server, persistent):
    ds = dataset(server, fetch_ahead=3)
    server.latency = 0.3  # fetches are still on their way when the loop is left
    loader = loader_of(ds, persistent_workers=persistent)
    try:
        for i, _ in enumerate(loader):
            pids = [p.pid for p in loader._res.pool.procs]
            if i == 0:
                break
        started = time.monotonic()
        wait_until(lambda: none_left(["self", *[p for p in pids if not gone(p)]]), 10,
                   "the shards of the epoch left by break to go")
        assert time.monotonic() - started < 10
        assert ds._window.held_bytes == 0
        server.latency = 0.0
        assert sum(len(b) for b in batches(loader)) == len(ds)  # the next epoch, whole
    finally:
        loader.close()
    wait_until(lambda: none_left(["self"]), 10, "the shards to go with close()")
    assert all(gone(pid) for pid in pids)
    assert not [name for name in os.listdir("/dev/shm") if "aioload" in name]
