"""A cache of remote objects in a local folder: one byte budget for every process sharing the
folder, least recently used evicted first, written atomically, checked when read.

Layout (format 2), all under ``directory/aioload-v2/`` (mode 0700)::

    lock                          fcntl lock file; also holds the folder's total bytes and
                                  entries, so that every process keeps one shared budget
    ab/                           256 subfolders (0700), named by the first two hex digits
    ab/<sha256>.entry             one object (0600): a 20-byte header (magic with the format
                                  version, payload length, CRC-32 of the name and the
                                  payload), then the payload
    ab/.<sha256>.<random>.tmp     an object being written, renamed into place when complete

The name is the SHA-256 of the key (the URL, or the URL and the byte range of a range read).
Recency is the entry's modification time, set at full resolution on every write and hit.

What the cache trusts: only its own folder. The folder must belong to this user and not be
writable by group or others (whoever can write there decides what a cached read returns), so
a shared ``/tmp`` folder made by someone else is refused. Inside it, the cache opens, counts
and removes only names of exactly the patterns above, as regular files: every open is
``O_NOFOLLOW`` relative to a folder opened ``O_NOFOLLOW``, so neither a symlinked entry nor a
symlinked subfolder is ever followed, and other files in ``directory`` are never touched.
Anything going wrong inside the cache (an entry removed by another process, a damaged or
foreign entry, a full disk) is a miss: the read goes to the storage, and the problem is
logged once per cache (``logging.getLogger("aioload")``).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator

from aioload._storage.cache import CacheKey, CacheStats, Counters, check_budget, entries_bytes

__all__ = ["DiskCache"]

logger = logging.getLogger("aioload")

_STORE = "aioload-v2"  # bump with the format: an older format's folder is left alone
_MAGIC = b"aioload\x02"
# magic, payload length, checksum. The checksum catches torn writes, bit rot and an entry
# under another's name; it need not resist forgery, since only this user can write in the
# folder. The fastest in the standard library for 110 KB objects: CRC-32 took 190 us,
# SHA-256 1.8x and BLAKE2b 4.7x that (best of 5 x 400, on a loaded 2-vCPU machine).
_HEADER = struct.Struct("<8sQI")
_LEDGER = struct.Struct("<8sQQ")  # magic, bytes, entries: the folder's totals
_LEDGER_MAGIC = b"aioldgr\x02"
_SUFFIX = ".entry"
_SUBFOLDER = re.compile(r"[0-9a-f]{2}")
_ENTRY = re.compile(r"[0-9a-f]{64}\.entry")
_TEMP = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{16}\.tmp")
_STALE_TMP_S = 3600.0
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskCache:
    """Remote objects kept in ``directory``, at most ``max_bytes`` of entries in the folder,
    least recently used evicted first. Local paths are never copied into it.

    The folder is created with mode 0700 when missing; an existing one must belong to this
    user and not be writable by group or others, else ``PermissionError`` names it. Entries
    go to ``directory/aioload-v2/`` and nothing else in ``directory`` is touched, so it may be
    a folder holding other files. Writes go to a temporary file renamed into place; every
    entry carries a checksum, and a damaged one is a miss and is removed. The cache survives
    restarts, and processes sharing the folder share its budget: changes happen under a lock
    file that also holds the folder's totals. A problem inside the cache is a miss, logged
    once, never an error of the read.
    """

    blocking = True  # get/put touch the disk: called in the loop's executor
    remote_only = True

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        check_budget(max_bytes)
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = max_bytes
        self._reset()
        _prepare(self.directory)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()  # this process's index and counters; taken after the file lock
        # name -> (size, the last use this process knows of, in ns), least recently used first
        self._index: collections.OrderedDict[str, tuple[int, int]] | None = None
        self._n = Counters()
        self._reported = False

    cache_kind = "disk_cache_index"  # its bytes in loader.stats()

    def held_bytes(self) -> int:
        """What this process's index of the folder's entries weighs in memory."""
        return entries_bytes(self._index) if self._pid == os.getpid() else 0

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    # -- the public operations ---------------------------------------------------------------
    def get(self, key: CacheKey) -> bytes | None:
        self._own()
        name = _name(key)
        data = None
        try:
            with _store(self.directory) as store:
                self._loaded(store)
                data, found = _read(store, name)
                if data is None and found is not None:
                    self._discard(store, name, found)
        except OSError as exc:
            self._report("read", exc)
        with self._lock:
            if data is None:
                self._n.misses += 1
            else:
                self._n.hits += 1
                if self._index is not None:
                    self._index[name] = (_HEADER.size + len(data), time.time_ns())
                    self._index.move_to_end(name)
        return data

    def put(self, key: CacheKey, data: bytes) -> None:
        self._own()
        name = _name(key)
        size = _HEADER.size + len(data)
        if size > self.max_bytes:
            with self._lock:
                self._n.rejected += 1
            return
        try:
            with _store(self.directory) as store, _subfolder(store, name, create=True) as sub:
                tmp = _write_temp(sub, name, data)
                placed = False
                try:
                    with _locked(store) as ledger, self._lock:
                        index = self._scanned(store, ledger)
                        total, entries = _totals(ledger)
                        old = _size(sub, name + _SUFFIX)  # replaced, so no longer counted
                        index.pop(name, None)
                        total, entries = self._evict(store, index, total - old, entries - (old > 0), size, name)
                        os.rename(tmp, name + _SUFFIX, src_dir_fd=sub, dst_dir_fd=sub)
                        placed = True
                        _set_totals(ledger, total + size, entries + 1)
                        index[name] = (size, time.time_ns())
                finally:
                    if not placed:
                        _unlink(sub, tmp)
        except OSError as exc:
            self._report("write", exc)

    def clear(self) -> None:
        """Remove every entry of the folder (for all the processes sharing it)."""
        self._own()
        try:
            with _store(self.directory) as store, _locked(store) as ledger, self._lock:
                for _, name, _ in list(_scan(store)):
                    _remove(store, name)
                _set_totals(ledger, 0, 0)
                self._index = collections.OrderedDict()
        except OSError as exc:
            self._report("clear", exc)

    def stats(self) -> CacheStats:
        """Counters of this process's lookups; ``entries`` and ``bytes`` are the folder's."""
        self._own()
        total = entries = 0
        try:
            with _store(self.directory) as store:
                self._loaded(store)
                with _locked(store, shared=True) as ledger:
                    total, entries = _totals(ledger)
        except OSError as exc:
            self._report("read", exc)
        with self._lock:
            n = self._n
            return CacheStats(n.hits, n.misses, entries, total, self.max_bytes, n.evictions, n.rejected)

    # -- the index and the budget ----------------------------------------------------------
    def _loaded(self, store: int) -> None:
        """Scan the folder into this process's index on first use."""
        if self._index is None:
            with _locked(store) as ledger, self._lock:
                self._scanned(store, ledger)

    def _scanned(self, store: int, ledger: int) -> collections.OrderedDict[str, tuple[int, int]]:
        """This process's index (called with both locks held), scanned from the folder if
        there is none yet; a scan also resets the folder's totals to what it counted."""
        if self._index is not None:
            return self._index
        found = sorted(_scan(store))
        index = self._index = collections.OrderedDict((name, (size, used)) for used, name, size in found)
        total, entries = self._evict(store, index, sum(size for _, _, size in found), len(found), 0)
        _set_totals(ledger, total, entries)
        return index

    def _evict(self, store: int, index: collections.OrderedDict[str, tuple[int, int]], total: int, entries: int,
               room: int, keep: str = "") -> tuple[int, int]:
        """Remove least recently used entries until ``room`` more bytes fit in the budget
        (called with both locks held); the folder's new totals. An entry another process has
        used since is kept and moved to its place; entries this process does not know of
        (written by another) are found by a rescan once its own are gone."""
        rescanned = False
        spared = 0
        while total + room > self.max_bytes:
            if not index:
                if rescanned:
                    break
                rescanned = True
                found = sorted(entry for entry in _scan(store) if entry[1] != keep)
                index.update((name, (size, used)) for used, name, size in found)
                total, entries = sum(size for _, _, size in found), len(found)
                continue
            name, (_, known) = index.popitem(last=False)
            st = _stat_in(store, name)
            if st is None:  # gone already: counted by whoever removed it
                continue
            if st.st_mtime_ns > known and spared < len(index):  # a hit in another process
                index[name] = (st.st_size, st.st_mtime_ns)
                spared += 1
                continue
            if _remove(store, name):
                total, entries = total - st.st_size, entries - 1
                self._n.evictions += 1
        return max(total, 0), max(entries, 0)

    def _discard(self, store: int, name: str, found: os.stat_result) -> None:
        """Remove a damaged entry, unless another process has replaced it meanwhile."""
        with _locked(store) as ledger, self._lock, _subfolder(store, name) as sub:
            counted = self._index.pop(name, (None, 0))[0] if self._index is not None else None
            try:
                now = os.stat(name + _SUFFIX, dir_fd=sub, follow_symlinks=False)
            except FileNotFoundError:
                return
            if (now.st_ino, now.st_dev) == (found.st_ino, found.st_dev) and _unlink(sub, name + _SUFFIX):
                if stat.S_ISREG(now.st_mode):  # counted when written, at the size it had then
                    total, entries = _totals(ledger)
                    size = now.st_size if counted is None else counted
                    _set_totals(ledger, max(total - size, 0), max(entries - 1, 0))

    def _report(self, what: str, exc: OSError) -> None:
        if self._reported:
            logger.debug("aioload DiskCache %s: could not %s an entry (%s); a miss", self.directory, what, exc)
            return
        self._reported = True
        logger.warning("aioload DiskCache %s: could not %s an entry (%s); reads go to the storage "
                       "instead (later problems of this cache are logged at DEBUG level)", self.directory, what, exc)

    def __getstate__(self):
        return {"directory": self.directory, "max_bytes": self.max_bytes}

    def __setstate__(self, state) -> None:
        self.directory = state["directory"]
        self.max_bytes = state["max_bytes"]
        self._reset()

    def __repr__(self) -> str:
        return f"DiskCache({self.directory!r}, max_bytes={self.max_bytes})"


# -- names and entries ---------------------------------------------------------------------------
def _name(key: CacheKey) -> str:
    """SHA-256 of the key written as JSON, tagged with its type, so that no two keys share a
    name (a URL can never equal a range key)."""
    if isinstance(key, tuple):
        fields = ["tuple", *key]
    elif isinstance(key, (str, bytes)):
        fields = ["str", os.fsdecode(key)]
    else:
        raise TypeError(f"a cache key is a str or a tuple, got {type(key).__name__}")
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _checksum(name: str, data) -> int:
    return zlib.crc32(data, zlib.crc32(bytes.fromhex(name)))


def _read(store: int, name: str) -> tuple[bytes | None, os.stat_result | None]:
    """The payload of entry ``name`` and its stat; ``(None, stat)`` for a damaged entry (one
    that is not a regular file of this user's, or fails its checks); ``(None, None)`` when
    there is none."""
    try:
        sub = os.open(name[:2], _DIR, dir_fd=store)
    except FileNotFoundError:
        return None, None
    try:
        try:
            fd = os.open(name + _SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sub)
        except FileNotFoundError:
            return None, None
        except OSError:  # a symlink (ELOOP) or something else that no write of ours made
            return None, os.stat(name + _SUFFIX, dir_fd=sub, follow_symlinks=False)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return None, st
            header = f.read(_HEADER.size)
            if len(header) == _HEADER.size:
                magic, length, checksum = _HEADER.unpack(header)
                if magic == _MAGIC and length == st.st_size - _HEADER.size:
                    payload = f.read()
                    if len(payload) == length and checksum == _checksum(name, payload):
                        with contextlib.suppress(OSError):  # a hit all the same
                            _touch(fd)  # recency survives a restart
                        return payload, st
            return None, st
    finally:
        os.close(sub)


def _write_temp(sub: int, name: str, data) -> str:
    """A new temporary file holding the entry (created exclusively, never through a link)."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sub)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(_HEADER.pack(_MAGIC, len(data), _checksum(name, data)))
            f.write(data)
        _touch(fd)
    except BaseException:
        _unlink(sub, tmp)
        raise
    finally:
        os.close(fd)
    return tmp


def _scan(store: int) -> Iterator[tuple[int, str, int]]:
    """``(mtime_ns, name, size)`` of every entry in the folder; removes stale temporaries.
    Only names of the cache's patterns, only regular files, never through a link."""
    now = time.time()
    with os.scandir(store) as subs:
        folders = [s.name for s in subs if _SUBFOLDER.fullmatch(s.name) and s.is_dir(follow_symlinks=False)]
    for folder in folders:
        try:
            sub = os.open(folder, _DIR, dir_fd=store)
        except OSError:  # removed meanwhile, or replaced by a link
            continue
        try:
            with os.scandir(sub) as entries:
                names = [e.name for e in entries]
            for name in names:
                entry, temp = _ENTRY.fullmatch(name), _TEMP.fullmatch(name)
                if not (entry or temp) or not name.lstrip(".").startswith(folder):
                    continue
                try:
                    st = os.stat(name, dir_fd=sub, follow_symlinks=False)
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if entry:
                    yield st.st_mtime_ns, name[: -len(_SUFFIX)], st.st_size
                elif now - st.st_mtime > _STALE_TMP_S:  # left by a crashed writer
                    _unlink(sub, name)
        finally:
            os.close(sub)


def _size(sub: int, name: str) -> int:
    """The size of a regular file ``name`` in ``sub``; 0 when missing or anything else."""
    try:
        st = os.stat(name, dir_fd=sub, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _stat_in(store: int, name: str) -> os.stat_result | None:
    """The stat of entry ``name`` if it is a regular file, else None."""
    try:
        with _subfolder(store, name) as sub:
            st = os.stat(name + _SUFFIX, dir_fd=sub, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _remove(store: int, name: str) -> bool:
    """Remove entry ``name``; whether it was there."""
    try:
        with _subfolder(store, name) as sub:
            return _unlink(sub, name + _SUFFIX)
    except FileNotFoundError:
        return False


def _touch(fd: int) -> None:
    """Set the access and modification time to now, at full resolution (the kernel stamps
    writes with a coarse clock, too coarse to order objects used a millisecond apart)."""
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


def _unlink(sub: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=sub)
    except FileNotFoundError:
        return False
    return True


# -- the folder -----------------------------------------------------------------------------------
def _prepare(directory: str) -> None:
    """Create the folder (0700) and its store, or check them; ``PermissionError`` naming the
    folder when it belongs to someone else or others may write in it."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    _check_folder(directory, os.stat(directory))
    try:
        os.mkdir(os.path.join(directory, _STORE), 0o700)
    except FileExistsError:
        pass
    with _store(directory):
        pass


def _check_folder(path: str, st: os.stat_result) -> None:
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"DiskCache folder {path} is not a folder: pass a folder (DiskCache creates a "
                                 f"missing one)")
    risk = "whoever can write there decides what cached reads return"
    if st.st_uid != uid:
        raise PermissionError(f"DiskCache folder {path} belongs to uid {st.st_uid}, not to this user (uid {uid}): "
                              f"{risk}. Pass a folder of your own, e.g. ~/.cache/aioload-remote (DiskCache "
                              f"creates a missing folder with mode 0700)")
    if st.st_mode & 0o022:
        raise PermissionError(f"DiskCache folder {path} is writable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}): {risk}. Run `chmod go-w {path}` or pass a folder "
                              f"of your own (DiskCache creates a missing folder with mode 0700)")


@contextlib.contextmanager
def _store(directory: str) -> Iterator[int]:
    """The store folder, opened without following a link and checked to be this user's."""
    path = os.path.join(directory, _STORE)
    try:
        fd = os.open(path, _DIR)
    except FileNotFoundError:  # removed since (say, rm -r of the cache): make it again
        _prepare(directory)
        fd = os.open(path, _DIR)
    try:
        st = os.fstat(fd)
        _check_folder(path, st)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _subfolder(store: int, name: str, create: bool = False) -> Iterator[int]:
    folder = name[:2]
    if create:
        try:
            os.mkdir(folder, 0o700, dir_fd=store)
        except FileExistsError:
            pass
    fd = os.open(folder, _DIR, dir_fd=store)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(store: int, shared: bool = False) -> Iterator[int]:
    """The lock file, locked (exclusively unless ``shared``); it holds the folder's totals."""
    fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=store)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"the DiskCache lock file in {_STORE} is not a regular file of this user's")
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _totals(ledger: int) -> tuple[int, int]:
    raw = os.pread(ledger, _LEDGER.size, 0)
    if len(raw) != _LEDGER.size:
        return 0, 0
    magic, total, entries = _LEDGER.unpack(raw)
    return (total, entries) if magic == _LEDGER_MAGIC else (0, 0)


def _set_totals(ledger: int, total: int, entries: int) -> None:
    os.pwrite(ledger, _LEDGER.pack(_LEDGER_MAGIC, total, entries), 0)
