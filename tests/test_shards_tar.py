"""The shard subsystem's parts alone (no loader, no worker process): tar headers, the index
and its faults, shard patterns and the epoch orders.

# unit tests: no worker process

Archives are made by Python's ``tarfile`` in each of its formats, by ``webdataset``'s
``TarWriter`` and by the ``tar`` program; the reference for every member's offsets is
``tarfile`` itself (``TarInfo.offset_data``)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile

import pytest
import torch

from aioload._shards import order, tar, urls
from aioload._shards.index import ShardError, ShardIndex, _index_local, index_archive

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds


def archive(members: list[tuple[str, bytes]], fmt=tarfile.PAX_FORMAT, mtime: float = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def reference(data: bytes) -> list[tuple[str, int, int]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return [(m.name, m.offset_data, m.size) for m in t.getmembers() if m.isreg()]


def walk(data: bytes) -> list[tuple[str, int, int]]:
    view = memoryview(data)
    return [(m.name, m.offset, m.size) for m in tar.members(lambda o, n: view[o:o + n]) if m.regular]


LONG = "deep/" * 30 + "name-longer-than-a-hundred-characters.jpg"  # 191 chars: PAX, GNU or ustar prefix

MEMBERS = [("a/b.jpg", b"x" * 700), ("a/b.cls", b"3"), ("é/ü.txt", "ünïcode".encode()), (LONG, b"y" * 513)]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_member_offsets_match_tarfile_in_every_format(fmt):
    data = archive(MEMBERS, fmt, mtime=1.5)  # a float mtime makes tarfile's PAX format write a header per member
    assert walk(data) == reference(data)
    assert [name for name, _, _ in walk(data)] == [n for n, _ in MEMBERS]


def test_pax_headers_before_every_member_count_in_the_members_start():
    data = archive(MEMBERS, tarfile.PAX_FORMAT, mtime=1.5)
    view = memoryview(data)
    found = list(tar.members(lambda o, n: view[o:o + n]))
    first = found[0]
    assert first.start == 0 and first.offset == 3 * tar.BLOCK  # PAX header + its records + the member's own
    for member, following in zip(found, found[1:]):
        assert following.start == member.offset + tar.padded(member.size)


def test_ustar_prefix_joins_long_paths():
    name = "p" * 120 + "/file.bin"
    data = archive([(name, b"abc")], tarfile.USTAR_FORMAT)
    assert walk(data) == reference(data) == [(name, 512, 3)]


def test_webdataset_tarwriter_in_its_formats():
    import webdataset as wds

    for fmt in (None, "pax", "gnu"):
        buf = io.BytesIO()
        with wds.TarWriter(buf, **({"format": fmt} if fmt else {})) as w:
            w.write({"__key__": "s/one", "jpg": b"j" * 1000, "cls": b"1", "json": b"{}"})
            w.write({"__key__": "s/two", "jpg": b"k" * 10, "cls": b"2"})
        data = buf.getvalue()
        assert walk(data) == reference(data), fmt
        index = index_archive(lambda o, n, v=memoryview(data): v[o:o + n], len(data), "mem")
        assert index.keys == ["s/one", "s/two"] and not index.faults


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar program")
def test_archives_written_by_the_tar_program(tmp_path):
    src = tmp_path / "src"
    (src / "k").mkdir(parents=True)
    deep = src / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (src / "k" / "one.jpg").write_bytes(b"1" * 3000)
    (src / "k" / "one.cls").write_bytes(b"7")
    (deep / "two.txt").write_bytes(b"long path")
    for fmt in ("gnu", "posix", "ustar"):
        out = tmp_path / f"{fmt}.tar"
        subprocess.run(["tar", f"--format={fmt}", "-cf", str(out), "-C", str(src), "."], check=True)
        data = out.read_bytes()
        assert walk(data) == reference(data), fmt
        index = _index_local(str(out), str(out))
        assert sorted(index.keys) == sorted(["./k/one", f"./{'d' * 60}/{'e' * 60}/two"]), fmt


def test_base_256_sizes_are_read():
    block = bytearray(tarfile.TarInfo("big.bin").tobuf(tarfile.GNU_FORMAT))
    size = 9 * 2**30  # more than 8 GiB: only base-256 holds it in the 12-byte field
    block[124:136] = (size | (0x80 << 88)).to_bytes(12, "big")
    block[148:156] = b" " * 8
    block[148:155] = f"{sum(block):06o}\0".encode()
    found = list(tar.members(lambda o, n: bytes(block)[o:o + n] if o < 512 else b""))
    assert [(m.name, m.size) for m in found] == [("big.bin", size)]


def test_a_bad_checksum_is_an_error_with_its_offset():
    data = bytearray(archive([("a.jpg", b"1" * 600), ("b.jpg", b"2")]))
    second = 512 + tar.padded(600)
    data[second + 10] ^= 0xFF
    view = memoryview(bytes(data))
    with pytest.raises(tar.TarError, match=rf"^the tar header at byte {second} has a bad checksum") as info:
        list(tar.members(lambda o, n: view[o:o + n]))
    assert info.value.offset == second


def with_size_field(data: bytes, at: int, field: bytes) -> bytes:
    """``data`` with the size field of the header at byte ``at`` replaced (checksum made again)."""
    block = bytearray(data[at:at + tar.BLOCK])
    block[124:136] = field.ljust(12, b"\0")
    block[148:156] = b" " * 8
    block[148:155] = f"{sum(block):06o}\0".encode()
    return data[:at] + bytes(block) + data[at + tar.BLOCK:]


@pytest.mark.parametrize("field", [b"-0001000", b"-1", b"\xff" * 12], ids=["octal", "minus-one", "base-256"])
def test_a_negative_size_is_an_error_not_an_endless_walk(field):
    data = with_size_field(archive([("a.jpg", b"1" * 600), ("b.jpg", b"2")]), 512 + tar.padded(600), field)
    view = memoryview(data)
    with pytest.raises(tar.TarError, match=rf"^the tar header at byte {512 + tar.padded(600)} has a negative size"):
        list(tar.members(lambda o, n: view[o:o + n]))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo("a.jpg")
        info.size, info.pax_headers = 1, {"size": "-9"}  # a PAX record's size
        t.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(tar.TarError, match=r"^the PAX header before byte 1024 has a negative size"):
        list(tar.members(lambda o, n, v=memoryview(buf.getvalue()): v[o:o + n]))

def test_split_name_follows_webdataset():
    from webdataset.tariterators import base_plus_ext

    for name in ["a/b.jpg", "a/b.seg.PNG", "dir.x/b.c.d", "noext", "a/.hidden", "x/y/z.tar.gz"]:
        key, ext = base_plus_ext(name)
        expected = None if key is None else (key, ext.lower())
        assert tar.split_name(name) == expected, name
    assert tar.split_name("__meta__") is None and tar.split_name("__x__/a.jpg") is None


# -- the index -------------------------------------------------------------------------------
def index_of(data: bytes, url: str = "shard.tar") -> ShardIndex:
    view = memoryview(data)
    return index_archive(lambda o, n: view[o:o + n], len(data), url)


def test_index_groups_members_into_samples_with_their_byte_ranges():
    data = archive([("a.jpg", b"1" * 600), ("a.cls", b"1"), ("b.jpg", b"2" * 10), ("dir/", b""),
                    ("README", b"no extension"), ("c.jpg", b"3")])
    index = index_of(data)
    assert index.keys == ["a", "b", "c"] and index.faults == {}
    ref = {name: (off, size) for name, off, size in reference(data)}
    assert index.starts[0] == 0 and index.ends[0] == sum(ref["a.cls"])
    assert index.ends[1] == sum(ref["b.jpg"])
    assert index.size == len(data)
    assert ShardIndex.from_json(index.to_json(), "x") == index


def test_a_truncated_shard_is_indexed_up_to_the_member_cut_short():
    data = archive([("a.jpg", b"1" * 600), ("b.jpg", b"2" * 3000), ("c.jpg", b"3")])
    cut = data[:512 + tar.padded(600) + 512 + 1000]  # inside b.jpg's data
    index = index_of(cut, "s3://bucket/x.tar")
    assert index.keys == ["a", "b"]
    assert index.faults == {1: f"the shard is truncated: member 'b.jpg' needs bytes up to "
                               f"{512 + tar.padded(600) + 512 + 3000}, and the shard has {len(cut)}"}


def test_a_corrupt_header_becomes_a_fault_and_reading_goes_on_after_it():
    data = bytearray(archive([("a.jpg", b"1" * 600), ("b.jpg", b"2" * 600), ("c.jpg", b"3"), ("d.jpg", b"4")]))
    second = 512 + tar.padded(600)
    data[second + 3] ^= 0x55
    index = index_of(bytes(data))
    third = second + 512 + tar.padded(600)
    assert index.keys == ["a", "", "c", "d"]
    assert index.starts[1:3] == [second, third]
    assert index.faults[1].startswith(f"the tar header at byte {second} has a bad checksum")
    assert index.faults[1].endswith(f"from byte {second} to {third} cannot be read (the next good header is at "
                                    f"byte {third})")


def test_a_member_twice_in_one_sample_is_a_fault():
    index = index_of(archive([("a.jpg", b"1"), ("a.JPG", b"2"), ("b.jpg", b"3")]))
    assert index.keys == ["a", "b"]
    assert index.faults[0].startswith("sample 'a' holds two members with the extension 'jpg'")


def test_compressed_and_foreign_files_are_refused():
    import gzip

    with pytest.raises(ShardError, match=r"^shard x\.tar\.gz is a gzip-compressed tar: samples cannot be read"):
        index_of(gzip.compress(archive([("a.jpg", b"1")])), "x.tar.gz")
    with pytest.raises(ShardError, match=r"^shard page\.html is not a tar archive: the tar header at byte 0"):
        index_of(b"<html>" + b" " * 2000, "page.html")


def test_an_index_file_that_is_not_one_says_so():
    with pytest.raises(ShardError, match=r"^side\.json is not an aioload shard index \(.*\); delete it, or make "
                                         r"it again with `aioload index URL`$"):
        ShardIndex.from_json(b'{"format": "other"}', "side.json")


GOOD = {"format": "aioload-shard-index/1", "size": 10240, "keys": ["a", "b", "c"], "starts": [0, 1024, 2048],
        "ends": [515, 1541, 2563], "faults": {}}


@pytest.mark.parametrize("change, problem", [
    ({"starts": [0, 0, 2048], "ends": [515, 515, 2563]},
     r"sample 1 \('b'\) begins at byte 0, before sample 0 \('a'\) ends \(byte 515\): the ranges overlap or are "
     r"out of order"),
    ({"starts": [1024, 0, 2048], "ends": [1541, 515, 2563]},
     r"sample 1 \('b'\) begins at byte 0, before sample 0 \('a'\) ends \(byte 1541\): the ranges overlap or are "
     r"out of order"),
    ({"starts": [-512, 1024, 2048]}, r"sample 0 \('a'\) has the range -512-515, which does not begin at a tar "
                                     r"header \(a multiple of 512\) or is empty"),
    ({"starts": [0, 1000, 2048]}, r"sample 1 \('b'\) has the range 1000-1541, which does not begin at a tar header "
                                  r"\(a multiple of 512\) or is empty"),
    ({"ends": [515, 1541, 2**62]}, r"sample 2 \('c'\) ends at byte 4611686018427387904, past the shard's 10240 "
                                   r"bytes"),
    ({"keys": ["a", "a", "c"]}, r"samples 0 and 1 have the same key 'a' in a row \(readers make them one sample\)"),
    ({"faults": {"3": "lost"}}, r"fault 3 is not at one of its 3 samples, or has no reason"),
    ({"faults": {"-1": "lost"}}, r"fault -1 is not at one of its 3 samples, or has no reason"),
    ({"starts": [0, "1024", 2048]}, r"sample 1 \('b'\) has a range that is not two integers \('1024', 1541\)"),
    ({"ends": [515, 1541.5, 2563]}, r"sample 1 \('b'\) has a range that is not two integers \(1024, 1541\.5\)"),
    ({"size": True}, r"its size True is not a number of bytes"),
    ({"keys": ["a", "b"]}, r"its lists differ in length \(2 keys, 3 starts, 3 ends\)"),
    ({"keys": ["a", 7, "c"]}, r"key 1 is not a string \(7\)"),
])
def test_a_damaged_index_file_is_refused_naming_it_and_the_fix(change, problem):
    import json

    assert ShardIndex.from_json(json.dumps(GOOD), "x.tar.index.json").keys == ["a", "b", "c"]
    with pytest.raises(ShardError, match=rf"^/d/x\.tar\.index\.json is a damaged shard index: {problem}; delete "
                                         r"it, or make it again with `aioload index /d/x\.tar`$"):
        ShardIndex.from_json(json.dumps({**GOOD, **change}), "/d/x.tar.index.json")


def test_every_index_a_pass_makes_passes_the_check():
    import json

    broken = bytearray(archive([("a.cls", b"1"), ("a.jpg", b"1" * 600), ("b.cls", b"2"), ("b.jpg", b"2")],
                               mtime=1.5))
    broken[4 * tar.BLOCK + 2] ^= 0x40  # a corrupt header splitting a sample
    data = archive([("a.jpg", b"1"), ("a.JPG", b"2"), ("b.jpg", b"3" * 3000)])
    for index in (index_of(bytes(broken)), index_of(data[:2000]), index_of(data)):  # split, truncated, twice
        assert index.faults
        assert ShardIndex.from_json(index.to_json(), "x") == index
        assert json.loads(index.to_json())["keys"] == index.keys


# -- shard patterns ----------------------------------------------------------------------------
def test_brace_patterns_expand_like_webdataset():
    import braceexpand

    for pattern in ["s3://b/train-{000000..000011}.tar", "x-{0..3}-{a,b}.tar", "{9..11}", "plain.tar",
                    "a-{08..10}"]:
        assert urls.expand(pattern) == list(braceexpand.braceexpand(pattern)), pattern
    assert urls.shard_urls(["a-{0..1}.tar", "b.tar"]) == ["a-0.tar", "a-1.tar", "b.tar"]


def test_bad_patterns_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"counts down: write \{lo\.\.hi\} with lo <= hi"):
        urls.expand("a-{5..1}")
    with pytest.raises(ValueError, match=r"has an unmatched brace"):
        urls.expand("a-{0..1")
    with pytest.raises(ValueError, match=r"^no shards: urls is an empty list$"):
        urls.shard_urls([])
    with pytest.raises(TypeError, match=r"^urls must be a shard URL or path"):
        urls.shard_urls(3)


# -- the orders ----------------------------------------------------------------------------------
def test_uniform_order_is_distributed_samplers():
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(range(50), num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(3)
    assert order.uniform_order(50, 7, 3, True).tolist() == list(sampler)
    assert order.uniform_order(5, 7, 3, False).tolist() == [0, 1, 2, 3, 4]


def open_shards_along(sequence: list[int], sizes: list[int]) -> int:
    """The most shards begun and not ended at any point of ``sequence``."""
    first = [0, *torch.cumsum(torch.tensor(sizes), 0).tolist()]
    shard = torch.searchsorted(torch.tensor(first[1:]), torch.tensor(sequence), right=True).tolist()
    begin = {s: shard.index(s) for s in set(shard)}
    end = {s: len(shard) - 1 - shard[::-1].index(s) for s in set(shard)}
    return max(sum(1 for s in begin if begin[s] <= p <= end[s]) for p in range(len(shard)))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_window_order_keeps_k_shards_open_and_draws_every_sample_once(k):
    sizes = [20, 5, 33, 0, 17, 20, 20, 8, 40, 12]
    got = order.window_order(sizes, k, seed=5, epoch=2, shuffle=True).tolist()
    assert sorted(got) == list(range(sum(sizes)))
    assert open_shards_along(got, sizes) == min(k, sum(1 for s in sizes if s))
    assert got == order.window_order(sizes, k, 5, 2, True).tolist()  # a pure function
    assert got != order.window_order(sizes, k, 5, 3, True).tolist()
    assert order.window_order(sizes, k, 5, 2, False).tolist() == list(range(sum(sizes)))


def test_a_window_as_wide_as_the_shards_mixes_them_all_from_the_start():
    sizes = [100] * 10
    got = torch.tensor(order.window_order(sizes, 10, 0, 0, True).tolist())
    first_batch_shards = set((got[:64] // 100).tolist())
    assert len(first_batch_shards) >= 8  # drawn uniformly from all ten shards


def test_a_sample_split_by_a_corrupt_header_is_a_fault_on_both_sides():
    data = bytearray(archive([("a.cls", b"1"), ("a.jpg", b"1" * 600), ("b.cls", b"2"), ("b.jpg", b"2")],
                             mtime=1.5))  # a PAX header before each member
    second = 4 * tar.BLOCK  # a.jpg's PAX header: after a.cls's PAX header, its records, its own and its data
    data[second + 2] ^= 0x40
    index = index_of(bytes(data))
    assert index.keys == ["a", "", "a", "b"]
    split = f"sample 'a' is split by the corrupt stretch at byte {second}: members of it are missing"
    assert index.faults[0] == index.faults[2] == split and 3 not in index.faults


# -- the statistics' shard figures and verdict -------------------------------------------------------
def test_the_verdict_names_the_shard_stage_when_it_is_the_limit():
    from aioload._observe.stats import LoaderStats

    common = dict(batches=10, samples=640, epochs=1, elapsed_s=10.0, first_batch_s=1.0, wait_s=6.0,
                  num_workers=2, io_concurrency=64, decode_s=2.0, decode_cpu_s=1.9, decoded=640)
    window = LoaderStats(**common, shard_mode="window", shard_fetches=8, shard_fetch_bytes=8 * 11_200_000,
                         shard_fetch_wait_s=23.0, reads=640, shard_window_reads=640)
    assert window.verdict_category == "shard-bound"
    assert window.verdict == ("data-bound 67% of the time: reads waited for whole-shard fetches (2.3 reads waiting "
                              "on average; 8 shards fetched, 11.2 MB each): fetch more shards ahead "
                              "(WebDataset(fetch_ahead=...)), or read samples by range (window=None) if the store "
                              "is slow per byte")
    assert window.requests_per_sample == 8 / 640 and window.bytes_per_sample == 8 * 11_200_000 / 640
    assert "shards           window mode: 0.013 requests and 140.0 KB from storage per sample; 8 shards" in str(window)
    uniform = LoaderStats(**common, shard_mode="uniform", reads=640, bytes_read=640 * 110_000, read_s=600.0,
                          read_p50_ms=48.2)
    assert uniform.verdict_category == "shard-bound"
    assert uniform.verdict.endswith("range reads of shard samples are saturated (60 of 64 in flight, p50 48.2 ms, "
                                    "1.00 requests per sample): raise io_concurrency, or fetch whole shards "
                                    "(WebDataset(window=k): one request per shard)")
    plain = LoaderStats(**common, reads=640, read_s=600.0, read_p50_ms=48.2)
    assert plain.verdict_category == "read-bound" and "shards" not in str(plain)
    calm = LoaderStats(**common, shard_mode="window", shard_fetches=8, shard_fetch_wait_s=2.0)
    assert calm.verdict_category != "shard-bound"
