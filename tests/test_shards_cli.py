"""``aioload make-shards SRC DEST`` and ``aioload index URLS``, run as a user runs them (a
subprocess), on real folders, shards and an HTTP server on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import aioload
from aioload._shards.index import SIDECAR, ShardIndex, _index_local
from tests.httpserver import Server
from tests.shards_data import image_samples, set_header_field, write_webdataset

ROOT = Path(__file__).resolve().parent.parent


def aioload_cli(*args, cache) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AIOLOAD_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "aioload", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_make_shards_writes_a_folder_tree_class_by_class(image_root, tmp_path):
    done = aioload_cli("make-shards", str(image_root), str(tmp_path / "out"), "--maxcount", "20", cache=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"train-{i:06d}.tar{s}" for i in range(3) for s in ("", SIDECAR)]
    assert done.stdout.strip() == f"48 samples in 3 shards: {out}/train-000000.tar ... {out}/train-000002.tar"
    assert done.stderr == ""  # no bar: stderr is not a terminal
    ds = aioload.WebDataset(str(out / "train-{000000..000002}.tar"), index_cache=False)
    folder = aioload.ImageFolder(image_root)
    assert [ds.key(i) for i in range(len(ds))] == [os.path.relpath(p, image_root)[:-4] for p, _ in folder.samples]
    assert [ds[i]["cls"] for i in (0, 20, 47)] == [folder.targets[i] for i in (0, 20, 47)]
    shuffled = aioload_cli("make-shards", str(image_root), str(tmp_path / "mixed"), "--shuffle", "3",
                           "--name", "mix", cache=tmp_path)
    assert shuffled.returncode == 0, shuffled.stderr
    with tarfile.open(tmp_path / "mixed" / "mix-000000.tar") as t:
        keys = [n.rsplit(".", 1)[0] for n in t.getnames()][::2]
    assert sorted(keys) == sorted(ds.key(i) for i in range(len(ds))) and keys != [ds.key(i) for i in range(48)]


@pytest.mark.parametrize("first, second", [("x.jpg", "x.png"), ("y.z.jpg", "y_z.jpg")])
def test_make_shards_refuses_two_files_of_one_key_naming_both(image_root, tmp_path, first, second):
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    jpeg = next(image_root.rglob("*.jpg")).read_bytes()
    for name in (first, second, "other.jpg"):
        (src / "cat" / name).write_bytes(jpeg)
    done = aioload_cli("make-shards", str(src), str(tmp_path / "out"), cache=tmp_path)
    key = "cat/" + first.rsplit(".", 1)[0].replace(".", "_")
    assert done.returncode == 1
    assert done.stderr == (f"error: aioload make-shards: {src}/cat/{first} and {src}/cat/{second} both make the sample "
                           f"key {key!r} (the path up to the file's extension, the dots in its name made '_'): a shard "
                           "cannot hold two samples of one key; rename or remove one of them\n")
    assert not (tmp_path / "out").exists()

def test_index_writes_sidecars_for_shards_of_other_tools(image_root, tmp_path):
    pattern = write_webdataset(image_samples(image_root), tmp_path / "wds", 16)
    done = aioload_cli("index", pattern, cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        url = str(tmp_path / "wds" / f"wds-{i:06d}.tar")
        assert line == f"{url}: 16 samples; wrote {url}{SIDECAR}"
        assert ShardIndex.from_json(Path(url + SIDECAR).read_text(), url) == _index_local(url, url)
    again = aioload_cli("index", pattern, cache=tmp_path / "other-cache")
    assert again.stdout.splitlines()[0].endswith(": 16 samples; its sidecar is up to date")


def test_index_after_a_cache_only_run_writes_each_sidecar_once(image_root, tmp_path):
    pattern = write_webdataset(image_samples(image_root), tmp_path / "wds", 16)
    urls = [str(tmp_path / "wds" / f"wds-{i:06d}.tar") for i in range(3)]
    cached = aioload_cli("index", pattern, "--cache-only", cache=tmp_path / "cache")
    assert cached.returncode == 0, cached.stderr
    assert not any(Path(url + SIDECAR).exists() for url in urls)
    done = aioload_cli("index", pattern, cache=tmp_path / "cache")
    assert done.stdout.splitlines() == [f"{url}: 16 samples; wrote {url}{SIDECAR}" for url in urls]
    written = {url: os.stat(url + SIDECAR).st_mtime_ns for url in urls}
    again = aioload_cli("index", pattern, cache=tmp_path / "cache")
    assert again.stdout.splitlines() == [f"{url}: 16 samples; its sidecar is up to date" for url in urls]
    assert {url: os.stat(url + SIDECAR).st_mtime_ns for url in urls} == written
    Path(urls[1] + SIDECAR).write_text("{}")  # a sidecar that no longer matches is written again
    fixed = aioload_cli("index", pattern, cache=tmp_path / "cache")
    assert fixed.stdout.splitlines()[1] == f"{urls[1]}: 16 samples; wrote {urls[1]}{SIDECAR}"


def test_index_reports_a_header_with_a_negative_size_and_ends(image_root, tmp_path):
    pattern = write_webdataset(image_samples(image_root)[:6], tmp_path / "wds", 6)
    url = pattern.replace("{000000..000000}", "000000")
    set_header_field(url, image_samples(image_root)[2][0] + ".jpg", 124, b"-0001000\0")
    done = aioload_cli("index", pattern, cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{url}: 7 samples, 1 unreadable; wrote {url}{SIDECAR}\n"

def test_index_over_http_fills_the_cache(image_root, tmp_path, monkeypatch):
    write_webdataset(image_samples(image_root), tmp_path / "www", 16)
    with Server(tmp_path / "www") as server:
        url = server.url("wds-{000000..000002}.tar")
        done = aioload_cli("index", url, cache=tmp_path / "cache")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == (f"{server.url('wds-000000.tar')}: 16 samples; indexed into the local "
                                               "cache only (HTTP takes no uploads)")
        monkeypatch.setenv("AIOLOAD_CACHE", str(tmp_path / "cache"))
        before = server.requests["wds-000001.tar"]
        ds = aioload.WebDataset(url)
        assert len(ds) == 48 and server.requests["wds-000001.tar"] == before + 1  # a HEAD, no pass


@pytest.mark.parametrize("args, message", [
    (["index", "x.tar", "--storage-options", "{bad"], "error: --storage-options is not JSON"),
    (["make-shards", "a", "b", "--maxcount", "0"], "--maxcount must be >= 1"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    done = aioload_cli(*args, cache=tmp_path)
    assert done.returncode != 0 and message in done.stderr
