"""``aioload.WebDataset`` over real stores on 127.0.0.1: an HTTP server with Range support and
faults on demand (``tests/httpserver.py``), and S3 through moto's server. What each mode asks
the store for (one range per sample, or one GET per shard), that what arrives is what the
shards hold, and what 5xx answers, missing and truncated shards and a hung server do."""

from __future__ import annotations

import gc
import logging
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import aioload
from aioload._storage import h1
from aioload._storage import scope as _scope
from tests.httpserver import Server, serving_copy
from tests.shards_data import (fingerprint, image_samples, rewrite_member, small_shard, webdataset_reads, write_aioload,
                               write_webdataset)
from tests.storeserver import StoreServer

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own

RETRY = aioload.RetryPolicy(attempts=2, backoff=0.01, timeout=10)


@pytest.fixture(scope="module")
def samples(image_root):
    return image_samples(image_root)


@pytest.fixture(scope="module")
def folder(samples, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    write_webdataset(samples, root, 10)
    write_aioload(samples, root, 10)
    return root


@pytest.fixture
def server(folder, tmp_path):
    """A server of a copy of the files (tests may cut them)."""
    with serving_copy(folder, tmp_path) as s:
        yield s


def pattern(server, prefix: str) -> str:
    return server.url(f"{prefix}-{{000000..000004}}.tar")


def epoch(ds, *, seed=0, shuffle=True, **loader_args):
    with aioload.DataLoader(ds, shuffle=shuffle, seed=seed, batch_size=4, num_workers=2, **loader_args) as loader:
        rows = [row for keys, digests, classes in loader for row in zip(keys, digests, classes.tolist())]
        return rows, loader.stats()


def test_uniform_mode_asks_one_range_per_sample(server, folder):
    # coalesce_gap=None: no request serves two samples (tests/test_shards_coalesce.py joins them)
    ds = aioload.WebDataset(pattern(server, "wds"), decode=fingerprint, storage=aioload.Storage(retry=RETRY),
                            coalesce_gap=None)
    before = len(server.ranges)
    rows, stats = epoch(ds)
    assert {k: (d, c) for k, d, c in rows} == webdataset_reads(str(folder / "wds-{000000..000004}.tar"))
    ranges = server.ranges[before:]
    expected = sorted(f"bytes={ds._starts[i]}-{ds._ends[i] - 1}" for i in range(len(ds)))
    assert sorted(ranges) == expected  # one request per sample, exactly its members' bytes
    assert stats.requests_per_sample == 1.0 and stats.shard_mode == "uniform"
    assert stats.bytes_per_sample == pytest.approx(sum(ds._ends - ds._starts) / len(ds))
    assert _scope.open_scopes() == 0


@pytest.mark.parametrize("head", ["ok", "403", "no-length"])
def test_shards_behind_an_object_store_or_cdn_are_indexed_and_read(folder, tmp_path, head):
    # S3 answers a missing sidecar 403 (no list permission), a presigned GET URL refuses HEAD
    # (403), a CDN answers HEAD without Content-Length: the sidecar is taken as absent, the size
    # comes from a GET of the first byte, and the samples are what webdataset reads.
    with StoreServer(folder, tmp_path / "log", missing=403, head=head) as store:
        ds = aioload.WebDataset(store.url("wds-{000000..000004}.tar"), decode=fingerprint,
                                storage=aioload.Storage(retry=RETRY))
        asked = store.requests
        rows, _ = epoch(ds)
    assert {k: (d, c) for k, d, c in rows} == webdataset_reads(str(folder / "wds-{000000..000004}.tar"))
    for i in range(5):
        shard = f"/wds-{i:06d}.tar"
        first_byte = [] if head == "ok" else [f"GET {shard} bytes=0-0"]
        assert [r for r in asked if r.split()[1] in (shard, shard + ".index.json")] == [
            f"HEAD {shard} -", *first_byte, f"GET {shard}.index.json -", f"GET {shard} -"]


def test_a_server_that_ignores_range_is_named_once_and_what_arrived_is_counted(folder, tmp_path):
    # Python's http.server answers a range request with the whole file: each sample's read then
    # brings its shard from the start. The reads keep only the sample, the dataset warns once
    # naming the server and window=k, and the statistics count the bytes that arrived (each
    # sample's read alone, coalesce_gap=None: joined reads would bring each shard fewer times).
    with StoreServer(folder, tmp_path / "log", ranges=False) as store:
        origin = f"http://127.0.0.1:{store.port}"
        with pytest.warns(UserWarning) as caught:
            ds = aioload.WebDataset(store.url("wds-{000000..000004}.tar"), decode=fingerprint,
                                    storage=aioload.Storage(retry=RETRY), coalesce_gap=None)
        rows, stats = epoch(ds)
        asked = store.requests
    assert [str(w.message) for w in caught] == [
        f"the server {origin} ignores Range (it answers a range request with the whole shard): in uniform mode each "
        "sample's read downloads its shard from the start up to the sample and drops the rest. Pass "
        "WebDataset(window=k) to fetch each shard once, whole, and draw samples from k shards at a time, or serve the "
        "shards from a server that honours Range (nginx, S3, aiohttp)"]
    assert {k: (d, c) for k, d, c in rows} == webdataset_reads(str(folder / "wds-{000000..000004}.tar"))
    assert sum(1 for r in asked if r.endswith("bytes=0-0")) == 1  # one question for the server, not one per shard
    assert stats.shard_range_ignored == origin and stats.shard_mode == "uniform"
    up_to_each_end = int(ds._ends.sum())  # what a read of a sample brings at least: its shard up to its end
    assert up_to_each_end <= stats.bytes_read <= up_to_each_end + len(ds) * h1.HEAD_LIMIT
    assert stats.bytes_per_sample > 3 * (ds._ends - ds._starts).mean()
    assert f"(Range ignored by {origin})" in str(stats)


def test_the_verdict_names_a_server_that_ignores_range_as_the_cause():
    from aioload._observe.stats import LoaderStats

    # Data-bound, the workers' decoding waiting for reads well below the limit: without the
    # cause in the figures this read "raise prefetch_factor".
    common = dict(batches=10, samples=640, epochs=1, elapsed_s=10.0, first_batch_s=1.0, wait_s=6.0, num_workers=2,
                  io_concurrency=64, decode_s=2.0, decode_cpu_s=1.9, decoded=640, reads=640,
                  bytes_read=640 * 3_400_000, read_s=60.0, read_p50_ms=90.0, read_wait_s=12.0, shard_mode="uniform")
    blind = LoaderStats(**common)
    assert blind.verdict_category == "read-latency-bound" and "prefetch_factor" in blind.verdict
    told = LoaderStats(**common, shard_range_ignored="http://shards.example:80")
    assert told.verdict_category == "shard-bound"
    assert told.verdict == ("data-bound 67% of the time: the server http://shards.example:80 ignores Range: each "
                            "sample's read downloads its shard from the start (3.4 MB from storage per sample): fetch "
                            "whole shards, once each (WebDataset(window=k)), or serve the shards from a server that "
                            "honours Range")


def url_of(sample: dict) -> str:
    return sample["__url__"]


def test_credentials_in_shard_urls_are_never_shown(folder, tmp_path, caplog):
    copy = tmp_path / "www"
    shutil.copytree(folder, copy)
    with StoreServer(copy, tmp_path / "log") as store:
        secret = "ann:s3cret@"
        ds = aioload.WebDataset(store.url("aio-{000000..000004}.tar", secret), decode=url_of,
                                storage=aioload.Storage(retry=RETRY))
        with aioload.DataLoader(ds, batch_size=8, num_workers=2) as loader:
            urls = [u for batch in loader for u in batch]
        with pytest.raises(FileNotFoundError) as missing:
            aioload.WebDataset([store.url("nope-000000.tar", secret)], storage=aioload.Storage(retry=RETRY))
        shard = copy / "aio-000001.tar"
        shard.write_bytes(shard.read_bytes()[:int(ds._starts[15]) + 100])  # cut after indexing
        with aioload.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False) as loader:
            with pytest.raises(aioload.ShardError) as cut:
                list(loader)
        caplog.clear()
        with aioload.DataLoader(ds, batch_size=8, num_workers=2, on_error="skip") as loader:
            kept = sum(len(batch) for batch in loader)
    assert len(urls) == 48 and set(urls) == {store.url(f"aio-{i:06d}.tar", "***@") for i in range(5)}
    shown = [str(missing.value), str(cut.value), *getattr(cut.value, "__notes__", []),
             *(r.getMessage() for r in caplog.records)]
    assert kept < 48 and any("skipped dataset index" in line for line in shown)
    assert not [line for line in shown if "s3cret" in line or "ann:" in line]
    assert f"shard {store.url('aio-000001.tar', '***@')}" in str(cut.value)


def test_window_mode_gets_each_shard_once(server):
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=2,
                            storage=aioload.Storage(retry=RETRY))
    counted = server.requests
    assert all(counted[f"aio-{i:06d}.tar"] == 1 for i in range(5))  # HEAD: the version; the sidecar did the rest
    rows, stats = epoch(ds)
    assert sorted(k for k, _, _ in rows) == sorted(ds.key(i) for i in range(len(ds)))
    counted = server.requests
    assert all(counted[f"aio-{i:06d}.tar"] == 2 for i in range(5))  # and one GET of the whole shard
    assert server.ranges == []
    assert stats.shard_fetches == 5 and stats.requests_per_sample == pytest.approx(5 / 48)
    _, again = epoch(ds, seed=1)  # the same dataset in a second loader: that loader's own fetches
    assert again.shard_fetches == 5 and again.requests_per_sample == pytest.approx(5 / 48)
    assert server.requests["aio-000000.tar"] == 3


def test_window_mode_bounds_its_memory_and_frees_every_shard(server):
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=2, fetch_ahead=1,
                            storage=aioload.Storage(retry=RETRY))
    assert not ds.read_in_workers and ds.deal == "blocks"  # one fetcher for every worker, on the loader's loop
    _, stats = epoch(ds, io_concurrency=8)
    sizes = ds.shard_sizes.tolist()
    assert stats.shard_fetches == 5 and stats.shard_fetch_bytes == sum(sizes)
    assert stats.bytes_per_sample == pytest.approx(sum(sizes) / len(ds))
    assert stats.shard_window_reads == len(ds)
    assert 0 < stats.shard_window_peak_bytes  # bounded below the whole on more shards: the next test
    assert stats.shard_window_bytes == 0  # every shard freed after its last read
    assert "window mode: 0.104 requests" in str(stats)


@pytest.fixture(scope="module")
def many_shards(samples, tmp_path_factory):
    """24 shards of 8 samples (the images four times over, under keys of their own)."""
    root = tmp_path_factory.mktemp("many")
    with aioload.ShardWriter(str(root / "many-%06d.tar"), maxcount=8) as w:
        for copy in range(4):
            for key, data, target in samples:
                w.write({"__key__": f"{key}-{copy}", "jpg": data, "cls": target})
    assert len(w.urls) == 24
    return root


def slow_fingerprint(sample: dict) -> tuple[str, str, int]:
    time.sleep(0.01)  # the workers fall behind the reads, as on a loaded machine: the worst case
    return fingerprint(sample)


def test_window_mode_memory_stays_within_its_bound_when_decoding_lags(many_shards):
    with Server(many_shards) as server:
        ds = aioload.WebDataset(server.url("many-{000000..000023}.tar"), decode=slow_fingerprint, window=2,
                                fetch_ahead=1, storage=aioload.Storage(retry=RETRY))
        with aioload.DataLoader(ds, shuffle=True, seed=0, batch_size=4, num_workers=2, io_concurrency=8,
                                prefetch_factor=2, queue_depth=2) as loader:
            keys = [key for keys, _, _ in loader for key in keys]
            stats = loader.stats()
    assert sorted(keys) == sorted(ds.key(i) for i in range(len(ds)))
    # A shard is held from its fetch until its last read is served and its last sample decoded.
    # The fetcher holds k + ahead shards, plus at most k first needed by the reads in flight
    # beyond them. Samples read and not yet decoded: at most the batches between the sampler and
    # the consumer, (max(2 workers x 2 tasks, 8 reads / 4) + queue depth 2) x 4 = 24 samples,
    # which hold the shards whose last read is among them: the k begun before them, and one per
    # 8 samples inside them. Peak measured: 5.6-5.9 shards of 24.
    k, ahead, unanswered, per_shard = 2, 1, (max(2 * 2, 8 // 4) + 2) * 4, 8
    bound = (k + ahead + k) + (k + unanswered // per_shard)
    sizes = ds.shard_sizes.tolist()
    assert 0 < stats.shard_window_peak_bytes <= bound * max(sizes) < sum(sizes)
    assert stats.shard_window_bytes == 0 and stats.shard_fetches == 24


def test_window_dir_keeps_fetched_shards_on_disk_and_removes_them(server, tmp_path):
    folder = tmp_path / "window"
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=2, window_dir=folder,
                            storage=aioload.Storage(retry=RETRY))
    rows, stats = epoch(ds)
    assert stats.shard_fetches == 5 and server.ranges == []  # the workers read the staged copies
    assert sorted(rows) == sorted(epoch(aioload.WebDataset(pattern(server, "aio"), decode=fingerprint))[0])
    (staging,) = folder.iterdir()
    assert len(list(staging.iterdir())) <= ds._window.grace  # freed shards, kept for late readers
    del ds, stats
    gc.collect()
    assert list(folder.iterdir()) == []


def test_a_staged_copy_deleted_before_its_reader_is_read_from_the_shard(server, tmp_path, monkeypatch):
    monkeypatch.setattr("aioload._shards.dataset.STAGED_LAG", 0)  # delete each shard's file as it is freed
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=2, window_dir=tmp_path / "w",
                            storage=aioload.Storage(retry=RETRY))
    assert ds._window.grace == 0
    rows, _ = epoch(ds)
    assert sorted(k for k, _, _ in rows) == sorted(ds.key(i) for i in range(len(ds)))
    assert 1 <= len(server.ranges) <= 48  # the samples whose copy was gone: a range request each


def test_without_a_plan_window_mode_still_reads_everything(server):
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=2, storage=aioload.Storage(retry=RETRY))
    sampler = torch.utils.data.RandomSampler(ds)  # a sampler of the user's: no epoch_order, no will_read
    with aioload.DataLoader(ds, batch_size=6, sampler=sampler, num_workers=2) as loader:
        keys = [k for batch in loader for k in batch[0]]
        stats = loader.stats()
    assert sorted(keys) == sorted(ds.key(i) for i in range(len(ds)))
    # each read fetches its shard on demand (reads in flight may want every shard at once); once
    # served, only the k most recently used are kept, and none once the epoch has ended
    assert stats.shard_fetches >= 5 and 0 < stats.shard_window_peak_bytes
    assert stats.shard_window_bytes == 0 and ds._window._held == {}


def test_shards_without_sidecars_are_read_once_to_index_them(server):
    aioload.WebDataset(pattern(server, "wds"), storage=aioload.Storage(retry=RETRY))
    counted = server.requests
    assert all(counted[f"wds-{i:06d}.tar"] == 2 for i in range(5))  # HEAD, and one GET to index it
    assert all(counted[f"wds-{i:06d}.tar.index.json"] == 1 for i in range(5))  # looked for, not found
    aioload.WebDataset(pattern(server, "wds"), storage=aioload.Storage(retry=RETRY))
    assert server.requests[f"wds-{0:06d}.tar"] == 3  # the second time, a HEAD: the index is in the cache


@pytest.mark.parametrize("window", [None, 2])
def test_5xx_answers_are_retried(server, window):
    # coalesce_gap=None: a request per sample, so that the shard's requests can be counted
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=window,
                            storage=aioload.Storage(retry=RETRY), coalesce_gap=None)
    server.script("aio-000002.tar", 503)  # once: the retry gets through
    rows, stats = epoch(ds)
    assert len(rows) == 48 and stats.skipped_total == 0
    assert server.requests["aio-000002.tar"] == 1 + (11 if window is None else 2)


@pytest.mark.parametrize("window", [None, 2])
def test_a_shard_that_keeps_failing_names_itself_and_its_samples_are_skipped(server, window, caplog):
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=window,
                            storage=aioload.Storage(retry=RETRY))
    url = server.url("aio-000003.tar")
    server.script("aio-000003.tar", *[503] * 40)
    with pytest.raises(aioload.RemoteReadError, match=rf"^GET {re.escape(url)} failed after 2 attempts; last "
                                                      r"status: HTTP 503") as info:
        epoch(ds, shuffle=False)
    notes = "\n".join(info.value.__notes__)
    assert re.search(rf"while reading dataset index 3\d \(shard {re.escape(url)}, sample 'class_\d+/img_\d+'\)"
                     rf"( in an aioload worker)?$", notes, re.M)
    assert len(set(re.findall(r"while reading dataset index (\d+)", notes))) == 1  # its own, not every failed one's
    server.script("aio-000003.tar", *[503] * 40)
    caplog.clear()
    rows, stats = epoch(ds, on_error="skip")
    shard3 = set(range(30, 40))
    assert set(stats.skipped) == shard3
    logged = [r.getMessage() for r in caplog.records if "skipped dataset index" in r.getMessage()]
    assert len(logged) == 10
    for line in logged:  # each skip names its own sample alone (window mode: one fetch failed them all)
        index = re.match(r"on_error='skip': skipped dataset index (\d+)", line).group(1)
        assert set(re.findall(r"while reading dataset index (\d+)", line)) == {index}
    assert sorted(k for k, _, _ in rows) == sorted(ds.key(i) for i in range(48) if i not in shard3)


def test_a_missing_shard_is_named_at_once(server):
    url = server.url("nope-000000.tar")
    with pytest.raises(FileNotFoundError, match=rf"^shard {re.escape(url)} does not exist \(HEAD {re.escape(url)} "
                                                r"failed after 1 attempt; last status: HTTP 404"):
        aioload.WebDataset([server.url("aio-000000.tar"), url], storage=aioload.Storage(retry=RETRY))


@pytest.mark.parametrize("window", [None, 2])
def test_a_shard_cut_short_after_indexing_fails_its_lost_samples_clearly(server, window):
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=window,
                            storage=aioload.Storage(retry=RETRY))
    path = server.root_path / "aio-000001.tar"
    cut_at = int(ds._starts[15]) + 100
    with open(path, "r+b") as f:
        f.truncate(cut_at)
    rows, stats = epoch(ds, on_error="skip")
    assert set(stats.skipped) == set(range(15, 20))
    assert len(rows) == 43
    with pytest.raises(aioload.ShardError, match=rf"^shard {re.escape(server.url('aio-000001.tar'))}, sample "
                                                 rf"{ds.key(17)!r}: 0 of the sample's \d+ bytes \(from byte \d+\) "
                                                 r"came back: the shard is shorter than when it was indexed"):
        ds[17]


def test_a_sidecar_of_another_tag_is_used_remotely_and_each_sample_checked(server, caplog):
    path = small_shard(server.root_path)  # its sidecar records the local mtime; the server answers an ETag
    rewrite_member(path, "s2.txt", b"text 2, longer", keep_mtime=False)  # written again, the same size
    url = server.url("small-0.tar")
    caplog.set_level(logging.INFO, logger="aioload")
    ds = aioload.WebDataset(url, index_cache=False, storage=aioload.Storage(retry=RETRY))
    assert any(r.getMessage() == "indexed 1 shards: 0 from the cache, 1 from sidecars, 0 read through"
               for r in caplog.records)  # a pass would read the shard whole
    assert ds[1]["txt"] == "text 1"
    with pytest.raises(aioload.ShardError, match=rf"^shard {re.escape(url)}, sample 's2': member 's2\.txt' ends at "
                                                 r"byte \d+, past the sample's range in the index"):
        ds[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [None, 2])
def test_a_hung_server_times_out_instead_of_hanging(server, window):
    storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=1, timeout=1.5))
    ds = aioload.WebDataset(pattern(server, "aio"), decode=fingerprint, window=window, storage=storage)
    server.script("aio-000000.tar", *["hang"] * 12)
    with pytest.raises(aioload.RemoteReadError, match=r"no complete response within timeout=1\.5 s"):
        epoch(ds, shuffle=False, read_timeout=20)


# -- S3 through moto -----------------------------------------------------------------------------
_MOTO = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("port", server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.fixture(scope="module")
def s3(samples):
    """moto's S3 on 127.0.0.1 with a bucket; the fsspec options that reach it."""
    proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"moto's S3 server did not start: {line!r}")
        endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="shards")
        client.close()
        yield {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


def test_s3_shards_written_and_read_in_both_modes(s3, samples):
    with aioload.ShardWriter("s3://shards/train-%06d.tar", maxcount=10, storage_options=s3) as w:
        for key, data, target in samples:
            w.write({"__key__": key, "jpg": data, "cls": target})
    assert w.urls[-1] == "s3://shards/train-000004.tar"
    import fsspec

    fs = fsspec.filesystem("s3", **s3)
    assert fs.exists("shards/train-000004.tar.index.json")
    storage = aioload.Storage(storage_options=s3, retry=RETRY)
    expected = {key: target for key, _, target in samples}
    for window in (None, 2):
        ds = aioload.WebDataset("s3://shards/train-{000000..000004}.tar", decode=fingerprint, window=window,
                                storage=storage)
        rows, stats = epoch(ds)
        assert {k: c for k, _, c in rows} == expected
        assert stats.requests_per_sample == pytest.approx(1.0 if window is None else 5 / 48)
    missing = "s3://shards/train-000009.tar"
    with pytest.raises(FileNotFoundError, match=rf"^shard {missing} does not exist"):
        aioload.WebDataset(missing, storage=storage)
    assert _scope.open_scopes() == 0
