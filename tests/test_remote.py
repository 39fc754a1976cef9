"""Remote reads over HTTP against a real server on 127.0.0.1: retries, final errors, ranges,
session lifetime, and a full DataLoader over image URLs."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import re
import time

import pytest
import torch
from torchvision.transforms import v2

import aioload
from aioload._storage import h1
from aioload._storage import http as _http
from aioload._storage import scope as _scope
from aioload._storage.retry import parse_retry_after
from tests.httpserver import Server, Status
from tests.reference import pil_image

FAST = aioload.RetryPolicy(attempts=4, backoff=0.001, max_delay=0.01, timeout=10)


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    for i in range(8):
        (root / f"f{i}.bin").write_bytes(bytes([i]) * (1000 + i))
    return root


@pytest.fixture
def server(files):
    with Server(files) as srv:
        yield srv


@pytest.fixture
def image_server(image_root):
    with Server(image_root) as srv:
        yield srv


def image_names(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".jpg"))


def open_sessions() -> list:
    """aioload's HTTP clients that are not closed; where none is, the connections still open."""
    gc.collect()
    objects = gc.get_objects()
    clients = [o for o in objects if type(o) is _http.Client and not o.closed]
    return clients or [o for o in objects if type(o) is h1.Connection and o.transport is not None
                       and not o.transport.is_closing()]


def run(coro_fn):
    async def bounded():
        async with asyncio.timeout(60):
            return await coro_fn()

    return asyncio.run(bounded())


# -- options ---------------------------------------------------------------------------------
def test_retry_policy_validates():
    with pytest.raises(ValueError, match=r"^attempts must be >= 1, got 0$"):
        aioload.RetryPolicy(attempts=0)
    with pytest.raises(TypeError, match=r"^attempts must be an int >= 1, got 2.5$"):
        aioload.RetryPolicy(attempts=2.5)
    with pytest.raises(ValueError, match=r"^timeout must be > 0 seconds, got 0$"):
        aioload.RetryPolicy(timeout=0)
    with pytest.raises(ValueError, match=r"^connections_per_host must be >= 1, got 0$"):
        aioload.Storage(connections_per_host=0)
    with pytest.raises(TypeError, match=r"^retry must be an aioload.RetryPolicy, got int$"):
        aioload.Storage(retry=3)


def test_backoff_grows_is_jittered_capped_and_yields_to_retry_after():
    import random

    policy = aioload.RetryPolicy(backoff=0.1, max_delay=1.0)
    rng = random.Random(0)
    for failures, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (6, 1.0)]:
        delays = {policy.delay(failures, None, rng) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1
    assert policy.delay(1, 0.7, rng) == 0.7
    assert policy.delay(1, 30.0, rng) == 1.0


def test_retry_after_header_forms():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
    assert parse_retry_after("soon") is None


def test_remote_read_error_pickles_with_its_attributes():
    err = aioload.RemoteReadError("GET u failed", "http://h/u", 3, 503)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.url, back.attempts, back.status) == ("GET u failed", "http://h/u", 3, 503)


# -- reads -----------------------------------------------------------------------------------
def test_local_paths_and_file_urls_read_as_before(files):
    path = files / "f3.bin"

    async def main():
        return (await aioload.read_bytes(path), await aioload.read_bytes(f"file://{path}"),
                await aioload.read_range(str(path), 10, 5))

    whole, via_url, part = run(main)
    assert whole == via_url == bytes([3]) * 1003
    assert part == bytes([3]) * 5


def test_http_whole_and_ranged_reads(server, files):
    data = (files / "f5.bin").read_bytes()

    async def main():
        return (await aioload.read_bytes(server.url("f5.bin")),
                await aioload.read_range(server.url("f5.bin"), 1000, 100),
                await aioload.read_range(server.url("f5.bin"), 5000, 10),
                await aioload.read_range(server.url("f5.bin"), 7, 0))

    whole, tail, past_end, empty = run(main)
    assert whole == data
    assert tail == data[1000:]  # fewer bytes at the end, as a local read returns
    assert past_end == b"" and empty == b""
    assert server.ranges == ["bytes=1000-1099", "bytes=5000-5009"]  # length 0 sends nothing


def test_503_burst_is_retried_until_it_passes(server, files):
    server.script("f1.bin", 503, 502, Status(500))
    storage = aioload.Storage(retry=FAST)
    assert run(lambda: storage.read_bytes(server.url("f1.bin"))) == (files / "f1.bin").read_bytes()
    assert server.requests["f1.bin"] == 4


def test_retry_after_is_honoured_over_the_backoff(server, files):
    # The backoff alone would wait ten minutes; Retry-After: 0 lets the read go on at once.
    slow = aioload.RetryPolicy(attempts=3, backoff=600, max_delay=600)
    server.script("f2.bin", Status(429, "0"), Status(503, "0"))
    storage = aioload.Storage(retry=slow)
    assert run(lambda: storage.read_bytes(server.url("f2.bin"))) == (files / "f2.bin").read_bytes()
    assert server.requests["f2.bin"] == 3


def test_final_error_names_url_attempts_and_last_status(server):
    server.script("f0.bin", *[503] * 10)
    storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=3, backoff=0.001))
    url = server.url("f0.bin")
    with pytest.raises(aioload.RemoteReadError) as info:
        run(lambda: storage.read_bytes(url))
    err = info.value
    assert (err.url, err.attempts, err.status) == (url, 3, 503)
    assert str(err).startswith(f"GET {url} failed after 3 attempts; last status: HTTP 503")
    assert not isinstance(err, FileNotFoundError)
    assert server.requests["f0.bin"] == 3


def test_404_fails_at_once_as_a_file_not_found(server):
    url = server.url("nope.bin")
    with pytest.raises(FileNotFoundError) as info:
        run(lambda: aioload.Storage(retry=FAST).read_bytes(url))
    err = info.value
    assert isinstance(err, aioload.RemoteReadError)
    assert (err.attempts, err.status) == (1, 404)
    assert re.match(rf"^GET {re.escape(url)} failed after 1 attempt; last status: HTTP 404 .*not retried", str(err))
    assert server.requests["nope.bin"] == 1


def test_other_4xx_are_not_retried(server):
    server.script("f1.bin", 403)
    with pytest.raises(aioload.RemoteReadError) as info:
        run(lambda: aioload.Storage(retry=FAST).read_bytes(server.url("f1.bin")))
    assert (info.value.attempts, info.value.status) == (1, 403)
    assert not isinstance(info.value, FileNotFoundError)
    assert server.requests["f1.bin"] == 1


def test_truncated_body_is_detected_and_retried(server, files):
    server.script("f4.bin", "truncate")
    storage = aioload.Storage(retry=FAST)
    assert run(lambda: storage.read_bytes(server.url("f4.bin"))) == (files / "f4.bin").read_bytes()
    assert server.requests["f4.bin"] == 2

    server.script("f4.bin", *["truncate"] * 4)
    with pytest.raises(aioload.RemoteReadError, match="truncated body") as info:
        run(lambda: storage.read_bytes(server.url("f4.bin")))
    assert info.value.attempts == 4 and info.value.status == 200  # headers came, the body fell short


def test_connection_resets_are_retried(server, files):
    server.script("f6.bin", "reset", "reset")
    storage = aioload.Storage(retry=FAST)
    assert run(lambda: storage.read_bytes(server.url("f6.bin"))) == (files / "f6.bin").read_bytes()

    server.script("f6.bin", *["reset"] * 20)
    with pytest.raises(aioload.RemoteReadError, match="connection error") as info:
        run(lambda: storage.read_bytes(server.url("f6.bin")))
    assert info.value.attempts == 4 and info.value.status is None
    # a GET on a reused keep-alive connection that is reset before any byte of the answer is
    # sent once more, on a new connection: each of our attempts is one or two requests.
    assert 2 + 4 <= server.requests["f6.bin"] <= 2 + 1 + 8


def test_each_attempt_times_out(server):
    server.script("f7.bin", "hang", "hang")
    storage = aioload.Storage(retry=aioload.RetryPolicy(attempts=2, timeout=0.2, backoff=0.001))
    with pytest.raises(aioload.RemoteReadError, match=r"no complete response within timeout=0.2 s") as info:
        run(lambda: storage.read_bytes(server.url("f7.bin")))
    assert info.value.attempts == 2 and info.value.status is None


def test_connections_per_host_bounds_requests_in_flight(server):
    server.latency = 0.05
    storage = aioload.Storage(connections_per_host=2)

    async def main():
        return await asyncio.gather(*(storage.read_bytes(server.url(f"f{i % 8}.bin")) for i in range(12)))

    assert len(run(main)) == 12
    assert 1 <= server.peak <= 2


# -- session lifetime -------------------------------------------------------------------------
def test_sessions_close_when_the_loop_ends(server):
    storage = aioload.Storage()

    async def main():
        await asyncio.gather(*(storage.read_bytes(server.url(f"f{i}.bin")) for i in range(8)))
        return len(open_sessions())

    assert run(main) == 1  # one pooled session for all reads on this loop
    assert open_sessions() == []
    assert _scope.open_scopes() == 0


def test_aclose_and_async_with_close_the_session_early(server):
    async def main():
        async with aioload.Storage() as storage:
            await storage.read_bytes(server.url("f0.bin"))
            assert len(open_sessions()) == 1
        assert open_sessions() == []
        await storage.read_bytes(server.url("f1.bin"))  # reading again opens a new one
        return len(open_sessions())

    assert run(main) == 1
    assert open_sessions() == []


def test_blocking_read_of_a_url_works_inside_and_outside_a_loop(server, files):
    storage = aioload.Storage(retry=FAST)
    expected = (files / "f2.bin").read_bytes()
    assert storage.read_bytes_blocking(server.url("f2.bin")) == expected

    async def inside():
        return storage.read_bytes_blocking(server.url("f2.bin"))

    assert run(inside) == expected
    assert open_sessions() == []


# -- the loader over URLs ---------------------------------------------------------------------
def expected_images(root, names, transform):
    return [transform(pil_image((root / n).read_bytes())) for n in names]


def test_loader_over_flaky_urls_delivers_every_sample_exactly_once(image_server, image_root):
    names = image_names(image_root)
    faults = [[503], ["reset"], ["truncate", Status(503, "0")], [], [429], ["truncate"]]
    for i, name in enumerate(names):
        image_server.script(name, *faults[i % len(faults)])
    crop = v2.CenterCrop(64)
    ds = aioload.ImageFiles([image_server.url(n) for n in names], labels=list(range(len(names))),
                            transform=crop, storage=aioload.Storage(retry=FAST))
    expected = expected_images(image_root, names, crop)
    seen = []
    with aioload.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, io_concurrency=8, seed=3) as loader:
        for images, labels in loader:
            assert images.shape[1:] == (3, 64, 64) and images.dtype == torch.uint8
            for image, label in zip(images, labels.tolist()):
                assert torch.equal(image, expected[label])
                seen.append(label)
    assert sorted(seen) == list(range(len(names)))  # nothing lost, nothing twice
    requests = image_server.requests
    assert all(requests[n] >= 1 + len(faults[i % len(faults)]) for i, n in enumerate(names))
    assert open_sessions() == [] and _scope.open_scopes() == 0


def test_loader_surfaces_the_final_error_with_index_and_url(image_server, image_root):
    names = image_names(image_root)[:6]
    urls = [image_server.url(n) for n in names]
    urls[4] = image_server.url("missing.jpg")
    ds = aioload.ImageFiles(urls, transform=v2.CenterCrop(32), storage=aioload.Storage(retry=FAST))
    with aioload.DataLoader(ds, batch_size=2, num_workers=2) as loader:
        with pytest.raises(FileNotFoundError) as info:
            for _ in loader:
                pass
    err = info.value
    assert isinstance(err, aioload.RemoteReadError) and err.status == 404 and err.url == urls[4]
    assert f"while reading dataset index 4 ({urls[4]}) in an aioload worker" in err.__notes__
    assert open_sessions() == []


def test_breaking_out_with_requests_in_flight_closes_the_session(image_server, image_root):
    names = image_names(image_root)
    for name in names[4:]:  # every read after the first batch's hangs until its client goes away
        image_server.script(name, "hang")
    ds = aioload.ImageFiles([image_server.url(n) for n in names], transform=v2.CenterCrop(32))
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, io_concurrency=16) as loader:
        for _ in loader:
            deadline = time.monotonic() + 60  # a hang guard: the reads fan out at once
            while image_server.peak <= 4:
                assert time.monotonic() < deadline, "the reads after the first batch never reached the server"
                time.sleep(0.01)
            break  # with more than 4 reads held by the server
    assert open_sessions() == [] and _scope.open_scopes() == 0


def test_image_files_without_labels_yields_images_and_works_with_getitem(image_server, image_root):
    names = image_names(image_root)[:4]
    crop = v2.CenterCrop(48)
    ds = aioload.ImageFiles([image_server.url(n) for n in names], transform=crop)
    expected = expected_images(image_root, names, crop)
    assert torch.equal(ds[1], expected[1])  # __getitem__: a blocking read, no loader
    with aioload.DataLoader(ds, batch_size=4, num_workers=0) as loader:
        (batch,) = list(loader)
    assert torch.equal(batch, torch.stack(expected))
    assert ds.targets is None
    assert open_sessions() == []


def test_image_files_validates_its_arguments(image_root):
    with pytest.raises(TypeError, match="^paths_or_urls must be a sequence of paths or URLs, not a single one"):
        aioload.ImageFiles("http://example.invalid/a.jpg")
    with pytest.raises(ValueError, match=r"^labels must hold one label per path: got \(1,\) labels for 2 paths$"):
        aioload.ImageFiles(["a.jpg", "b.jpg"], labels=[0])
    with pytest.raises(TypeError, match=r"^pass either storage= or cache=, not both"):
        aioload.ImageFiles(["a.jpg"], cache=aioload.MemoryCache(10), storage=aioload.Storage())
    with pytest.raises(ValueError, match="^ImageFolder needs a root it can list"):
        aioload.ImageFolder("http://127.0.0.1:1/train")


def test_remote_example_trains_a_few_steps(tmp_path):
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "AIOLOAD_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-W", "error", "examples/remote_images.py", "--steps", "4",
                             "--images", "24", "--batch-size", "8", "--workers", "1", "--cache", "disk"],
                            cwd=repo, env=env, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("epoch 1 step 4 loss") for line in lines), result.stdout
    assert "epoch 1 reads: 24 from the cache" in result.stdout, result.stdout
    hits, misses = map(int, re.match(r"^cache: (\d+) hits, (\d+) misses, 24 objects", lines[-1]).groups())
    assert misses == 24 and hits >= 8  # epoch 1 came from the disk cache (reads run ahead: maybe more)
