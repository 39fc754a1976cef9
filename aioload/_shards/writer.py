"""``aioload.ShardWriter``: samples into WebDataset tar shards, each with its index sidecar.

A shard is a plain tar (POSIX pax format: a PAX header only where a name needs one), the
members of a sample in a row, named ``<key>.<ext>`` in the order of the sample's extensions,
sorted, as ``webdataset.ShardWriter`` writes them; ``webdataset``, ``tar`` and
:class:`aioload.WebDataset` read it. Beside each shard goes ``<shard>.index.json``
(:data:`aioload._shards.index.SIDECAR`), which spares readers the pass that indexing a shard
costs otherwise.

Shards go to a local folder (written under a temporary name, renamed when complete, so that
no reader sees half a shard) or to an fsspec URL (``s3://...``; the store makes the object
when it is closed). A new shard begins before a sample once the current one holds
``maxcount`` samples or ``maxsize`` bytes of member data.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from typing import Any, Mapping

from aioload._base.errors import a_kind
from aioload._shards import tar
from aioload._shards.index import SIDECAR, ShardIndex
from aioload._storage.storage import locate

logger = logging.getLogger("aioload")


def _encoded(key: str, ext: str, value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value).encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value).encode("utf-8")
    if ext == "npy" or type(value).__module__ in ("numpy", "torch"):
        import numpy as np

        buf = io.BytesIO()
        array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        np.save(buf, array, allow_pickle=False)
        return buf.getvalue()
    raise TypeError(f"sample {key!r}: member {ext!r} is {a_kind(type(value).__name__)}; give bytes (an encoded image, "
                    "say), a str, a number, a dict or list (written as JSON) or an array (written as .npy)")


def _opener(url: str, storage_options: Mapping[str, Any] | None):
    """``(open the file to write, make it visible)`` for a local path or an fsspec URL."""
    kind, where = locate(url)
    if kind == "http":
        raise ValueError(f"cannot write {url}: HTTP servers take no uploads here; write the shards to a local "
                         "folder or an fsspec URL (s3://, gs://, ...)")
    if kind == "local":
        os.makedirs(os.path.dirname(os.path.abspath(where)) or ".", exist_ok=True)
        tmp = f"{where}.tmp{os.getpid()}"
        return (lambda: open(tmp, "wb")), (lambda: os.replace(tmp, where))
    import fsspec

    return (lambda: fsspec.open(url, "wb", **dict(storage_options or {})).open()), (lambda: None)


def write_sidecar(url: str, index: ShardIndex, storage_options: Mapping[str, Any] | None = None) -> str:
    """Write ``index`` as the sidecar of the shard at ``url`` (local or fsspec); its URL."""
    target = url + SIDECAR
    open_file, publish = _opener(target, storage_options)
    with open_file() as f:
        f.write(index.to_json().encode())
    publish()
    return target


class ShardWriter:
    """Write samples into WebDataset tar shards, and each shard's index sidecar.

    ``pattern`` names the shards with a printf field for the shard number, as
    ``webdataset.ShardWriter``'s does: ``"out/train-%06d.tar"`` or ``"s3://bucket/train-%06d.tar"``
    (fsspec; credentials in ``storage_options``). A new shard starts once the current one holds
    ``maxcount`` samples or ``maxsize`` bytes of member data. ``write(sample)`` takes a dict:
    ``"__key__"`` (required; no dot in its last path part, since readers take the key up to
    the first dot of the file name) and one entry per member, ``ext: value``, where ``value`` is
    bytes (an encoded image), a ``str``, a number, a ``dict``/``list`` (JSON) or an array
    (``.npy``); other ``__...__`` entries are not written. ``index=False`` writes no sidecars;
    ``mtime`` is every member's modification time (fixed, so the same samples make the same
    bytes). Use it as a context manager, or call :meth:`close`: the last shard is complete only
    then. :attr:`urls` lists the shards written.
    """

    def __init__(self, pattern: str, maxcount: int = 100_000, maxsize: float = 3e9, *, start_shard: int = 0,
                 storage_options: Mapping[str, Any] | None = None, index: bool = True, mtime: int = 0):
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str with a %d field for the shard number, got {type(pattern).__name__}")
        try:
            names = {pattern % 0, pattern % 1}
        except (TypeError, ValueError):
            raise ValueError(f"pattern {pattern!r} needs one printf field for the shard number, such as "
                             "'train-%06d.tar'") from None
        if len(names) != 2:
            raise ValueError(f"pattern {pattern!r} gives every shard the same name: add a field for the shard number, "
                             "such as 'train-%06d.tar'")
        for name, value in (("maxcount", maxcount), ("maxsize", maxsize)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.pattern = pattern
        self.maxcount = maxcount
        self.maxsize = maxsize
        self.storage_options = dict(storage_options or {})
        self.index = index
        self.mtime = mtime
        self.urls: list[str] = []
        self._shard = start_shard
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._publish = None
        self._entries: ShardIndex | None = None
        self._storage = None  # asks the store for each shard's version, once it is written
        self._last: tuple[str, list[str]] | None = None  # the last sample's key and member names
        self.count = 0  # samples in the current shard
        self.size = 0  # member bytes in the current shard
        self.total = 0  # samples written in all

    def _next_shard(self) -> None:
        self._finish()
        url = self.pattern % self._shard
        self._shard += 1
        open_file, self._publish = _opener(url, self.storage_options)
        self._file = open_file()
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._entries = ShardIndex(0)
        self.urls.append(url)
        self.count = self.size = 0

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample (see the class's docstring) to the current shard."""
        if not isinstance(sample, Mapping) or "__key__" not in sample:
            raise ValueError("a sample is a dict with a '__key__' entry and one entry per member (ext: value)")
        key = sample["__key__"]
        if not isinstance(key, str) or not key:
            raise ValueError(f"__key__ must be a non-empty str, got {key!r}")
        members = [(ext, _encoded(key, ext, value)) for ext, value in sorted(sample.items())
                   if not (ext.startswith("__") and ext.endswith("__"))]
        if not members:
            raise ValueError(f"sample {key!r} has no members: add entries such as 'jpg': bytes")
        for ext, _ in members:
            if tar.split_name(f"{key}.{ext}") != (key, ext.lower()):
                raise ValueError(f"sample {key!r} cannot be stored with the member {ext!r}: readers take the key up to "
                                 "the first dot of the file name; keep dots out of the key's last part and '/' "
                                 "out of extensions, and do not start a key with '__'")
        names = [f"{key}.{ext}" for ext, _ in members]
        if self._last is not None and self._last[0] == key:
            raise ValueError(f"sample {key!r} ({', '.join(names)}) has the key of the sample written just before it "
                             f"({', '.join(self._last[1])}): readers take the members in a row that share a key for "
                             "one sample, so the two would be read as one; give each sample a key of its own")
        if self._tar is None or self.count >= self.maxcount or self.size >= self.maxsize:
            self._next_shard()
        archive, entries = self._tar, self._entries
        if archive is None or entries is None:  # pragma: no cover - _next_shard made both
            raise RuntimeError("the shard writer has no open shard")
        start = archive.offset
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), self.mtime, 0o444
            archive.addfile(info, io.BytesIO(data))
            self.size += len(data)
        last = len(members[-1][1])
        entries.keys.append(key)
        entries.members.append(",".join(sorted(ext.lower() for ext, _ in members)))
        entries.starts.append(start)
        entries.ends.append(archive.offset - (tar.padded(last) - last))
        self.count += 1
        self.total += 1
        self._last = (key, names)

    def _finish(self) -> None:
        """Close the current shard (its end blocks), make it visible, write its sidecar."""
        archive, self._tar = self._tar, None
        if archive is None:
            return
        f = self._file
        archive.close()
        size = f.tell()
        f.close()
        self._publish()
        if self.index and self._entries is not None:
            self._entries.size = size
            self._entries.tag = self._tag(self.urls[-1], size)
            write_sidecar(self.urls[-1], self._entries, self.storage_options)

    def _tag(self, url: str, size: int) -> str:
        """The tag of the shard just written (its mtime, or the store's ETag), which its sidecar
        records so that readers tell it from a shard written again with the same size; empty
        where the store does not say (the sidecar then holds for any shard of its size)."""
        from aioload._shards import probe
        from aioload._storage.scope import run_blocking
        from aioload._storage.storage import Storage

        if self._storage is None:
            self._storage = Storage(storage_options=self.storage_options)
        storage = self._storage
        try:
            version = run_blocking(lambda: probe.version(storage, url))
        except Exception as exc:  # noqa: BLE001 - a store that cannot say costs the check, not the shard
            logger.info("no version tag for %s in its sidecar (%s: %s)", url, type(exc).__name__, exc)
            return ""
        return version.tag if version.size == size else ""

    def close(self) -> None:
        """Finish the last shard. Idempotent."""
        self._finish()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def folder_samples(src: str, storage_options: Mapping[str, Any] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """``(classes, [(path or URL, class index), ...])`` of a class-per-folder tree, in the
    order ``torchvision.datasets.ImageFolder`` (and ``aioload.ImageFolder``) gives them."""
    from aioload.images import ImageFolder
    from aioload._storage.storage import Storage

    folder = ImageFolder(src, storage=Storage(storage_options=storage_options) if storage_options else None)
    return folder.classes, folder.samples


def folder_keys(src: str, samples: list[tuple[str, int]]) -> list[str]:
    """Each sample's key in a class-per-folder tree at ``src``: ``<class>/<file name up to its
    extension>``, the file name's dots made ``_`` (readers end a key at its first dot). Two
    files that make one key (``x.jpg`` and ``x.png``; ``y.z.jpg`` and ``y_z.jpg``) raise
    ``ValueError`` naming both: their samples could not be told apart."""
    base = src.rstrip("/") + "/"
    keys: list[str] = []
    seen: dict[str, str] = {}
    for path, _ in samples:
        rel = path[len(base):] if path.startswith(base) else os.path.relpath(path, src)
        stem = rel.rpartition(".")[0]
        folder, slash, base_name = stem.rpartition("/")
        key = folder + slash + base_name.replace(".", "_")
        if key in seen:
            raise ValueError(f"{seen[key]} and {path} both make the sample key {key!r} (the path up to the file's "
                             "extension, the dots in its name made '_'): a shard cannot hold two samples of one key; "
                             "rename or remove one of them")
        seen[key] = path
        keys.append(key)
    return keys


def convert_folder(src: str, dest: str, *, name: str = "train", maxcount: int = 1000, maxsize: float = 3e9,
                   shuffle_seed: int | None = None, storage_options: Mapping[str, Any] | None = None,
                   progress=None) -> ShardWriter:
    """Write a class-per-folder tree into shards ``dest/<name>-%06d.tar``: one sample per
    image, key ``<class>/<file name without extension>``, the image under its own extension
    and its class index as ``cls`` (two files of one key: ``ValueError``, see
    :func:`folder_keys`). In ImageFolder's order (class by class), or shuffled with
    ``shuffle_seed``. ``progress(n)`` is called after each sample. Returns the closed writer."""
    import random

    from aioload._storage.storage import Storage, read_bytes_blocking

    classes, samples = folder_samples(src, storage_options)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(samples)
    keys = folder_keys(src, samples)  # before any shard is written
    storage = Storage(storage_options=storage_options)
    pattern = dest.rstrip("/") + f"/{name}-%06d.tar"
    with ShardWriter(pattern, maxcount=maxcount, maxsize=maxsize, storage_options=storage_options) as writer:
        for key, (path, target) in zip(keys, samples):
            ext = path.rpartition(".")[2]
            writer.write({"__key__": key, ext.lower(): read_bytes_blocking(path, storage), "cls": target})
            if progress is not None:
                progress(1)
    return writer
