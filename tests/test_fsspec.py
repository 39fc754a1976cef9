"""Reads through fsspec: ``memory://`` (in-process) and ``s3://`` against moto's standalone S3
server on 127.0.0.1, started by the tests in a child process."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import uuid

import aiohttp
import fsspec
import pytest
import torch
from torchvision.transforms import v2

import aioload
from aioload._storage import scope as _scope
from tests.reference import pil_image


def _sessions() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is aiohttp.ClientSession and not o.closed]


_before: set[int] = set()


@pytest.fixture(autouse=True)
def sessions_before():
    """The sessions open before the test (other tests' own ``fsspec.filesystem`` instances stay
    in fsspec's instance cache until exit): only those the test opened count as left open."""
    _before.clear()
    _before.update(id(o) for o in _sessions())
    yield


def open_sessions() -> list:
    """The aiohttp sessions opened since the test began and still open."""
    return [o for o in _sessions() if id(o) not in _before]


def local_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".jpg"))


def decoded(path, transform) -> torch.Tensor:
    with open(path, "rb") as f:
        return transform(pil_image(f.read()))


# -- memory:// --------------------------------------------------------------------------------
@pytest.fixture
def memory_tree(image_root, tmp_path):
    """The same tree twice: on disk and in fsspec's memory filesystem, with a nested folder,
    a class name that sorts around another (``b`` and ``b-c``) and a file that is no image."""
    names = local_files(image_root)[:9]
    layout = {
        "a/x1.jpg": names[0], "a/x0.jpg": names[1], "a/sub/y.jpg": names[2],
        "b/z.jpg": names[3], "b/notes.txt": None, "b-c/q.jpg": names[4], "b-c/p.JPG": names[5],
    }
    base = f"/aioload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    local = tmp_path / "local"
    for rel, src in layout.items():
        data = b"text" if src is None else (image_root / src).read_bytes()
        fs.pipe(f"{base}/{rel}", data)
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    yield f"memory://{base}", local
    fs.rm(base, recursive=True)


def test_image_folder_over_memory_url_matches_the_local_folder(memory_tree):
    url, local = memory_tree
    remote = aioload.ImageFolder(url)
    here = aioload.ImageFolder(local)
    assert remote.classes == here.classes == ["a", "b", "b-c"]
    assert remote.targets == here.targets
    assert [os.path.relpath(p, local) for p, _ in here.samples] == [p[len(url) + 1:] for p, _ in remote.samples]
    only_a = aioload.ImageFolder(url, is_valid_file=lambda p: "/a/" in p, allow_empty=True)
    assert only_a.targets == [0, 0, 0]


def test_image_folder_over_memory_url_reports_empty_classes_like_torchvision(memory_tree):
    url, _ = memory_tree
    with pytest.raises(FileNotFoundError, match=r"^Found no valid file for the classes b, b-c\. "):
        aioload.ImageFolder(url, is_valid_file=lambda p: "/a/" in p)
    with pytest.raises(FileNotFoundError, match=r"^Couldn't find any class folder in memory://"):
        aioload.ImageFolder(url + "/a/sub")


def test_loader_over_memory_folder(memory_tree):
    url, local = memory_tree
    crop = v2.CenterCrop(40)
    ds = aioload.ImageFolder(url, transform=crop)
    expected = [decoded(local / p[len(url) + 1:], crop) for p, _ in ds.samples]
    with aioload.DataLoader(ds, batch_size=3, num_workers=2) as loader:
        images = torch.cat([batch for batch, _ in loader])
    assert torch.equal(images, torch.stack(expected))


def test_memory_reads_and_missing_objects(memory_tree):
    url, local = memory_tree

    async def main():
        whole = await aioload.read_bytes(f"{url}/a/x0.jpg")
        part = await aioload.read_range(f"{url}/a/x0.jpg", 5, 20)
        return whole, part

    whole, part = asyncio.run(main())
    assert whole == (local / "a/x0.jpg").read_bytes() and part == whole[5:25]
    with pytest.raises(FileNotFoundError) as info:
        asyncio.run(aioload.read_bytes(f"{url}/a/none.jpg"))
    assert isinstance(info.value, aioload.RemoteReadError) and info.value.attempts == 1


def test_unknown_scheme_names_the_problem():
    with pytest.raises(ValueError, match=r"^no storage reads nosuchfs:// URLs"):
        asyncio.run(aioload.read_bytes("nosuchfs://x/y"))


# -- s3:// with moto ------------------------------------------------------------------------------
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
def moto_endpoint():
    proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"moto's S3 server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


CREDENTIALS = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}


@pytest.fixture(scope="module")
def bucket(moto_endpoint, image_root):
    """A bucket holding ``train/<class>/<file>.jpg`` for the first 12 images."""
    import boto3  # a synchronous client: the test process keeps a single thread

    client = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="data")
    names = local_files(image_root)[:12]
    for name in names:
        client.put_object(Bucket="data", Key=f"train/{name}", Body=(image_root / name).read_bytes())
    client.close()
    return names


def s3_storage(endpoint: str) -> aioload.Storage:
    return aioload.Storage(storage_options={**CREDENTIALS, "endpoint_url": endpoint},
                           retry=aioload.RetryPolicy(attempts=2, backoff=0.01, timeout=30))


def test_s3_objects_through_image_files_and_a_loader(moto_endpoint, bucket, image_root):
    crop = v2.CenterCrop(48)
    urls = [f"s3://data/train/{n}" for n in bucket]
    ds = aioload.ImageFiles(urls, labels=list(range(len(urls))), transform=crop, storage=s3_storage(moto_endpoint))
    seen = {}
    with aioload.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, seed=0) as loader:
        for images, labels in loader:
            for image, label in zip(images, labels.tolist()):
                assert label not in seen
                seen[label] = image
    assert sorted(seen) == list(range(len(urls)))
    assert all(torch.equal(seen[i], decoded(image_root / n, crop)) for i, n in enumerate(bucket))
    assert open_sessions() == [] and _scope.open_scopes() == 0


def test_s3_folder_lists_like_the_local_one(moto_endpoint, bucket, image_root):
    ds = aioload.ImageFolder("s3://data/train", storage=s3_storage(moto_endpoint))
    assert [p for p, _ in ds.samples] == [f"s3://data/train/{n}" for n in bucket]
    local_classes = sorted({n.split("/")[0] for n in bucket})
    assert ds.classes == local_classes
    assert ds.targets == [local_classes.index(n.split("/")[0]) for n in bucket]
    assert open_sessions() == []


def test_s3_ranges_and_missing_keys(moto_endpoint, bucket, image_root):
    storage = s3_storage(moto_endpoint)
    data = (image_root / bucket[0]).read_bytes()

    async def main():
        return await storage.read_range(f"s3://data/train/{bucket[0]}", 100, 50)

    assert asyncio.run(main()) == data[100:150]
    with pytest.raises(FileNotFoundError) as info:
        asyncio.run(storage.read_bytes("s3://data/train/none.jpg"))
    err = info.value
    assert isinstance(err, aioload.RemoteReadError) and err.attempts == 1
    assert str(err).startswith("GET s3://data/train/none.jpg failed after 1 attempt")
    assert open_sessions() == [] and _scope.open_scopes() == 0
