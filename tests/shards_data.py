"""Shards for the shard tests: the same images written by ``webdataset``'s ShardWriter (PAX
headers before every member) and by ``aioload.ShardWriter``, and what ``webdataset``'s own
pipeline reads from them (the reference)."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import aioload


def image_samples(image_root: Path) -> list[tuple[str, bytes, int]]:
    """``(key, jpeg bytes, class)`` of every image, class by class (ImageFolder's order)."""
    folder = aioload.ImageFolder(image_root)
    out = []
    for path, target in folder.samples:
        rel = os.path.relpath(path, image_root)
        out.append((rel.rsplit(".", 1)[0], Path(path).read_bytes(), target))
    return out


def write_webdataset(samples, folder: Path, maxcount: int) -> str:
    """Shards written by ``webdataset.ShardWriter`` (``format="pax"``: its mtimes are floats, so a
    PAX header goes before every member); returns their brace pattern."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "wds-%06d.tar"), maxcount=maxcount, verbose=0, format="pax") as w:
        for key, data, target in samples:
            w.write({"__key__": key, "jpg": data, "cls": target})
        last = w.shard - 1
    return str(folder / f"wds-{{000000..{last:06d}}}.tar")


def write_aioload(samples, folder: Path, maxcount: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    with aioload.ShardWriter(str(folder / "aio-%06d.tar"), maxcount=maxcount) as w:
        for key, data, target in samples:
            w.write({"__key__": key, "jpg": data, "cls": target})
    return str(folder / f"aio-{{000000..{len(w.urls) - 1:06d}}}.tar")


def digest(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()[:16]


def webdataset_samples(pattern: str):
    """The samples ``webdataset``'s own tar reader and grouping make of the shards (its
    ``tar_file_expander`` and ``group_by_keys``, over files this closes: its ``WebDataset``
    pipeline leaves them to the garbage collector)."""
    from webdataset.shardlists import expand_urls
    from webdataset.tariterators import group_by_keys, tar_file_expander

    for url in expand_urls(pattern):
        with open(url, "rb") as f:
            yield from group_by_keys(tar_file_expander([{"url": url, "stream": f}]))


def webdataset_reads(pattern: str) -> dict[str, tuple[str, int]]:
    """key -> (digest of the jpg, class), as ``webdataset`` reads the shards."""
    return {s["__key__"]: (digest(s["jpg"]), int(s["cls"])) for s in webdataset_samples(pattern)}


def fingerprint(sample: dict) -> tuple[str, str, int]:
    """A decode for the loader: ``(key, digest of the jpg, class)`` (strings collate as lists)."""
    return sample["__key__"], digest(sample["jpg"]), int(sample["cls"])


def set_header_field(path, member: str, start: int, field: bytes, keep_mtime: bool = True) -> None:
    """Overwrite bytes ``start:start + len(field)`` of the tar header of ``member`` in the shard
    at ``path`` in place (its checksum made again), as a damaged or hand-edited shard holds
    them. ``keep_mtime``: the file's mtime is set back, so that the shard's version (size,
    mtime, inode) is the one its sidecar recorded."""
    with tarfile.open(path) as t:
        at = t.getmember(member).offset_data - 512  # its own header (after any PAX header)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        block = bytearray(f.read(512))
        block[start:start + len(field)] = field
        block[148:156] = b" " * 8
        block[148:155] = f"{sum(block):06o}\0".encode()
        f.seek(at)
        f.write(block)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def small_shard(folder: Path, n: int = 6) -> str:
    """A shard of ``n`` samples ``s0``, ``s1``, ... (``cls``: i, ``txt``: "text i") and its sidecar."""
    with aioload.ShardWriter(str(folder / "small-%d.tar")) as w:
        for i in range(n):
            w.write({"__key__": f"s{i}", "cls": i, "txt": f"text {i}"})
    return w.urls[0]


def rewrite_member(url: str, name: str, data: bytes, keep_mtime: bool) -> None:
    """The member ``name`` given other ``data`` in place, within its 512-byte padding: the shard
    keeps its size (and, with ``keep_mtime``, its mtime and inode: the version its sidecar has)."""
    with tarfile.open(url) as t:
        offset = t.getmember(name).offset_data
    before = os.stat(url)
    set_header_field(url, name, 124, f"{len(data):011o}\0".encode(), keep_mtime=False)
    with open(url, "r+b") as f:
        f.seek(offset)
        f.write(data.ljust(-(-len(data) // 512) * 512, b"\0"))
    if keep_mtime:
        os.utime(url, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:  # another mtime, also where the clock's grain is coarse
        os.utime(url, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
