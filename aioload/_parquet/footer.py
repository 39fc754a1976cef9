"""A Parquet file's footer: its row groups' row counts and each column chunk's byte range.

The footer is read once per file (one ranged read of the file's tail, :data:`TAIL` bytes,
which holds the whole footer of nearly every file; a second read where it does not) and kept
in a local cache keyed by the file's URL and version (size and ETag or mtime, as a shard's
index is: :mod:`aioload._shards.probe`), so a later run reads no footer at all. What is kept
is the footer's own bytes: the training process takes from them the row groups' row counts
and the columns (:class:`Footer`: one step per row group, whatever the columns), and every
process that fetches a row group parses them with pyarrow once for its column chunks' byte
ranges (:func:`chunk_ranges`) and to decode what it fetched.

A file whose tail is not a Parquet footer (no ``PAR1`` magic, a length that runs past the
file's start, an encrypted footer, a footer pyarrow cannot parse) raises
:class:`ParquetError` naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aioload._shards import probe
from aioload._storage.storage import Storage
from aioload._storage.versioned import VersionedFiles, for_each_file
from aioload._storage.cachedir import cache_dir
from aioload._parquet.thrift import read_struct

TAIL = 64 << 10
"""Bytes read from a file's end to find its footer: enough for the footers of files with a few
hundred row groups of a few columns (a Hub image set's is 10-40 KiB)."""

MAGIC = b"PAR1"


class ParquetError(ValueError):
    """A Parquet file, or a row of one, that cannot be read: not Parquet, a column it lacks, a
    row group that fails to decode. The message names the file and, where there is one, the
    row group and the row."""


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or an ImportError that names the extra to install."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("aioload.Parquet needs pyarrow: pip install 'aioload[parquet]'") from exc
    return pq


def _leaves(arrow_type) -> int:
    """How many Parquet leaf columns (column chunks) a top-level Arrow type is stored as."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        return sum(_leaves(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    if pa.types.is_map(arrow_type):
        return _leaves(arrow_type.key_type) + _leaves(arrow_type.item_type)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return _leaves(arrow_type.value_type)
    return 1


def parse(raw: bytes, url: str) -> Any:
    """The pyarrow ``FileMetaData`` of a footer (``raw``: its bytes, then the 8 that end a file)."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    try:
        return pq.read_metadata(pa.BufferReader(raw))
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ParquetError(f"{url} is not a Parquet file: its footer cannot be read ({exc})") from None


@dataclass
class Footer:
    """What the order and the reads need of one file, from its footer.

    ``rows[g]``: rows of row group ``g``; ``leaves[name]``: the leaf columns (column chunks) a
    top-level column is stored as, by position; ``features``: the Hugging Face feature types
    found in the file's metadata (``{"image": "Image", ...}``), empty for other files;
    ``raw``: the footer's bytes, parsed where the column chunks' byte ranges are needed
    (:func:`chunk_ranges`), so that a footer of many row groups costs nothing more here."""

    url: str
    size: int
    raw: bytes
    rows: np.ndarray
    leaves: dict[str, range]
    features: dict[str, str] = field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        return list(self.leaves)

    def chunk_meta(self) -> list:
        """Each row group's column chunks (Thrift structs, ``{field id: value}``), parsed from
        ``raw`` once per process (not sent to the workers with the footer)."""
        groups = self.__dict__.get("_groups")
        if groups is None:
            length = int.from_bytes(self.raw[-8:-4], "little")
            try:
                meta, _ = read_struct(self.raw[len(self.raw) - 8 - length:len(self.raw) - 8])
                groups = [group[1] for group in meta[4]]
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise ParquetError(f"{self.url}: its footer's row groups cannot be read ({type(exc).__name__}: "
                                   f"{exc}); the file is corrupt") from None
            self.__dict__["_groups"] = groups
        return groups

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_groups", None)
        return state

    @classmethod
    def of(cls, raw: bytes, url: str, size: int) -> "Footer":
        md = parse(raw, url)
        schema = md.schema.to_arrow_schema()
        leaves, at = {}, 0
        for f in schema:
            n = _leaves(f.type)
            leaves[f.name] = range(at, at + n)
            at += n
        if at != md.num_columns:
            raise ParquetError(f"{url}: its schema names {at} leaf columns and its row groups hold "
                               f"{md.num_columns}: the footer is inconsistent")
        rows = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], dtype=np.int64)
        return cls(url, size, raw, rows, leaves, _features(md))


def chunk_ranges(footer: "Footer", group: int, leaves) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of row group ``group``'s chunks of the leaf columns ``leaves``,
    read from the footer's Thrift by aioload's own reader (:meth:`Footer.chunk_meta`): pyarrow's
    accessors end the process (``std::terminate``) on some footers that its reader still reads."""
    url, size = footer.url, footer.size
    starts = np.zeros(len(leaves), dtype=np.int64)
    lengths = np.zeros(len(leaves), dtype=np.int64)
    try:
        columns = footer.chunk_meta()[group]
        for i, c in enumerate(leaves):
            meta = columns[int(c)][3]  # ColumnChunk.meta_data
            dictionary = meta.get(11)  # dictionary_page_offset, where the chunk has a dictionary page
            starts[i] = dictionary if dictionary else meta[9]  # else data_page_offset (0 also means none)
            lengths[i] = meta[7]  # total_compressed_size
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ParquetError(f"{url}, row group {group}: the footer does not give its column chunks' byte ranges "
                           f"({type(exc).__name__}: {exc}); the file is corrupt") from None
    if len(leaves) and (int(starts.min()) < 0 or int(lengths.min()) < 0 or int((starts + lengths).max()) > size):
        raise ParquetError(f"{url}, row group {group}: a column chunk's byte range runs outside the file's {size} "
                           "bytes: the file is truncated, or was written again since its footer was read")
    return starts, lengths


def _features(md) -> dict[str, str]:
    """``{column: "Image" | "Audio" | ...}`` from the ``huggingface`` key of the file's metadata
    (what ``datasets`` writes: ``{"info": {"features": {name: {"_type": ...}}}}``)."""
    meta = md.metadata or {}
    text = meta.get(b"huggingface")
    if not text:
        return {}
    try:
        features = json.loads(text)["info"]["features"]
        return {name: str(spec.get("_type", "")) for name, spec in features.items() if isinstance(spec, dict)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def footer_bytes(tail: bytes, size: int, url: str) -> tuple[int, int]:
    """``(offset, length)`` of the footer (its bytes and the 8 that end the file), from the
    file's last ``len(tail)`` bytes."""
    if size < 12 or len(tail) < 8 or tail[-4:] != MAGIC:
        if tail[-4:] == b"PARE":
            raise ParquetError(f"{url} is an encrypted Parquet file: aioload.Parquet reads plain footers only")
        raise ParquetError(f"{url} is not a Parquet file: it does not end with the magic bytes {MAGIC!r}; "
                           "pass Parquet files only (a CSV or JSON file must be converted first)")
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 12 > size:
        raise ParquetError(f"{url} is not a Parquet file: its footer claims {length} bytes, more than the "
                           f"file's {size}; it is truncated or corrupt")
    return size - length - 8, length + 8


async def read_footer(storage: Storage, url: str, size: int) -> bytes:
    """The footer's bytes, read from the file's tail (once more where the tail did not hold it)."""
    n = min(size, TAIL)
    tail = await storage.read_range(url, size - n, n) if n else b""
    offset, length = footer_bytes(tail, size, url)
    if length <= len(tail):
        return tail[len(tail) - length:]
    return await storage.read_range(url, offset, length)


# -- the cache ---------------------------------------------------------------------------------
class FooterCache(VersionedFiles):
    """Footers kept in a local folder, one file per file version."""

    def __init__(self, folder: str | os.PathLike):
        super().__init__(folder, ".footer")

    def get(self, url: str, version: probe.Version) -> bytes | None:
        raw = self.read(url, version)
        return raw if raw is not None and raw[-4:] == MAGIC else None  # a file cut short by a crash: read again

    def put(self, url: str, version: probe.Version, raw: bytes) -> None:
        # a read-only cache costs a footer read next time, nothing more
        self.write(url, version, raw, f"the footer of {url}")


def default_cache_folder() -> Path:
    return cache_dir() / "parquet-footer"


async def footer(storage: Storage, url: str, cache: FooterCache | None) -> tuple[Footer, bool]:
    """One file's :class:`Footer`, and whether it came from the cache."""
    try:
        version = await probe.version(storage, url)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"Parquet file {url} does not exist ({exc}); remove it from the list") from exc
    raw = cache.get(url, version) if cache is not None else None
    cached = raw is not None
    if raw is None:
        raw = await read_footer(storage, url, version.size)
    parsed = Footer.of(raw, url, version.size)
    if cache is not None and not cached:
        cache.put(url, version, raw)
    return parsed, cached


async def footers(storage: Storage, urls: list[str], cache: FooterCache | None,
                  concurrency: int = 32) -> list[tuple[Footer, bool]]:
    """Every file's footer, in the order of ``urls``, ``concurrency`` at a time."""
    return await for_each_file(list(urls), lambda url: footer(storage, url, cache), concurrency)
