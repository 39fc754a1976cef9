"""``aioload.WebDataset`` and ``aioload.ShardWriter`` on local shards, through real loaders
with worker processes: what is read (against ``webdataset``'s own reading of the same
shards), in which order, with how many requests and how much memory, and what a broken shard
does. Shards come from ``webdataset.ShardWriter`` (a PAX header before every member) and
from ``aioload.ShardWriter``. The loaders plan each epoch from the dataset's ``epoch_order``
and tell it what they will read (``will_read``), as for any dataset that computes its order."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

import aioload
from aioload._shards import tar
from aioload._shards.index import SIDECAR, ShardIndex
from aioload.images import decode_image
from tests.shards_data import (fingerprint, image_samples, rewrite_member, set_header_field, small_shard,
                               webdataset_reads, webdataset_samples, write_aioload, write_webdataset)

SHARD = 10  # samples per shard: the 48 test images make 5 shards, the last one short


@pytest.fixture(scope="module")
def samples(image_root):
    return image_samples(image_root)


@pytest.fixture(scope="module")
def shards(samples, tmp_path_factory):
    """``{"webdataset": pattern, "aioload": pattern}`` of the same samples."""
    folder = tmp_path_factory.mktemp("shards")
    return {"webdataset": write_webdataset(samples, folder, SHARD), "aioload": write_aioload(samples, folder, SHARD)}


pytestmark = pytest.mark.usefixtures("private_cache")  # indexes kept in the test's own folder


def read_all(ds, seed, shuffle=True, **loader_args):
    """Every batch of one epoch (the first) of a loader seeded with ``seed``: ``(keys, digests,
    classes, stats)`` in delivery order."""
    keys, digests, classes = [], [], []
    with aioload.DataLoader(ds, shuffle=shuffle, seed=seed, **loader_args) as loader:
        for k, d, c in loader:
            keys += k
            digests += d
            classes += c.tolist()
        stats = loader.stats()
    return keys, digests, classes, stats


@pytest.mark.parametrize("writer", ["webdataset", "aioload"])
@pytest.mark.parametrize("window", [None, 2])
def test_every_sample_once_as_webdataset_reads_it(shards, samples, writer, window):
    ds = aioload.WebDataset(shards[writer], decode=fingerprint, window=window)
    assert len(ds) == len(samples) and ds.shard_lengths == [10, 10, 10, 10, 8]
    order = ds.epoch_order(seed=3, epoch=0, shuffle=True).tolist()
    keys, digests, classes, stats = read_all(ds, 3, batch_size=5, num_workers=2)
    assert keys == [ds.key(i) for i in order]  # the dataset's order
    truth = webdataset_reads(shards[writer])
    assert sorted(truth) == sorted(key for key, _, _ in samples)
    assert {k: (d, c) for k, d, c in zip(keys, digests, classes)} == truth
    assert stats.shard_mode == ("uniform" if window is None else "window")


def test_the_order_is_the_same_at_any_worker_count(shards):
    runs = []
    for workers in (0, 1, 2):
        ds = aioload.WebDataset(shards["webdataset"], decode=fingerprint, window=3)
        runs.append(read_all(ds, 11, batch_size=4, num_workers=workers)[0])
    assert runs[0] == runs[1] == runs[2] == [ds.key(i) for i in ds.epoch_order(11, 0, True)]


def test_the_default_decode_makes_tensors_and_numbers(shards, image_root):
    ds = aioload.WebDataset(shards["aioload"])
    sample = ds[13]
    assert set(sample) == {"__key__", "__url__", "jpg", "cls"}
    assert sample["__url__"] == ds.urls[1]
    assert torch.equal(sample["jpg"], decode_image((image_root / (sample["__key__"] + ".jpg")).read_bytes()))
    assert sample["cls"] == ["class_000", "class_001", "class_002"].index(sample["__key__"].split("/")[0])
    assert ds.describe(13) == f"shard {ds.urls[1]}, sample {sample['__key__']!r}"


def test_decoders_extend_per_dataset_and_for_all(shards):
    seen = []

    def cls_as_text(data):
        seen.append(data)
        return f"class {int(data)}"

    ds = aioload.WebDataset(shards["aioload"], decoders={**aioload.WebDataset.decoders, "cls": cls_as_text})
    assert ds[0]["cls"] == "class 0" and seen == [b"0"]
    plain = aioload.WebDataset(shards["aioload"], decoders={})
    assert plain[0]["jpg"][:3] == b"\xff\xd8\xff"  # no decoder: the member's bytes


def test_local_shards_are_read_by_the_workers_in_either_mode(shards):
    for window in (None, 2):
        ds = aioload.WebDataset(shards["aioload"], decode=fingerprint, window=window)
        assert ds.read_in_workers  # every shard is a local file: nothing to fetch, nothing in this process
        *_, stats = read_all(ds, 0, batch_size=4, num_workers=2)
        assert stats.shard_fetches == 0 and stats.shard_window_peak_bytes == 0
        assert stats.requests_per_sample == 0.0 and stats.samples == 48


def test_uniform_mode_hands_a_local_shards_range_to_the_worker_that_decodes_it(shards):
    ds = aioload.WebDataset(shards["aioload"], decode=fingerprint)
    assert ds.deal == "stride" and aioload.WebDataset(shards["aioload"], window=2).deal == "blocks"
    raw = ds.read_nowait(7)  # a local shard: the worker reads the range itself, just before decoding
    assert pickle.loads(pickle.dumps(raw))[0].read() == ds.read_blocking(7)[0]
    assert ds.decode(raw) == ds.decode(ds.read_blocking(7)) == (ds.key(7), *fingerprint(ds.members(raw))[1:])


def test_torch_dataloader_reads_it_too(shards):
    ds = aioload.WebDataset(shards["webdataset"], decode=fingerprint, window=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    keys = [k for batch in loader for k in batch[0]]
    assert keys == [ds.key(i) for i in range(len(ds))]
    assert pickle.loads(pickle.dumps(ds)).key(5) == ds.key(5)


# -- indexes: cache, sidecars, shards written again ----------------------------------------------
def index_sources(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("indexed ")]
    return lines[-1]


def test_indexes_come_from_the_cache_then_and_again_when_a_shard_changes(shards, tmp_path, caplog, samples):
    folder = tmp_path / "copy"
    source = os.path.dirname(shards["webdataset"])
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("aio-*"))
    pattern = str(folder / os.path.basename(shards["webdataset"]))
    caplog.set_level(logging.INFO, logger="aioload")
    first = aioload.WebDataset(pattern)
    assert index_sources(caplog) == "indexed 5 shards: 0 from the cache, 0 from sidecars, 5 read through"
    aioload.WebDataset(pattern)
    assert index_sources(caplog) == "indexed 5 shards: 5 from the cache, 0 from sidecars, 0 read through"
    # shard 1 written again, with other samples: its cached index no longer applies
    import webdataset as wds

    with wds.TarWriter(first.urls[1], format="pax") as w:
        for key, data, target in samples[:3]:
            w.write({"__key__": "again/" + key.split("/")[1], "jpg": data, "cls": target})
    again = aioload.WebDataset(pattern, decode=fingerprint)
    assert index_sources(caplog) == "indexed 5 shards: 4 from the cache, 0 from sidecars, 1 read through"
    assert again.shard_lengths == [10, 3, 10, 10, 8]
    assert again[10][0] == "again/" + samples[0][0].split("/")[1]


def test_sidecars_spare_the_pass_and_stale_ones_are_not_used(shards, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="aioload")
    aioload.WebDataset(shards["aioload"], index_cache=False)
    assert index_sources(caplog) == "indexed 5 shards: 0 from the cache, 5 from sidecars, 0 read through"
    folder = tmp_path / "stale"
    shutil.copytree(os.path.dirname(shards["aioload"]), folder, ignore=shutil.ignore_patterns("wds-*"))
    sidecar = folder / ("aio-000000.tar" + SIDECAR)
    index = ShardIndex.from_json(sidecar.read_bytes(), str(sidecar))
    index.size += 512
    sidecar.write_text(index.to_json())
    ds = aioload.WebDataset(str(folder / os.path.basename(shards["aioload"])), index_cache=False)
    assert index_sources(caplog) == "indexed 5 shards: 0 from the cache, 4 from sidecars, 1 read through"
    assert len(ds) == 48


def test_a_shard_written_again_under_its_old_index_is_caught_not_misread(shards, tmp_path, samples):
    folder = tmp_path / "rewritten"
    shutil.copytree(os.path.dirname(shards["aioload"]), folder, ignore=shutil.ignore_patterns("wds-*"))
    shard = folder / "aio-000000.tar"
    data = bytearray(shard.read_bytes())
    first_name = (samples[0][0] + ".cls").encode()
    at = data.index(first_name)
    data[at:at + len(first_name)] = first_name.replace(b"img_", b"IMG_")  # same size, another key
    data[at + 148:at + 156] = b" " * 8
    data[at + 148:at + 155] = f"{sum(data[at:at + 512]):06o}\0".encode()
    mtime = shard.stat().st_mtime_ns
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(mtime, mtime))
    ds = aioload.WebDataset(str(folder / os.path.basename(shards["aioload"])), decode=fingerprint,
                            index_cache=False)  # the sidecar's size and mtime still match
    with pytest.raises(aioload.ShardError, match=rf"^shard {shard}, sample {samples[0][0]!r}: at byte 0 the shard "
                                                 r"holds '.*IMG_.*', not a member of this sample: it was written "
                                                 r"again since it was indexed; index it again"):
        ds[0]


# -- faults ----------------------------------------------------------------------------------------
@pytest.fixture
def broken(shards, tmp_path, samples):
    """A copy of the webdataset shards: shard 1 truncated inside its 4th sample, the jpg of
    shard 3's 2nd sample overwritten with garbage (the same length), the header before shard
    4's 3rd jpg corrupt (its sample's cls comes before it: the sample is split)."""
    folder = tmp_path / "broken"
    shutil.copytree(os.path.dirname(shards["webdataset"]), folder, ignore=shutil.ignore_patterns("aio-*"))
    pattern = str(folder / os.path.basename(shards["webdataset"]))
    intact = aioload.WebDataset(pattern, index_cache=False)
    urls = list(intact.urls)

    def members(url):
        with tarfile.open(url) as t:
            return [(m.name, m.offset, m.offset_data, m.size) for m in t.getmembers()]

    cut = [m for m in members(urls[1]) if m[0].endswith(".jpg")][3]
    with open(urls[1], "r+b") as f:
        f.truncate(cut[2] + cut[3] // 2)
    jpg = [m for m in members(urls[3]) if m[0].endswith(".jpg")][1]
    with open(urls[3], "r+b") as f:
        f.seek(jpg[2] + 200)
        f.write(os.urandom(jpg[3] - 400))
    third = [m for m in members(urls[4]) if m[0].endswith(".jpg")][2]
    with open(urls[4], "r+b") as f:
        f.seek(third[1] + 3)  # the PAX header before it
        f.write(b"\xff\xfe")
    keys = {"truncated": cut[0].rsplit(".", 1)[0], "garbage": jpg[0].rsplit(".", 1)[0],
            "split": third[0].rsplit(".", 1)[0]}
    return pattern, urls, keys


def test_faults_raise_naming_the_shard_and_the_sample(broken):
    pattern, urls, keys = broken
    ds = aioload.WebDataset(pattern, index_cache=False)
    truncated = next(i for i in range(len(ds)) if ds.key(i) == keys["truncated"])
    with pytest.raises(aioload.ShardError, match=rf"^shard {urls[1]}, sample {keys['truncated']!r}: the shard is "
                                                 r"truncated: member .* needs bytes up to \d+, and the shard has \d+$"):
        ds[truncated]
    garbage = next(i for i in range(len(ds)) if ds.key(i) == keys["garbage"])
    with pytest.raises(aioload.ShardError, match=rf"^member {keys['garbage']}\.jpg of shard {urls[3]} does not "
                                                 r"decode as 'jpg' \(RuntimeError: .*\); the shard may be corrupt"):
        ds[garbage]
    corrupt = next(i for i in range(len(ds)) if ds.key(i) == "")
    assert ds.describe(corrupt).startswith(f"shard {urls[4]}, a corrupt stretch at byte ")
    with pytest.raises(aioload.ShardError, match=rf"^shard {urls[4]}: the tar header at byte \d+ has a bad checksum"):
        ds[corrupt]


@pytest.mark.parametrize("window", [None, 2])
def test_on_error_skip_leaves_out_exactly_what_cannot_be_read(broken, window):
    pattern, urls, keys = broken
    ds = aioload.WebDataset(pattern, decode=lambda s: (s["__key__"], decode_image(s["jpg"]).shape[0]),
                            window=window, index_cache=False)
    with aioload.DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=2, on_error="skip") as loader:
        got = [k for keys_, _ in loader for k in keys_]
        stats = loader.stats()
    bad = {i for i in range(len(ds)) if ds.key(i) in (keys["truncated"], keys["garbage"], keys["split"], "")}
    assert len(bad) == 5 and set(stats.skipped) == bad  # the split sample is two entries, and the stretch one
    assert sorted(got) == sorted(ds.key(i) for i in range(len(ds)) if i not in bad)


def test_the_loader_names_the_shard_and_key_of_a_failed_sample(broken):
    pattern, urls, keys = broken
    ds = aioload.WebDataset(pattern, decode=fingerprint, window=2, index_cache=False)
    with aioload.DataLoader(ds, batch_size=4, shuffle=False, num_workers=2) as loader:
        with pytest.raises(aioload.ShardError) as info:
            list(loader)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"shard {urls[1]}, sample {keys['truncated']!r}" in str(info.value) + notes


# -- hostile shards and indexes ----------------------------------------------------------------------
def keys_and_skips(ds, **loader_args):
    with aioload.DataLoader(ds, batch_size=2, num_workers=2, on_error="skip", **loader_args) as loader:
        keys = [k for batch in loader for k in batch["__key__"]]
        return sorted(keys), loader.stats().skipped


def test_a_negative_member_size_is_an_error_not_a_hang(tmp_path):
    url = small_shard(tmp_path)
    set_header_field(url, "s2.txt", 124, b"-0001000\0")  # the size field; the sidecar still matches the shard
    header = 5 * 2 * tar.BLOCK  # s2.txt's: every member here is a header and one block of data
    ds = aioload.WebDataset(url, index_cache=False, decoders={})
    assert len(ds) == 6
    with pytest.raises(aioload.ShardError, match=rf"^shard {url}, sample 's2': the tar header at byte {header} has a "
                                                 r"negative size \(-512\): a corrupt header; the shard is corrupt, or was written again since it was indexed "
                                                 rf"\(index it again: `aioload index {url}`\)$"):
        ds[2]
    keys, skipped = keys_and_skips(ds, read_timeout=30)
    assert keys == ["s0", "s1", "s3", "s4", "s5"] and list(skipped) == [2]
    os.remove(url + SIDECAR)  # indexed by a pass over the shard: the header is a corrupt stretch
    scanned = aioload.WebDataset(url, index_cache=False, decoders={})
    stretch = [i for i in range(len(scanned)) if scanned.key(i) == ""]
    assert len(stretch) == 1 and scanned.describe(stretch[0]) == f"shard {url}, a corrupt stretch at byte {header}"
    with pytest.raises(aioload.ShardError, match=rf"^shard {url}: the tar header at byte {header} has a negative "
                                                 r"size \(-512\)"):
        scanned[stretch[0]]


def test_a_shard_written_again_with_the_same_size_is_not_read_through_its_old_sidecar(tmp_path):
    url = small_shard(tmp_path)
    size = os.path.getsize(url)
    rewrite_member(url, "s2.txt", b"text 2, longer", keep_mtime=False)  # a new mtime: another version
    assert os.path.getsize(url) == size
    ds = aioload.WebDataset(url, index_cache=False)
    assert ds[2]["txt"] == "text 2, longer" and ds[3]["txt"] == "text 3"  # indexed again, not cut short
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    url = small_shard(fresh)
    sidecar = json.loads(Path(url + SIDECAR).read_text())
    stat = os.stat(url)
    assert sidecar["tag"] == f"mtime_ns={stat.st_mtime_ns} ino={stat.st_ino}"  # the shard's version when written


@pytest.mark.parametrize("text", [b"text 2, longer", b"tex"], ids=["grown", "shrunk"])
def test_a_sample_whose_members_do_not_fill_its_range_is_refused_not_cut(tmp_path, text):
    url = small_shard(tmp_path)
    rewrite_member(url, "s2.txt", text, keep_mtime=True)  # same size, mtime and inode: the sidecar is believed
    ds = aioload.WebDataset(url, index_cache=False)
    start, end = 4 * 2 * tar.BLOCK, 5 * 2 * tar.BLOCK + tar.BLOCK + len("text 2")
    if len(text) > len("text 2"):
        message = (rf"member 's2\.txt' ends at byte {end + len(text) - 6}, past the sample's range in the index "
                   rf"\(bytes {start} to {end}\)")
    else:
        message = rf"its members end at byte {end - 3}, its range in the index at byte {end}"
    with pytest.raises(aioload.ShardError, match=rf"^shard {url}, sample 's2': {message}: the shard was written "
                                                 r"again since it was indexed, or its index is damaged; index it "
                                                 rf"again: `aioload index {url}`$"):
        ds[2]
    keys, skipped = keys_and_skips(ds)
    assert keys == ["s0", "s1", "s3", "s4", "s5"] and list(skipped) == [2]


def test_a_damaged_sidecar_is_refused_when_loaded_and_a_short_range_when_read(tmp_path):
    url = small_shard(tmp_path)
    sidecar = Path(url + SIDECAR)
    good = json.loads(sidecar.read_text())
    for change in ({"starts": [-512, *good["starts"][1:]]}, {"ends": [*good["ends"][:-1], 2**40]},
                   {"starts": [good["starts"][1], *good["starts"][1:]]}, {"faults": {"6": "past the samples"}}):
        sidecar.write_text(json.dumps({**good, **change}))
        with pytest.raises(aioload.ShardError, match=rf"^{sidecar} is a damaged shard index: .*; delete it, or make "
                                                     rf"it again with `aioload index {url}`\nwhile indexing shard {url}$"):
            aioload.WebDataset(url, index_cache=False)
    sidecar.write_text(json.dumps({**good, "ends": [good["ends"][0], good["ends"][1] - 1, *good["ends"][2:]]}))
    ds = aioload.WebDataset(url, index_cache=False)  # an end one byte short cannot be told without the shard
    assert ds[0]["txt"] == "text 0"
    with pytest.raises(aioload.ShardError, match=r"^shard .*, sample 's1': member 's1\.txt' ends at byte \d+, past "
                                                 r"the sample's range in the index"):
        ds[1]


@pytest.mark.parametrize("source", ["sidecar", "scan"])
def test_a_sample_missing_a_member_is_named_and_skipped_alone(tmp_path, source):
    with aioload.ShardWriter(str(tmp_path / "m-%d.tar")) as w:
        for i in range(8):
            w.write({"__key__": f"s{i}", "txt": f"t{i}", **({} if i == 5 else {"cls": i})})
    url = w.urls[0]
    if source == "scan":
        os.remove(url + SIDECAR)
    ds = aioload.WebDataset(url, index_cache=False)
    message = (rf"^shard {url}, sample 's5' has the members 'txt' where 7 of the dataset's 8 samples have 'cls', 'txt' "
               r"\(it lacks 'cls'\): a batch holding it cannot be collated by default; pass on_error='skip' to the "
               r"DataLoader to leave such samples out, give WebDataset a decode= that makes them alike, or "
               r"check_members=False for a collate_fn that joins them")
    with pytest.raises(aioload.ShardError, match=message + "$"):
        ds[5]
    with aioload.DataLoader(ds, batch_size=4, num_workers=2) as loader:
        with pytest.raises(aioload.ShardError, match=message) as info:
            list(loader)
    assert f"while running decode for dataset index 5 (shard {url}, sample 's5')" in "\n".join(info.value.__notes__)
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, on_error="skip") as loader:
        batches = [(b["__key__"], b["cls"].tolist()) for b in loader]
        skipped = loader.stats().skipped
    assert batches == [(["s0", "s1", "s2", "s3"], [0, 1, 2, 3]), (["s4", "s6", "s7"], [4, 6, 7])]
    assert list(skipped) == [5]
    unchecked = aioload.WebDataset(url, index_cache=False, check_members=False)
    assert unchecked[5] == {"__key__": "s5", "__url__": url, "txt": "t5"}


def test_indexes_that_did_not_record_members_are_not_checked(tmp_path):
    with aioload.ShardWriter(str(tmp_path / "o-%d.tar")) as w:
        for i in range(3):
            w.write({"__key__": f"s{i}", "txt": f"t{i}", **({} if i == 1 else {"cls": i})})
    sidecar = Path(w.urls[0] + SIDECAR)
    old = json.loads(sidecar.read_text())
    assert old.pop("members") == ["cls,txt", "txt", "cls,txt"]
    sidecar.write_text(json.dumps(old))
    assert aioload.WebDataset(w.urls[0], index_cache=False)[1] == {"__key__": "s1", "__url__": w.urls[0], "txt": "t1"}


def test_a_missing_shard_is_named(shards, tmp_path):
    missing = str(tmp_path / "nowhere-000001.tar")
    with pytest.raises(FileNotFoundError, match=rf"^shard {missing} does not exist \(.*\); remove it from the "
                                                r"shard list$"):
        aioload.WebDataset([shards["aioload"].replace("{000000..000004}", "000000"), missing])


def test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"^window must be >= 1, got 0$"):
        aioload.WebDataset("x.tar", window=0)
    with pytest.raises(ValueError, match=r"^fetch_ahead must be an int >= 0, got -1$"):
        aioload.WebDataset("x.tar", fetch_ahead=-1)
    with pytest.raises(TypeError, match=r"^decode must be a function of the sample dict, or None, got str$"):
        aioload.WebDataset("x.tar", decode="jpg")
    with pytest.raises(TypeError, match=r"^storage must be an aioload\.Storage, got dict$"):
        aioload.WebDataset("x.tar", storage={})


# -- writing -------------------------------------------------------------------------------------
def test_shard_writer_splits_by_count_and_size_and_webdataset_reads_it(tmp_path, samples):
    with aioload.ShardWriter(str(tmp_path / "c-%03d.tar"), maxcount=7) as w:
        for key, data, target in samples:
            w.write({"__key__": key, "jpg": data, "cls": target, "json": {"k": key}, "txt": "é"})
    assert len(w.urls) == 7 and w.total == 48
    with aioload.ShardWriter(str(tmp_path / "s-%03d.tar"), maxsize=300_000) as by_size:
        for key, data, target in samples:
            by_size.write({"__key__": key, "jpg": data})
    assert all(os.path.getsize(u) < 300_000 + 200_000 for u in by_size.urls)  # a shard ends past maxsize once
    from webdataset.autodecode import Decoder

    read = [Decoder([])(s) for s in webdataset_samples(str(tmp_path / "c-{000..006}.tar"))]
    assert [s["__key__"] for s in read] == [key for key, _, _ in samples]
    assert read[5]["json"] == {"k": samples[5][0]} and read[5]["txt"] == "é" and read[5]["cls"] == samples[5][2]
    for url in w.urls:  # the sidecar is the index a pass over the shard makes
        from aioload._shards.index import _index_local

        sidecar = url + SIDECAR
        assert ShardIndex.from_json(Path(sidecar).read_text(), sidecar) == _index_local(url, url)
    with tarfile.open(w.urls[0]) as t:
        assert t.getnames()[:3] == [f"{samples[0][0]}.cls", f"{samples[0][0]}.jpg", f"{samples[0][0]}.json"]


def test_shard_writer_refuses_what_readers_would_misread(tmp_path):
    with pytest.raises(ValueError, match=r"^pattern 'x\.tar' needs one printf field for the shard number"):
        aioload.ShardWriter(str(tmp_path / "x.tar").replace(str(tmp_path) + "/", ""))
    with pytest.raises(ValueError, match=r"^cannot write http://h/x-0\.tar: HTTP servers take no uploads here"):
        aioload.ShardWriter("http://h/x-%d.tar").write({"__key__": "a", "jpg": b"1"})
    with aioload.ShardWriter(str(tmp_path / "y-%d.tar")) as w:
        with pytest.raises(ValueError, match=r"^sample 'a\.b' cannot be stored with the member 'jpg': readers take"):
            w.write({"__key__": "a.b", "jpg": b"1"})
        with pytest.raises(TypeError, match=r"^sample 'a': member 'jpg' is an object; give bytes"):
            w.write({"__key__": "a", "jpg": object()})
        with pytest.raises(ValueError, match=r"^a sample is a dict with a '__key__' entry"):
            w.write({"jpg": b"1"})
        w.write({"__key__": "ok", "jpg": b"1"})
    with tarfile.open(w.urls[0]) as t:
        assert tar.split_name(t.getnames()[0]) == ("ok", "jpg")


def test_shard_writer_refuses_two_samples_of_one_key_in_a_row(tmp_path):
    with aioload.ShardWriter(str(tmp_path / "k-%d.tar"), maxcount=2) as w:
        w.write({"__key__": "a/x", "jpg": b"1", "cls": 0})
        with pytest.raises(ValueError, match=r"^sample 'a/x' \(a/x\.png\) has the key of the sample written just "
                                             r"before it \(a/x\.cls, a/x\.jpg\): readers take the members in a row "
                                             r"that share a key for one sample, so the two would be read as one; give "
                                             r"each sample a key of its own$"):
            w.write({"__key__": "a/x", "png": b"2"})
        w.write({"__key__": "a/y", "jpg": b"3"})
        w.write({"__key__": "a/x", "jpg": b"4"})  # not in a row: two samples, as webdataset reads them
    assert [k for s in webdataset_samples(str(tmp_path / "k-{0..1}.tar")) for k in [s["__key__"]]] == \
        ["a/x", "a/y", "a/x"]
    ds = aioload.WebDataset(str(tmp_path / "k-{0..1}.tar"), index_cache=False, decoders={}, check_members=False)
    assert [ds.key(i) for i in range(len(ds))] == ["a/x", "a/y", "a/x"] and ds[0]["jpg"] == b"1"
