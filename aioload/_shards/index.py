"""A shard's index: each sample's key and byte range, so that ``len()`` is known and a
sample is read with one range request.

A sample's range runs from its first member's first header (a PAX or long-name header
included) to the end of its last member's data: the members of a sample are contiguous in a
tar, and the headers inside the range let the reader check, for free, that the bytes it got
are the sample the index names (:mod:`aioload._shards.dataset`).

Where an index comes from, cheapest first (:class:`Indexer`):

1. the local cache (``$AIOLOAD_CACHE/shard-index/``), keyed by the shard's URL and version
   (:mod:`aioload._shards.probe`: size and ETag or mtime), so a shard written again is indexed
   again;
2. a sidecar ``<shard>.index.json`` beside the shard (``aioload.ShardWriter`` writes one,
   ``aioload index URLS`` makes them for shards written by other tools), checked in full when
   loaded (:meth:`ShardIndex.check`) and used when the version it records is the shard's: the
   size, and the tag (ETag or mtime) too where it has one. A sidecar of the same size and
   another tag (the shard was copied, uploaded, or written again in place) is used for a
   remote shard, whose pass would read it whole, and not for a local one, whose pass reads
   its headers only; a 404 or 403 for it (S3's answer for a missing key) means none;
3. one sequential pass over the shard: a local file's headers are read where they are (a
   read per member, the data skipped); a remote shard is read whole, once (bounded by the
   storage's ``max_bytes``).

What cannot be read is kept in the index as a *fault* at the sample's position, so that the
loader reports it (or skips it, with ``on_error="skip"``) when that sample comes up: a
truncated shard (the member that runs past the end), a member present twice in one sample,
a corrupt header (a placeholder for whatever the corrupt stretch held; the pass goes on at
the next good header). A shard that is not a tar at all, or is compressed, raises
:class:`ShardError` at once.

Whichever index is used, each sample's read checks it against the shard
(:meth:`aioload.WebDataset.members`): the headers in the range must name the sample's key, and
its members must end exactly where the range ends, so that an index that is not the shard's
raises :class:`ShardError` instead of handing over other bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aioload._shards import probe, tar
from aioload._storage.redact import redact
from aioload._storage.retry import RemoteReadError
from aioload._storage.storage import Storage, locate
from aioload._storage.versioned import VersionedFiles, for_each_file
from aioload._storage.cachedir import cache_dir

logger = logging.getLogger("aioload")

SIDECAR = ".index.json"
"""What a shard's sidecar index is called: the shard's name with this appended."""

FORMAT = "aioload-shard-index/1"

_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


class ShardError(ValueError):
    """A shard, or one of its samples, that cannot be read as a WebDataset tar: truncated,
    corrupt, compressed, or changed since it was indexed. The message names the shard's URL
    (its credentials redacted) and, where there is one, the sample's key."""

    def __init__(self, message: str):
        super().__init__(redact(message))


@dataclass
class ShardIndex:
    """One shard's samples: ``keys[i]`` and its bytes ``starts[i]:ends[i]``; ``faults[i]``
    says why sample ``i`` cannot be read (its key may then be empty). ``size``: the shard's
    bytes when indexed; ``tag``: its version's tag then (:class:`probe.Version`; empty where
    unknown), which tells a sidecar of a shard written again with the same size.
    ``members[i]``: sample ``i``'s extensions, sorted, joined by ``,`` (empty list: not
    recorded, as in indexes made before it was)."""

    size: int
    keys: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    faults: dict[int, str] = field(default_factory=dict)
    tag: str = field(default="", compare=False)
    members: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "size": self.size, "tag": self.tag, "keys": self.keys,
                           "starts": self.starts, "ends": self.ends,
                           "faults": {str(k): v for k, v in self.faults.items()}, "members": self.members},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "ShardIndex":
        """The index in ``text`` (a sidecar, or a file of the cache, at ``where``), checked in
        full (:meth:`check`): a damaged or hand-edited one raises :class:`ShardError`."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"its format is not {FORMAT!r}")
            faults = data["faults"]
            if not isinstance(faults, dict):
                raise ValueError("its faults are not an object")
            index = cls(data["size"], data["keys"], data["starts"], data["ends"],
                        {int(k): v for k, v in faults.items()}, data.get("tag", ""), data.get("members", []))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ShardError(f"{where} is not an aioload shard index ({exc}); {_remedy(where)}") from None
        index.check(where)
        return index

    def check(self, where: str) -> None:
        """Raise :class:`ShardError` unless this is an index a pass over a tar can make: every
        number an int, the lists of one length, the ranges on 512-byte boundaries, in order,
        apart and inside the shard (a truncated sample's, a fault, may run past its end), no
        two samples in a row with one key (readers would make them one), faults at samples."""
        problem = _problem(self)
        if problem is not None:
            raise ShardError(f"{where} is a damaged shard index: {problem}; {_remedy(where)}")


def _remedy(where: str) -> str:
    shard = where[:-len(SIDECAR)] if where.endswith(SIDECAR) else "URL"
    return f"delete it, or make it again with `aioload index {shard}`"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _problem(index: ShardIndex) -> str | None:
    """What makes ``index`` one that no pass over a tar makes, or ``None``."""
    size, keys, starts, ends, faults = index.size, index.keys, index.starts, index.ends, index.faults
    if not _is_int(size) or size < 0:
        return f"its size {size!r} is not a number of bytes"
    if not isinstance(index.tag, str):
        return f"its tag {index.tag!r} is not a string"
    if not all(isinstance(x, list) for x in (keys, starts, ends)):
        return "its keys, starts and ends are not lists"
    if not len(keys) == len(starts) == len(ends):
        return f"its lists differ in length ({len(keys)} keys, {len(starts)} starts, {len(ends)} ends)"
    members = index.members
    if not isinstance(members, list) or (members and len(members) != len(keys)) \
            or not all(isinstance(m, str) for m in members):
        return f"its members are not one string per sample ({len(keys)} samples)"
    for i, (key, start, end) in enumerate(zip(keys, starts, ends)):
        if not isinstance(key, str):
            return f"key {i} is not a string ({key!r})"
        if not (_is_int(start) and _is_int(end)):
            return f"sample {i} ({key!r}) has a range that is not two integers ({start!r}, {end!r})"
        if start < 0 or start % tar.BLOCK or end <= start:
            return (f"sample {i} ({key!r}) has the range {start}-{end}, which does not begin at a tar header "
                    f"(a multiple of {tar.BLOCK}) or is empty")
        if i and start < ends[i - 1]:
            return (f"sample {i} ({key!r}) begins at byte {start}, before sample {i - 1} ({keys[i - 1]!r}) ends "
                    f"(byte {ends[i - 1]}): the ranges overlap or are out of order")
        if i and key and key == keys[i - 1]:
            return f"samples {i - 1} and {i} have the same key {key!r} in a row (readers make them one sample)"
        if end > size and i not in faults:
            return f"sample {i} ({key!r}) ends at byte {end}, past the shard's {size} bytes"
    for pos, why in faults.items():
        if not 0 <= pos < len(keys) or not isinstance(why, str):
            return f"fault {pos} is not at one of its {len(keys)} samples, or has no reason"
    return None


# -- one pass over an archive ------------------------------------------------------------------
class _Samples:
    """Members grouped into samples as they come, with what cannot be read as faults."""

    def __init__(self, size: int):
        self.index = ShardIndex(size)
        self.exts: set[str] = set()
        self.open = False  # the last entry is a sample that may take more members
        self.broken_after: int | None = None  # the sample before a corrupt stretch, until the next member

    def add(self, member: tar.Member) -> None:
        if not member.regular:
            return
        parts = tar.split_name(member.name)
        if parts is None:
            return
        key, ext = parts
        index = self.index
        if self.broken_after is not None:
            self._split(key, member)
        if not self.open or key != index.keys[-1]:
            index.keys.append(key)
            index.starts.append(member.start)
            index.ends.append(member.end)
            index.members.append("")
            self.exts = set()
            self.open = True
        pos = len(index.keys) - 1
        if ext in self.exts:
            index.faults.setdefault(pos, f"sample {key!r} holds two members with the extension {ext!r} "
                                         f"(the second is {member.name!r}, at byte {member.start})")
        self.exts.add(ext)
        index.members[pos] = ",".join(sorted(self.exts))
        index.ends[pos] = member.end
        if member.end > index.size:
            index.faults.setdefault(pos, f"the shard is truncated: member {member.name!r} needs bytes up to "
                                         f"{member.end}, and the shard has {index.size}")

    def _split(self, key: str, member: tar.Member) -> None:
        """The first member after a corrupt stretch: when it has the key of the sample before
        the stretch, that sample lost members to it; both of its parts are faults."""
        before, self.broken_after = self.broken_after, None
        index = self.index
        if index.keys[before] != key:
            return
        why = (f"sample {key!r} is split by the corrupt stretch at byte {index.starts[before + 1]}: members of it "
               "are missing")
        index.faults.setdefault(before, why)
        index.faults.setdefault(len(index.keys), why)

    def corrupt(self, at: int, until: int, reason: str) -> None:
        index = self.index
        if self.open:
            self.broken_after = len(index.keys) - 1
        index.faults[len(index.keys)] = (f"{reason}; whatever the shard holds from byte {at} to {until} cannot "
                                         f"be read" + (" (the shard's end)" if until >= index.size else
                                                       f" (the next good header is at byte {until})"))
        index.keys.append("")
        index.starts.append(at)
        index.ends.append(until)
        index.members.append("")
        self.open = False


def _check_plain(head: bytes, url: str) -> None:
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            raise ShardError(f"shard {url} is a {kind}-compressed tar: samples cannot be read from it by range. "
                             "Decompress the shards (images and audio do not compress anyway), e.g. "
                             f"`{'gunzip' if kind == 'gzip' else kind + ' -d'}`")


def index_archive(read_at: Callable[[int, int], bytes], size: int, url: str) -> ShardIndex:
    """The index of the archive that ``read_at(offset, n)`` reads, ``size`` bytes long."""
    _check_plain(bytes(read_at(0, 6)), url)
    samples = _Samples(size)
    pos = 0
    while True:
        try:
            for member in tar.members(read_at, pos):
                samples.add(member)
                if member.end > size:
                    break
            break
        except tar.TarError as exc:
            resumed = tar.resync(read_at, exc.offset, size)
            if exc.offset == 0 and resumed is None:
                raise ShardError(f"shard {url} is not a tar archive: {exc}") from None
            samples.corrupt(exc.offset, size if resumed is None else resumed, str(exc))
            if resumed is None:
                break
            pos = resumed
    return samples.index


def _index_local(path: str, url: str) -> ShardIndex:
    fd = os.open(path, os.O_RDONLY)
    try:
        return index_archive(lambda offset, n: os.pread(fd, n, offset), os.fstat(fd).st_size, url)
    finally:
        os.close(fd)


# -- where an index comes from -----------------------------------------------------------------
def _content_tag(tag: str) -> str:
    """The part of a version's tag that changes with the content: a local file's mtime, not its
    inode, which a copy that keeps the mtime (``cp -a``, ``rsync -a``) changes too."""
    return tag.split(" ino=", 1)[0] if tag.startswith("mtime_ns=") else tag


def _sidecar_fits(index: ShardIndex, version: probe.Version, url: str, where: str) -> bool:
    """Whether the sidecar ``index`` (at ``where``) is used for the shard at ``url`` as it is
    now (``version``): see the module's docstring."""
    if index.size != version.size:
        logger.info("the sidecar %s describes %d bytes, the shard has %d: indexing the shard itself",
                    redact(where), index.size, version.size)
        return False
    if not index.tag or _content_tag(index.tag) == _content_tag(version.tag):
        return True
    if locate(url)[0] == "local":
        logger.info("the sidecar %s was written for another version of the shard (%s; now %s): indexing the "
                    "shard itself", redact(where), index.tag, version.tag)
        return False
    logger.info("the sidecar %s was written for another version of the shard (%s; now %s), of its size: used, "
                "each sample's headers are checked as it is read", redact(where), index.tag, version.tag)
    return True


class IndexCache(VersionedFiles):
    """Indexes kept in a local folder, one file per shard version."""

    def __init__(self, folder: str | os.PathLike):
        super().__init__(folder, ".json")

    def get(self, url: str, version: probe.Version) -> ShardIndex | None:
        text = self.read(url, version)
        if text is None:
            return None
        try:
            index = ShardIndex.from_json(text, str(self.path(url, version)))
        except ShardError:
            return None  # a file cut short by a crash, say: made again
        return index if index.size == version.size else None

    def put(self, url: str, version: probe.Version, index: ShardIndex) -> None:
        # a read-only cache costs a pass next time, nothing more
        self.write(url, version, index.to_json().encode(), f"the index of {redact(url)}")


def default_cache_folder() -> Path:
    return cache_dir() / "shard-index"


@dataclass
class Indexed:
    """A shard's index and where it came from: ``"cache"``, ``"sidecar"`` or ``"scan"``."""

    url: str
    index: ShardIndex
    source: str
    version: probe.Version


class Indexer:
    """Finds or builds shards' indexes (see the module's docstring); ``cache=None``: no cache."""

    SCANS = 4
    """Remote shards read whole at once while indexing (each is held in memory meanwhile)."""

    def __init__(self, storage: Storage, cache: IndexCache | None, concurrency: int = 32):
        self.storage = storage
        self.cache = cache
        self.concurrency = concurrency

    async def one(self, url: str, scans: asyncio.Semaphore | None = None) -> Indexed:
        try:
            version = await probe.version(self.storage, url)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"shard {redact(url)} does not exist ({exc}); remove it from the shard "
                                    "list") from exc
        if self.cache is not None:
            cached = self.cache.get(url, version)
            if cached is not None:
                return Indexed(url, cached, "cache", version)
        index = await self._sidecar(url, version)
        source = "sidecar"
        if index is None:
            async with scans or asyncio.Semaphore(1):
                index = await self._scan(url)
            source = "scan"
            if index.size != version.size:
                raise ShardError(f"shard {url} changed while it was indexed ({version.size} bytes, then "
                                 f"{index.size}); index it again when it is complete")
            index.tag = version.tag
        if self.cache is not None:
            self.cache.put(url, version, index)
        return Indexed(url, index, source, version)

    async def _sidecar(self, url: str, version: probe.Version) -> ShardIndex | None:
        where = url + SIDECAR
        try:
            text = await self.storage.read_bytes(where)
        except FileNotFoundError:
            return None
        except RemoteReadError as exc:  # S3 answers a missing key 403 to a client that may not list the bucket
            if exc.status != 403:
                raise
            return None
        index = ShardIndex.from_json(text, where)
        return index if _sidecar_fits(index, version, url, where) else None

    async def _scan(self, url: str) -> ShardIndex:  # its version's tag is set by one()
        kind, where = locate(url)
        if kind == "local":
            return await asyncio.to_thread(_index_local, where, url)
        data = memoryview(await self.storage.read_bytes(url))
        return index_archive(lambda offset, n: data[offset:offset + n], len(data), url)

    async def all(self, urls: list[str]) -> list[Indexed]:
        """Every shard's index, in the order of ``urls``, ``concurrency`` at a time."""
        scans = asyncio.Semaphore(self.SCANS)

        async def one(url: str) -> Indexed:
            try:
                return await self.one(url, scans)
            except Exception as exc:
                if not isinstance(exc, FileNotFoundError) or "does not exist" not in str(exc):
                    exc.add_note(f"while indexing shard {redact(url)}")
                raise

        return await for_each_file(urls, one, self.concurrency)
