"""``aioload.Parquet``: a map-style dataset over the rows of Parquet files in any store.

The footers (:mod:`aioload._parquet.footer`, read once and cached) give every row group's row
count, so the rows of all the files are one index space (:mod:`aioload._parquet.order`): the
loader computes the order from the seed, deals ranks equal batches and resumes at a position,
as for any map-style dataset.

A read (in the worker that decodes, by default) fetches the column chunks of the row's row
group -- only the columns asked for -- and keeps them in that process's row group cache
(:mod:`aioload._parquet.rowgroups`), so the other rows of the row group that reach the same
worker soon cost nothing more; ``decode`` decodes the row group with pyarrow once and takes
the row out of it. ``window=k`` draws the order from ``k`` row groups at a time, so nearly
every row is served from a row group already fetched. ``window=None`` is a uniform shuffle:
where a file has a page index, a read fetches only the pages that hold the row's values
(:mod:`aioload._parquet.pages`) and decode takes the values out of them
(:mod:`aioload._parquet.values`); without one, or for a column pages cannot serve (a list), it
fetches a row group for nearly every row (``docs/parquet.md`` has the cost in bytes).
"""

from __future__ import annotations

import asyncio
import glob as globmod
import logging
import operator
import os
import posixpath
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import quote, urljoin

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, Dataset
from aioload._parquet import footer as _footer
from aioload._parquet.footer import Footer, FooterCache, ParquetError
from aioload._parquet.order import Layout
from aioload._parquet.pageindex import FilePages, PageIndexError
from aioload._parquet.pages import PageReader, RowPages
from aioload._parquet.values import PageError
from aioload._parquet.rowgroups import Chunks, RowGroupCache, fetch, ranges
from aioload._shards.urls import shard_urls
from aioload._storage import scope as _scope
from aioload._storage.cache import LoaderShare
from aioload._storage.storage import Storage, is_url, locate
from aioload._data.strings import StringList

logger = logging.getLogger("aioload")

CACHE_BYTES = None
"""The default ``cache_bytes``: one bound for the loader's processes together, half for row
groups and half for pages, split among the workers (:class:`aioload._storage.cache.LoaderShare`)."""


def _glob(url: str, options: Mapping[str, Any]) -> list[str]:
    """The files a glob (``*``, ``?``, ``[...]``) matches, sorted: local, or through fsspec."""
    kind, where = locate(url)
    if kind == "local":
        found = sorted(p for p in globmod.glob(where) if os.path.isfile(p))
    elif kind == "fsspec":
        import fsspec

        protocol = url.split("://", 1)[0]
        fs, path = fsspec.core.url_to_fs(url, **options)
        found = [f"{protocol}://{p}" for p in sorted(fs.glob(path)) if fs.isfile(p)]
    else:
        raise ValueError(f"{url}: an http(s) server cannot be listed; name the files, or a brace pattern "
                         "({0000..0099}) of them")
    if not found:
        raise FileNotFoundError(f"no file matches {url}")
    return found


def _file_list(urls, options: Mapping[str, Any]) -> list[str]:
    """The files of a pattern (braces, or a glob), a path, a local folder (its ``*.parquet``,
    sorted) or a list of them."""
    names = shard_urls(urls)
    if any(url.startswith("hf://") for url in names):
        try:
            import huggingface_hub  # noqa: F401 - fsspec's hf:// filesystem is huggingface_hub's
        except ImportError as exc:
            raise ImportError("hf:// URLs are read through huggingface_hub's filesystem: "
                              'pip install "aioload[hf]"') from exc
    out: list[str] = []
    for url in names:
        kind, where = locate(url)
        if kind == "local" and os.path.isdir(where):
            found = sorted(str(p) for p in Path(where).glob("*.parquet"))
            if not found:
                raise FileNotFoundError(f"the folder {url} holds no *.parquet file")
            out.extend(found)
        elif any(c in (where if kind == "local" else url.split("://", 1)[1]) for c in "*?["):
            out.extend(_glob(url, options))
        else:
            out.append(url)
    return out


def _column_list(columns, first: Footer) -> list[str]:
    if columns is None:
        return first.columns
    if isinstance(columns, str):
        columns = [columns]
    out = list(columns)
    if not out or not all(isinstance(c, str) for c in out):
        raise TypeError(f"columns must be a column name or a non-empty list of them, got {columns!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"columns names a column twice: {out}")
    return out


class Parquet(Dataset):
    """The rows of Parquet files as a map-style dataset: exact order, resume and rank splits.

    ``urls``: files (local paths, a local folder of ``*.parquet``, ``http(s)://`` URLs, fsspec
    URLs such as ``s3://`` or ``hf://datasets/...``), as a list, a brace pattern, a glob
    (``"s3://bucket/train/*.parquet"``, local or fsspec; matches sorted) or a list of them.
    Row ``i`` of the dataset is the files' rows laid end to end. A sample is a dict ``{column:
    value}`` of the ``columns`` asked for (default: every column of the first file).

    * ``decode`` -- ``None``: images and sounds are decoded (below), a list of numbers (token
      ids, say) is a 1-D numpy array, every other value is pyarrow's Python value (``int``,
      ``str``, ``bytes``, a list, a dict for a struct).
      A function: called in the workers with the row dict, values as stored (an image column
      of ``datasets`` is ``{"bytes": b"...", "path": ...}``; numbers' lists as numpy arrays),
      returns the training sample.
    * ``transform`` -- with the default ``decode``: a function of the decoded row dict (say,
      ``lambda row: (augment(row["image"]), row["label"])``).
    * ``images`` -- columns the default ``decode`` decodes as images (uint8 ``(3, H, W)``, as
      :func:`aioload.decode_image`): by default those ``datasets`` marks as ``Image`` in the
      files' metadata. A value may be the bytes or ``{"bytes", "path"}``; without bytes, the
      image is read from its path (relative to the Parquet file, in the same store, or absolute).
    * ``audio`` -- keyword arguments of :func:`aioload.decode_audio` (``sample_rate``,
      ``seconds``, ...) for the columns ``datasets`` marks as ``Audio``; without it, sounds
      stay encoded.
    * ``window`` -- ``None``: a uniform shuffle over every row; a row costs the pages that hold
      it where the files have a page index, else its row group. ``k``: rows drawn from ``k``
      row groups at a time, which each worker fetches once (see ``docs/parquet.md``).
    * ``cache_bytes`` -- the bound on the row groups each process keeps (fetched bytes, counted
      twice for the decoded table), and in uniform mode on the pages it keeps besides; window
      mode always keeps its ``k + 2`` latest row groups. ``None`` (default): one bound for the
      loader's processes together (1 GiB, or an eighth of the memory its cgroup allows if less),
      half to row groups and half to pages, split evenly among the workers.
    * ``storage`` -- an :class:`aioload.Storage` (retries, timeouts, credentials).
    * ``footer_cache`` -- where footers are kept between runs: ``True`` (default:
      ``$AIOLOAD_CACHE/parquet-footer``), a folder, or ``False``.

    The footers are read at construction: a missing file raises ``FileNotFoundError``, a file
    that is not Parquet or lacks a column asked for raises :class:`aioload.ParquetError`. A
    row group or page that cannot be fetched or decoded fails each of its rows when it is read,
    with the file, the row group and the row named, and the column for a page
    (``on_error="skip"`` leaves them out).
    """

    def __init__(self, urls: str | os.PathLike | Sequence[str | os.PathLike],
                 columns: str | Sequence[str] | None = None,
                 decode: Callable[[dict[str, Any]], Any] | None = None, *,
                 transform: Callable[[dict[str, Any]], Any] | None = None,
                 images: Sequence[str] | None = None, audio: Mapping[str, Any] | None = None,
                 window: int | None = None, cache_bytes: int | None = CACHE_BYTES,
                 storage: Storage | None = None, footer_cache: bool | str | os.PathLike = True):
        _footer.pyarrow_parquet()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
        if cache_bytes is not None and (isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int)
                                        or cache_bytes < 0):
            raise ValueError(f"cache_bytes must be an int >= 0 or None, got {cache_bytes!r}")
        for name, fn in (("decode", decode), ("transform", transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function of the row dict, or None, got {type(fn).__name__}")
        if decode is not None and transform is not None:
            raise ValueError("transform runs after the default decode: pass decode= or transform=, not both")
        if storage is not None and not isinstance(storage, Storage):
            raise TypeError(f"storage must be an aioload.Storage, got {type(storage).__name__}")
        self.storage = storage if storage is not None else Storage()
        self.window = window
        self._decode_fn, self._transform = decode, transform
        self._audio = dict(audio) if audio is not None else None
        files = _file_list(urls, self.storage.storage_options or {})
        if footer_cache is True:
            cache: FooterCache | None = FooterCache(_footer.default_cache_folder())
        elif footer_cache is False or footer_cache is None:
            cache = None
        else:
            cache = FooterCache(footer_cache)
        found = _scope.run_blocking(lambda: _footer.footers(self.storage, files, cache))
        logger.info("read the footers of %d Parquet files (%d from the cache)", len(found),
                    sum(cached for _, cached in found))
        self._footers = [f for f, _ in found]
        self.urls = StringList(files)
        self.columns = _column_list(columns, self._footers[0])
        features = self._footers[0].features
        self.images = list(images) if images is not None else [c for c in self.columns if features.get(c) == "Image"]
        self.sounds = [c for c in self.columns if features.get(c) == "Audio"]
        self._check_columns()
        if self.images and decode is None:  # workers forked from here inherit the image decoder
            from aioload.images import torchcodec_images

            torchcodec_images()
        self._layout = Layout([f.rows for f in self._footers])
        self._leaves = [np.array([i for c in self.columns for i in f.leaves[c]], dtype=np.int64)
                        for f in self._footers]
        keep = window + 2 if window is not None else 1
        # None: the loader-wide bound, half each to row groups and pages, split among the workers
        rows_bound = cache_bytes if cache_bytes is not None else LoaderShare(fraction=0.5 if window is None else 1.0)
        pages_bound = cache_bytes if cache_bytes is not None else LoaderShare(fraction=0.5)
        self._cache: RowGroupCache[Chunks] = RowGroupCache(rows_bound, keep)
        # a uniform shuffle reads by page the columns whose files have a page index
        self._pages = PageReader(pages_bound) if window is None else None
        self._parsed: dict[int, Any] = {}
        self._plans: dict[int, FilePages | PageIndexError | None] = {}  # a footer pages cannot read: its error

    def _check_columns(self) -> None:
        for f in self._footers:
            missing = [c for c in self.columns if c not in f.leaves]
            if missing:
                raise ParquetError(f"{f.url} has no column {', '.join(map(repr, missing))} (its columns: "
                                   f"{', '.join(f.columns)}); pass columns= that every file has")
        for c in self.images:
            if c not in self.columns:
                raise ValueError(f"images names {c!r}, which is not among the columns read ({self.columns})")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_parsed"] = {}  # pyarrow's parsed footers are made again where they are used
        state["_plans"] = {}
        return state

    # -- what the dataset holds ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._layout)

    @property
    def row_group_rows(self) -> list[int]:
        """Rows per row group, every file's in turn (the window's units)."""
        return self._layout.group_rows.tolist()

    def locate(self, index: int) -> tuple[str, int, int]:
        """``(file URL, row group, row within it)`` of row ``index``."""
        f, g, r = self._layout.locate(self._check(index))
        return self.urls[f], g, r

    def describe(self, index: int) -> str:
        url, g, r = self.locate(index)
        return f"{url}, row group {g}, row {r}"

    def _check(self, index) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"Parquet indices are ints, got {type(index).__name__}") from None
        if isinstance(index, bool):
            raise TypeError("Parquet indices are ints, got bool")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {index} is out of range for a Parquet dataset of {n} rows")
        return i + n if i < 0 else i

    @property
    def rows_ahead(self) -> int:
        """The rows a loader's workers should read ahead of their decode: in window mode over
        files that are not all local, a window's rows (each new window's row groups are fetched
        at once, and behind latency a worker holding only the next batch or two waits for
        them); else 0, the loader's own depth."""
        if self.window is None or all(locate(url)[0] == "local" for url in self.urls):
            return 0
        rows = self._layout.group_rows
        return int(self.window * rows.mean()) if len(rows) else 0

    # -- the planner's protocol ---------------------------------------------------------------
    @property
    def deal(self) -> str:
        """Every ``world_size``-th row to a rank (uniform), or contiguous blocks (window mode:
        each rank then fetches row groups of its own)."""
        return "stride" if self.window is None else "blocks"

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """The epoch's order over every rank: each row once, a function of the arguments."""
        return self._layout.epoch_order(self.window, seed, epoch, shuffle)

    @property
    def read_in_workers(self) -> bool:  # type: ignore[override]
        """Always: a read hands its worker the whole row group it fetched (or the row's pages),
        which is cheap in the process that decodes and costly to send to another (a storage
        cache is then each worker's own)."""
        return True

    # -- reads ----------------------------------------------------------------------------------
    def _key(self, index: int) -> tuple[int, int]:
        f, g, _ = self._layout.locate(index)
        return f, g

    def _plan(self, f: int) -> FilePages | None:
        """File ``f``'s columns read by page (uniform mode), or ``None``: all by row group."""
        if self._pages is None:
            return None
        if f not in self._plans:
            try:
                plan = FilePages(self._footers[f].raw, self._metadata(f).schema.to_arrow_schema(), self.columns)
            except PageIndexError as exc:  # kept: each row would parse the footer again
                self._plans[f] = exc
                raise
            self._plans[f] = plan if plan.nodes else None
        found = self._plans[f]
        if isinstance(found, PageIndexError):
            raise PageIndexError(str(found))
        return found

    def _group_columns(self, f: int) -> list[str]:
        """The columns of file ``f`` read with their row group."""
        plan = self._plan(f)
        return self.columns if plan is None else [c for c in self.columns if c not in plan.nodes]

    def _fetch(self, f: int, g: int):
        footer = self._footers[f]
        plan = self._plan(f)
        leaves = self._leaves[f] if plan is None else [i for c in self._group_columns(f) for i in footer.leaves[c]]
        starts, lengths = _footer.chunk_ranges(footer, g, leaves)
        return fetch(self.storage, footer.url, ranges(starts, lengths))

    def _plan_of(self, index: int, f: int) -> FilePages | None:
        """:meth:`_plan`, its failure a ParquetError naming row ``index`` (a read's first use of it)."""
        try:
            return self._plan(f)
        except PageIndexError as exc:
            raise ParquetError(f"{self.describe(index)}: {exc}; the file is corrupt (where pyarrow reads it, "
                               "window=k reads whole row groups with pyarrow)") from exc

    def read_nowait(self, index: int) -> Any:
        index = self._check(index)
        f, g, r = self._layout.locate(index)
        plan = self._plan_of(index, f)
        chunks = None
        if plan is None or self._group_columns(f):
            chunks = self._cache.peek((f, g))
            if chunks is None:
                return NOT_READY
        pages = None
        if plan is not None:
            assert self._pages is not None
            try:
                pages = self._pages.read_nowait(self.storage, self.urls[f], f, plan, g, r)
            except (ValueError, KeyError, IndexError) as exc:
                raise self._index_error(index, exc) from exc
            if pages is None:
                return NOT_READY
        return chunks, index, pages

    async def read(self, index: int) -> tuple[Chunks | None, int, RowPages | None]:
        index = self._check(index)
        f, g, r = self._layout.locate(index)
        plan = self._plan_of(index, f)
        if plan is not None and not await self._page_index(f, plan):
            plan = None
        if plan is None:
            return await self._cache.get((f, g), lambda: self._fetch(f, g)), index, None
        assert self._pages is not None
        pages = self._pages.read(self.storage, self.urls[f], f, plan, g, r)
        chunks: Chunks | None = None
        try:
            if self._group_columns(f):
                chunks = self._cache.peek((f, g))  # held: no second task to gather
                if chunks is None:
                    found, chunks = await asyncio.gather(pages, self._cache.get((f, g), lambda: self._fetch(f, g)))
                else:
                    found = await pages
            else:
                found = await pages
        except ParquetError:
            raise
        except (ValueError, KeyError, IndexError) as exc:  # a page index that does not fit the footer
            raise self._index_error(index, exc) from exc
        return chunks, index, found

    def _index_error(self, index: int, exc: Exception) -> ParquetError:
        return ParquetError(f"{self.describe(index)}: the file's page index cannot be read ({exc}); the file is "
                            "corrupt, or was written again since its footer was read")

    async def _page_index(self, f: int, plan: FilePages) -> bool:
        """Whether file ``f``'s page index is here. One that cannot be fetched (it is written
        after the data, so a file cut short since its footer was read has lost it) makes the
        file read by row group from then on in this process: its intact row groups still serve
        their rows, and only the rows of those lost fail."""
        assert self._pages is not None
        if self._pages.index_nowait(f) is not None:
            return True
        try:
            await self._pages.index(self.storage, self.urls[f], f, plan)
        except OSError as exc:
            if self._plans.get(f) is not None:
                logger.warning("%s: its page index cannot be fetched (%s); its rows are read by row group",
                               self.urls[f], exc)
                self._plans[f] = None
            return False
        return True

    def read_blocking(self, index: int) -> tuple[Chunks | None, int, RowPages | None]:
        ready = self.read_nowait(index)
        if ready is not NOT_READY:
            return ready
        return _scope.run_blocking(lambda: self.read(index))

    # -- decode (in a worker) -------------------------------------------------------------------
    def _metadata(self, f: int) -> Any:
        md = self._parsed.get(f)
        if md is None:
            md = self._parsed[f] = _footer.parse(self._footers[f].raw, self.urls[f])
        return md

    def row(self, raw: tuple[Chunks | None, int, RowPages | None]) -> dict[str, Any]:
        """What a read returned, as the row dict ``{column: value}`` with values as stored."""
        chunks, index, pages = raw
        f, g, r = self._layout.locate(index)
        out = self._page_values(f, pages, index) if pages is not None else {}
        if chunks is not None:
            out.update(self._group_values(chunks, f, g, r))
        return {name: out[name] for name in self.columns}

    def _page_values(self, f: int, pages: RowPages, index: int) -> dict[str, Any]:
        plan = self._plan(f)
        assert plan is not None
        out = {}
        for name in plan.nodes:
            try:
                out[name] = pages.value(plan, name)
            except (PageError, ValueError, KeyError, IndexError) as exc:
                raise ParquetError(f"{self.describe(index)}, column {name!r}: a page cannot be decoded "
                                   f"({type(exc).__name__}: {exc}); the file is corrupt or was written again since "
                                   "its footer was read (where pyarrow reads it, window=k reads whole row groups "
                                   "with pyarrow)") from exc
        return out

    def _group_values(self, chunks: Chunks, f: int, g: int, r: int) -> dict[str, Any]:
        footer = self._footers[f]
        columns = self._group_columns(f)
        rows = int(footer.rows[g])

        def where() -> str:  # the column that fails read alone, where one does
            name = chunks.culprit(self._metadata(f), footer.size, g, columns, rows)
            return f"{footer.url}, row group {g}, row {r}" + (f", column {name!r}" if name is not None else "")

        try:
            table = chunks.table(self._metadata(f), footer.size, g, columns)
        except Exception as exc:
            raise ParquetError(f"{where()}: the row group cannot be decoded ({type(exc).__name__}: {exc}); the file "
                               "is corrupt, or was written again since its footer was read") from exc
        if table.num_rows != rows:
            raise ParquetError(f"{where()}: the row group decoded to {table.num_rows} rows, and its footer says {rows}")
        numeric = chunks.numeric_lists(table)
        out = {}
        for name in columns:
            try:
                out[name] = _value(table.column(name)[r], name in numeric)
            except ValueError as exc:  # a string that is not UTF-8, say
                raise ParquetError(f"{footer.url}, row group {g}, row {r}, column {name!r}: the value cannot be read "
                                   f"({type(exc).__name__}: {exc}); the file is corrupt") from exc
        return out

    def decode(self, raw: tuple[Chunks | None, int, RowPages | None]) -> Any:
        row = self.row(raw)
        if self._decode_fn is not None:
            return self._decode_fn(row)
        row = self.decode_media(row, raw[1])
        return self._transform(row) if self._transform is not None else row

    def decode_media(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """The default decode: the image columns to uint8 ``(3, H, W)`` tensors, the sound
        columns (with ``audio=``) to float32 ``(channels, samples)``."""
        for name in self.images:
            data = self._payload(row[name], index, name)
            if data is not None:
                row[name] = _decode_image(data, lambda: f"{self.describe(index)}, column {name!r}")
        if self._audio is not None:
            from aioload._media.frombytes import decode_audio

            for name in self.sounds:
                data = self._payload(row[name], index, name)
                if data is not None:
                    row[name] = decode_audio(data, where=f"{self.describe(index)}, column {name!r}", **self._audio)
        return row

    def _payload(self, value: Any, index: int, name: str) -> Any:
        """The encoded bytes of an image or sound value: bytes, or ``datasets``' ``{"bytes",
        "path"}``, whose bytes are read from its path where the file holds none (as ``datasets``
        does: a path written by ``Image()`` cast from file names); ``None`` where the value is
        missing."""
        if not isinstance(value, dict):
            return value
        data, path = value.get("bytes"), value.get("path")
        if data is not None or not path:
            return data
        url = self.urls[self._layout.locate(index)[0]]
        target = beside(url, path)
        try:
            return self.storage.read_bytes_blocking(target)
        except Exception as exc:
            raise ParquetError(f"{self.describe(index)}, column {name!r}: the value holds no bytes, only the path "
                               f"{path!r}, and {target} cannot be read ({type(exc).__name__}: {exc}); put the file "
                               "there (a relative path is read beside the Parquet file), or write its bytes into "
                               "the Parquet file (datasets: embed_table_storage before to_parquet)") from exc

    # -- whole columns --------------------------------------------------------------------------
    def read_column(self, name: str) -> Any:
        """Column ``name`` of every row, in index order, as one ``pyarrow.ChunkedArray``: each
        row group's chunk of that column alone is fetched and decoded, here (say, a lengths
        column for a packing plan)."""
        import pyarrow as pa

        for f in self._footers:
            if name not in f.leaves:
                raise ParquetError(f"{f.url} has no column {name!r} (its columns: {', '.join(f.columns)})")

        async def all_groups() -> list[Any]:
            import asyncio

            slots = asyncio.Semaphore(32)

            async def one(f: int, g: int) -> Any:
                footer = self._footers[f]
                starts, lengths = _footer.chunk_ranges(footer, g, footer.leaves[name])
                async with slots:
                    chunks = await fetch(self.storage, footer.url, ranges(starts, lengths))
                return chunks.table(self._metadata(f), footer.size, g, [name]).column(0)

            return list(await asyncio.gather(*(one(f, g) for f, footer in enumerate(self._footers)
                                               for g in range(len(footer.rows)))))

        pieces = _scope.run_blocking(all_groups)
        if not pieces:  # files without row groups
            return pa.chunked_array([], type=pa.null())
        return pa.chunked_array([c for piece in pieces for c in piece.chunks], type=pieces[0].type)

    def __repr__(self) -> str:
        mode = "uniform" if self.window is None else f"window={self.window}"
        return (f"Parquet({len(self.urls)} files, {len(self._layout.group_rows)} row groups, {len(self)} rows, "
                f"columns={self.columns}, {mode})")


def _value(scalar: Any, numeric_list: bool) -> Any:
    """A pyarrow scalar as Python: a list of numbers as a 1-D numpy array (a copy, writable:
    torch's collation makes it a tensor without a warning), anything else as ``as_py()``."""
    if numeric_list and scalar.is_valid:
        return np.array(scalar.values.to_numpy(zero_copy_only=False))
    return scalar.as_py()


def beside(url: str, path: str) -> str:
    """Where the ``path`` stored in the Parquet file at ``url`` points: an absolute path or a URL
    as it is, a relative path beside the file (in the same store)."""
    if os.path.isabs(path) or is_url(path):
        return path
    kind, where = locate(url)
    if kind == "local":
        return os.path.join(os.path.dirname(where), path)
    if kind == "http":
        return urljoin(url, quote(path))
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{posixpath.normpath(posixpath.join(posixpath.dirname(rest), path))}"


def _decode_image(data: Any, where: Callable[[], str]) -> torch.Tensor:
    from aioload.images import decode_image

    try:
        return decode_image(data)
    except Exception as exc:
        raise ParquetError(f"{where()}: the image cannot be decoded ({type(exc).__name__}: {exc})") from exc
