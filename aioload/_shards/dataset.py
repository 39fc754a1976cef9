"""``aioload.WebDataset``: a map-style dataset over WebDataset tar shards in any store.

Each shard's index (:mod:`aioload._shards.index`) gives every sample's key and byte range, so
the shards together are a map-style dataset: ``len()`` is known, the order is the loader's
(computed from the seed, :mod:`aioload._shards.order`), and a resume is a position in it.

Two ways of reading, one order rule each:

* ``window=None`` (default): a uniform shuffle over all samples; each sample is one range
  request covering its members (``storage.read_range``), made in the worker processes;
  samples of one shard read at once and close together share a request
  (:mod:`aioload._shards.coalesce`).
  Ranks take every ``world_size``-th sample of the order (``deal = "stride"``).
* ``window=k``: whole shards, each fetched once (:mod:`aioload._shards.window`), and samples
  drawn from ``k`` open shards at a time. The fetcher is shared by every worker, so these
  reads run on the loader's event loop (``read_in_workers`` is false) and a sample of a shard
  already fetched is handed over at once (``read_nowait``) as where it lies in the shard's
  shared memory (:class:`~aioload._handoff.shared.SharedRange`), which the worker maps. Ranks
  take contiguous blocks of the order (``deal = "blocks"``), which keeps each on shards of
  its own.

A shard on a local disk is not fetched in either mode: what a read hands over is where the
sample's bytes are (:class:`_LocalRange`), and the worker reads them just before decoding, so
the training process spends nothing per sample on them and the page cache holds the shards.

What a read hands a worker is ``(the sample's range: bytes, or where they are, index)``; ``decode`` parses
the tar headers inside it, checks that they name the sample the index expects (a shard
written again since it was indexed is caught here, not decoded as another sample), and turns
the members into the sample dict ``{"__key__", "__url__", ext: bytes, ...}``, then into the
training sample (``decode=``, or :func:`decode_sample` by default).
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
import os
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, Dataset
from aioload._handoff.shared import SharedRange
from aioload._data.reads import BufferPart
from aioload._shards import coalesce
from aioload._shards import order as _order
from aioload._shards import probe
from aioload._shards import tar
from aioload._shards.decoders import DECODERS, Decoder, decoder_for
from aioload._shards.index import IndexCache, Indexer, ShardError, default_cache_folder
from aioload._shards.urls import shard_urls
from aioload._shards.window import Staged, Window
from aioload._storage import scope as _scope
from aioload._storage.mounts import is_network
from aioload._storage.redact import redact
from aioload._storage.storage import Storage, locate, read_buffer
from aioload._data.strings import StringList

logger = logging.getLogger("aioload")


class _LocalRange:
    """A sample's bytes in a local file, read by the worker just before it decodes them: a
    local shard, or (``staged`` true) a copy of a remote shard that window mode wrote to disk,
    which may be gone by then (:mod:`aioload._shards.window`)."""

    __slots__ = ("path", "offset", "length", "staged")

    def __init__(self, path: str, offset: int, length: int, staged: bool = False):
        self.path, self.offset, self.length, self.staged = path, offset, length, staged

    def __reduce__(self):
        return (_LocalRange, (self.path, self.offset, self.length, self.staged))

    def read(self) -> bytes | None:
        """The bytes; ``None`` for a staged copy already deleted (read the shard itself then)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            if self.staged:
                return None
            raise
        try:
            return os.pread(fd, self.length, self.offset)
        finally:
            os.close(fd)


STAGED_LAG = 1024
"""With ``window_dir``: how many samples after its last read a staged shard's file is kept for
the workers that still have to read samples of it (a file gone earlier costs a range request)."""


def _on_local_disk(urls: Sequence[str]) -> np.ndarray:
    """Whether each shard is a file on a local disk (not a URL, not a network file system)."""
    folders: dict[str, bool] = {}
    out = np.zeros(len(urls), dtype=np.bool_)
    for i, url in enumerate(urls):
        kind, where = locate(url)
        if kind == "local":
            folder = os.path.dirname(os.path.abspath(where)) or "."
            if folder not in folders:
                folders[folder] = not is_network(folder)
            out[i] = folders[folder]
    return out


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _usual_members(indexes) -> tuple[list[str], int] | None:
    """The members (extensions, sorted) most samples have, and how many have them; ``None``
    where an index did not record its samples' members. Faults do not count."""
    if any(len(ix.members) != len(ix) for ix in indexes):
        return None
    counts: collections.Counter[str] = collections.Counter()
    for ix in indexes:
        if ix.faults:
            counts.update(m for pos, m in enumerate(ix.members) if pos not in ix.faults)
        else:
            counts.update(ix.members)
    if not counts:
        return None
    usual, count = counts.most_common(1)[0]  # a tie: the set met first, in the shards' order
    return usual.split(",") if usual else [], count


class WebDataset(Dataset):
    """WebDataset tar shards as a map-style dataset: exact order, resume and rank splits.

    ``urls``: shard paths or URLs (local, ``http(s)://``, fsspec such as ``s3://``), as a
    list, a brace pattern (``"s3://bucket/train-{000000..000999}.tar"``) or a list of
    patterns. Shards written by ``webdataset``, ``tar`` or :class:`aioload.ShardWriter` read
    unchanged. A sample is the members that share a key (``a/b.jpg`` and ``a/b.cls`` are
    sample ``a/b``): ``{"__key__": "a/b", "__url__": shard, "jpg": bytes, "cls": bytes}``.

    * ``decode`` -- runs in the workers on that dict and returns the training sample. By
      default :func:`aioload.decode_sample` decodes each member by its extension (images to
      uint8 ``(3, H, W)`` tensors, ``cls`` to ``int``, ``txt`` to ``str``, ``json``...).
    * ``decoders`` -- extension -> function of the member's bytes, used by the default
      ``decode`` instead of :attr:`decoders` (pass ``{**aioload.WebDataset.decoders, "mp4": f}``
      to add one).
    * ``window`` -- ``None``: a uniform shuffle over every sample, each read with one range
      request, in the workers. ``k``: whole shards fetched once each and samples drawn from
      ``k`` shards at a time (one request per shard; about ``k + fetch_ahead`` shards held in
      the training process's memory). See ``docs/shards.md`` for which to pick.
    * ``coalesce_gap`` -- in uniform mode, samples of one shard whose reads start together
      (in a worker, those of one task) and lie at most this many bytes apart are read with one
      range request (64 KiB by default; ``0``: only adjacent samples; ``None``: one request per
      sample). Not with a storage that has a cache (each sample is cached alone).
    * ``fetch_ahead`` -- with ``window``: shards fetched before any of their samples is due.
    * ``window_dir`` -- with ``window``: a local folder where fetched shards are kept instead of
      the training process's memory; the workers read their samples there (the training process
      then neither copies nor sends sample bytes). About ``k + fetch_ahead`` shards, plus those
      freed within the last 1,024 samples, are on disk at a time.
    * ``window_fetch`` -- with ``window`` (and no ``window_dir``): who receives a shard's bytes
      when the loader has workers. ``"workers"`` (default): a worker receives it into shared
      memory and hands it to the training process, which then spends no CPU on the receive
      (:mod:`aioload._workers.fetches`); ``"loader"``: the loader's event loop receives it, in the
      training process. Either way each shard is fetched once and the order is the same.
    * ``storage`` -- an :class:`aioload.Storage`: retries, timeouts, ``max_bytes`` (a whole
      shard in window mode must fit it), credentials (``storage_options``), a cache.
    * ``index_cache`` -- where shard indexes are kept between runs: ``True`` (default:
      ``$AIOLOAD_CACHE/shard-index``), a folder, or ``False``.
    * ``check_members`` -- with the default ``decode``: a sample whose members (extensions)
      are not those most samples have raises :class:`aioload.ShardError` naming it, since a
      batch that holds it cannot be collated by default (``on_error="skip"`` then leaves out
      that sample alone). The members come from the indexes (indexes made before they recorded
      them are not checked). Turn it off for a ``collate_fn`` that joins samples of different
      members.

    The indexes are found or built here, at construction: from the cache, from a sidecar
    ``<shard>.index.json`` (:class:`aioload.ShardWriter` and ``aioload index URLS`` write
    them), or by reading each shard once. A missing shard raises ``FileNotFoundError``; a
    corrupt or truncated one is indexed up to its fault, and the sample at the fault raises
    :class:`aioload.ShardError` when it is read (``on_error="skip"`` leaves it out).
    """

    decoders: dict[str, Decoder] = dict(DECODERS)
    """The default ``decode``'s decoders by extension, for every WebDataset (a class attribute)."""

    def __init__(self, urls: str | os.PathLike | Sequence[str | os.PathLike],
                 decode: Callable[[dict[str, Any]], Any] | None = None, *,
                 window: int | None = None, fetch_ahead: int = 2, window_dir: str | os.PathLike | None = None,
                 window_fetch: str = "workers",
                 decoders: Mapping[str, Decoder] | None = None, storage: Storage | None = None,
                 index_cache: bool | str | os.PathLike = True, check_members: bool = True,
                 coalesce_gap: int | None = coalesce.GAP):
        _positive("window", window, allow_none=True)
        if coalesce_gap is not None and (isinstance(coalesce_gap, bool) or not isinstance(coalesce_gap, int)
                                         or coalesce_gap < 0):
            raise ValueError(f"coalesce_gap must be an int >= 0 (bytes) or None, got {coalesce_gap!r}")
        if isinstance(fetch_ahead, bool) or not isinstance(fetch_ahead, int) or fetch_ahead < 0:
            raise ValueError(f"fetch_ahead must be an int >= 0, got {fetch_ahead!r}")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a function of the sample dict, or None, got {type(decode).__name__}")
        if window_dir is not None and window is None:
            raise ValueError("window_dir is where window mode keeps the shards it fetched: pass window=k with it")
        if window_fetch not in ("workers", "loader"):
            raise ValueError(f"window_fetch must be 'workers' or 'loader', got {window_fetch!r}")
        if storage is not None and not isinstance(storage, Storage):
            raise TypeError(f"storage must be an aioload.Storage, got {type(storage).__name__}")
        self.storage = storage if storage is not None else Storage()
        self._decode_fn = decode
        self.check_members = bool(check_members)
        if decode is None:  # the default decodes images: workers forked from here inherit the decoder
            from aioload.images import torchcodec_images

            torchcodec_images()
        self._decoders = dict(decoders) if decoders is not None else None
        self.window = window
        self.fetch_ahead = fetch_ahead
        self.window_dir = os.fspath(window_dir) if window_dir is not None else None
        self.window_fetch = window_fetch
        self.coalesce_gap = coalesce_gap
        found = shard_urls(urls)
        if index_cache is True:
            cache: IndexCache | None = IndexCache(default_cache_folder())
        elif index_cache is False or index_cache is None:
            cache = None
        else:
            cache = IndexCache(index_cache)
        indexed = _scope.run_blocking(lambda: Indexer(self.storage, cache).all(found))
        sources = [i.source for i in indexed]
        logger.info("indexed %d shards: %d from the cache, %d from sidecars, %d read through",
                    len(indexed), sources.count("cache"), sources.count("sidecar"), sources.count("scan"))
        self._setup([i.url for i in indexed], [i.index for i in indexed])
        self._range_ignored = ""  # uniform mode: the servers that answer range requests with whole shards
        if self.window is None:
            versions = [(i.url, i.version) for i in indexed]
            ignored = _scope.run_blocking(lambda: probe.ranges_ignored(self.storage, versions))
            if ignored:
                self._range_ignored = ", ".join(ignored)
                warnings.warn(probe.ranges_warning(ignored), stacklevel=2)

    def _setup(self, urls: list[str], indexes) -> None:
        self.urls = StringList(urls)
        counts = np.array([len(ix) for ix in indexes], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._first_list = self._first.tolist()  # for one index: bisect is ~15x cheaper than numpy
        self.shard_sizes = np.array([ix.size for ix in indexes], dtype=np.int64)
        self._starts = np.array([s for ix in indexes for s in ix.starts], dtype=np.int64)
        self._ends = np.array([e for ix in indexes for e in ix.ends], dtype=np.int64)
        self._keys = StringList(k for ix in indexes for k in ix.keys)
        self._faults = {int(self._first[s]) + pos: why for s, ix in enumerate(indexes) for pos, why in ix.faults.items()}
        self._members = _usual_members(indexes)
        n = int(self._first[-1])
        # a shard on a local disk is read by the worker that decodes it, just before (no request)
        self._local = _on_local_disk(urls) if self.storage.cache is None else np.zeros(len(urls), dtype=np.bool_)
        self._window = None
        if self.window is not None:
            # a freed shard's file outlives it by about STAGED_LAG samples (see Window)
            grace = -(-STAGED_LAG * len(counts) // max(1, n)) + (1 if STAGED_LAG else 0)
            self._window = Window(urls, self.shard_of, n, self.storage, self.window, self.fetch_ahead,
                                  self.window_dir, grace)

    # -- what the dataset holds ---------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def shard_lengths(self) -> list[int]:
        """Samples per shard, in the order of :attr:`urls`."""
        return np.diff(self._first).tolist()

    def shard_of(self, indices):
        """The shard (its position in :attr:`urls`) of each of ``indices`` (an int or an array)."""
        return np.searchsorted(self._first, indices, side="right") - 1

    def _shard(self, index: int) -> int:
        """The shard of one index (in range)."""
        return bisect.bisect_right(self._first_list, index) - 1

    def key(self, index: int) -> str:
        """The key of sample ``index``."""
        return self._keys[self._check(index)]

    def describe(self, index: int) -> str:
        index = self._check(index)
        url = self.urls[self._shard(index)]
        key = self._keys[index]
        return f"shard {url}, sample {key!r}" if key else f"shard {url}, a corrupt stretch at byte {self._starts[index]}"

    def _check(self, index) -> int:
        try:
            i = operator.index(index)  # an int, a numpy integer, a 0-d integer tensor
        except TypeError:
            raise TypeError(f"WebDataset indices are ints, got {type(index).__name__}") from None
        if isinstance(index, bool):
            raise TypeError("WebDataset indices are ints, got bool")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {index} is out of range for a WebDataset of {n} samples")
        return i + n if i < 0 else i

    # -- the planner's protocol ---------------------------------------------------------------
    @property
    def deal(self) -> str:
        """How the loader splits the order between ranks: every ``world_size``-th sample
        (``"stride"``, uniform mode) or contiguous blocks (``"blocks"``, window mode: each rank
        then reads shards of its own)."""
        return "stride" if self.window is None else "blocks"

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """The epoch's order over every rank: each index once, a function of the arguments."""
        if self.window is None:
            return _order.uniform_order(len(self), seed, epoch, shuffle)
        return _order.window_order(self.shard_lengths, self.window, seed, epoch, shuffle)

    def will_read(self, indices: Sequence[int]) -> None:
        """This rank's reads of the epoch, in order: window mode fetches shards ahead by it."""
        if self._window is not None:
            self._window.plan(indices)

    @property
    def read_in_workers(self) -> bool:  # type: ignore[override]
        if self._window is not None and not self._local.all():
            return False  # the fetcher is shared by every worker: it lives on the loader's loop
        return bool(Dataset.read_in_workers.fget(self))  # type: ignore[attr-defined]

    @property
    def fetch_in_workers(self) -> bool:
        """Whether a loader's workers receive the window's shards (``window_fetch``)."""
        return (self._window is not None and self.window_dir is None and self.window_fetch == "workers"
                and not self._local.all())

    # -- reads ----------------------------------------------------------------------------------
    def _fault(self, index: int) -> None:
        why = self._faults.get(index)
        if why is not None:
            url = self.urls[self._shard(index)]
            key = self._keys[index]
            raise ShardError(f"shard {url}, sample {key!r}: {why}" if key else f"shard {url}: {why}")

    def read_nowait(self, index: int) -> Any:
        index = self._check(index)
        if index in self._faults:
            return NOT_READY  # read() raises it, as a failed read
        shard = self._shard(index)
        if self._local[shard]:  # also in window mode: the page cache holds a local shard, not this process
            start, end = int(self._starts[index]), int(self._ends[index])
            return _LocalRange(locate(self.urls[shard])[1], start, end - start), index
        if self._window is not None:
            data = self._window.at_hand(shard)
            if data is None:
                return NOT_READY
            try:
                return self._slice(data, index, shard)
            finally:
                self._window.served(index, shard)
        return NOT_READY

    async def read(self, index: int) -> tuple[Any, int]:
        index = self._check(index)
        shard = self._shard(index)
        if self._window is not None:
            try:
                self._fault(index)
                return self._slice(await self._window.fetched(shard), index, shard)
            finally:
                self._window.served(index, shard)
        self._fault(index)
        start, end = int(self._starts[index]), int(self._ends[index])
        url = self.urls[shard]
        storage = self.storage
        # the members are copied out of the range in members(): the range is read without a copy of its own
        if self.coalesce_gap is None or storage.cache is not None or end <= start:
            return await read_buffer(storage, url, start, end - start), index
        ranges = _scope.peek(("coalesce", self)) or await _scope.get(("coalesce", self), coalesce.Ranges,
                                                                      coalesce.Ranges.close)
        fetch = lambda offset, length: read_buffer(storage, url, offset, length)  # noqa: E731
        most = min(coalesce.MOST, storage.max_bytes)
        return await coalesce.read(ranges, url, start, end, self.coalesce_gap, most, fetch), index

    def _slice(self, data, index: int, shard: int) -> tuple[Any, int]:
        start, end = int(self._starts[index]), int(self._ends[index])
        if isinstance(data, Staged):  # window_dir: the worker reads the sample from the staged copy
            return _LocalRange(data.path, start, end - start, staged=True), index
        # where the sample lies in the shard's shared memory: the worker reads it there
        return data.range(start, max(0, min(end, len(data)) - start)), index

    def read_blocking(self, index: int) -> tuple[Any, int]:
        """A range read from synchronous code (``dataset[i]``, torch's DataLoader): window
        mode's fetcher needs the loader's loop, so a blocking read asks for the sample alone."""
        index = self._check(index)
        self._fault(index)
        shard = self._shard(index)
        start, end = int(self._starts[index]), int(self._ends[index])
        if locate(self.urls[shard])[0] == "local":
            return _LocalRange(locate(self.urls[shard])[1], start, end - start).read(), index
        url = self.urls[shard]
        return _scope.run_blocking(lambda: self.storage.read_range(url, start, end - start)), index

    # -- decode (in a worker) -----------------------------------------------------------------------
    def members(self, raw: tuple[Any, int]) -> dict[str, Any]:
        """What a read returned, as the sample dict: ``{"__key__", "__url__", ext: bytes}``."""
        data, index = raw
        shard = self._shard(index)
        url, key = self.urls[shard], self._keys[index]
        start, end = int(self._starts[index]), int(self._ends[index])
        if isinstance(data, (SharedRange, BufferPart)):
            data = data.view()
        elif isinstance(data, _LocalRange):
            data = data.read()
            if data is None:  # a staged copy deleted before this worker got to it: ask the shard
                data = _scope.run_blocking(lambda: self.storage.read_range(url, start, end - start))
        if len(data) < end - start:
            raise ShardError(f"shard {url}, sample {key!r}: {len(data)} of the sample's {end - start} bytes "
                             f"(from byte {start}) came back: the shard is shorter than when it was indexed "
                             f"(truncated, or written again); index it again: `aioload index {url}`")
        again = f"index it again: `aioload index {url}`"
        sample: dict[str, Any] = {"__key__": key, "__url__": redact(url)}  # a URL's credentials are not data
        view = memoryview(data)
        last = start  # where the last member's data ends: the range's end, if the index is this shard's
        try:
            for member in tar.members_of(view, start):
                if member.end > end:
                    raise ShardError(f"shard {url}, sample {key!r}: member {member.name!r} ends at byte {member.end}, "
                                     f"past the sample's range in the index (bytes {start} to {end}): the shard was "
                                     f"written again since it was indexed, or its index is damaged; {again}")
                last = member.end
                parts = tar.split_name(member.name) if member.regular else None
                if parts is None:
                    continue
                if parts[0] != key:
                    raise ShardError(f"shard {url}, sample {key!r}: at byte {member.start} the shard holds "
                                     f"{member.name!r}, not a member of this sample: it was written again since "
                                     f"it was indexed; {again}")
                sample[parts[1]] = bytes(view[member.offset - start:member.end - start])
        except tar.TarError as exc:
            raise ShardError(f"shard {url}, sample {key!r}: {exc}; the shard is corrupt, or was written again since "
                             f"it was indexed ({again})") from None
        if last != end:
            raise ShardError(f"shard {url}, sample {key!r}: its members end at byte {last}, its range in the index at "
                             f"byte {end}: the shard was written again since it was indexed, or its index is "
                             f"damaged; {again}")
        return sample

    def decode(self, raw: tuple[Any, int]) -> Any:
        sample = self.members(raw)
        if self._decode_fn is not None:
            return self._decode_fn(sample)
        if self.check_members:
            self._check_members(sample)
        return decode_sample(sample, self._decoders if self._decoders is not None else type(self).decoders)

    def _check_members(self, sample: dict[str, Any]) -> None:
        """Raise :class:`ShardError` for a sample whose members are not the usual ones: the
        default collate would fail its whole batch without naming it (or drop a member)."""
        if self._members is None:
            return
        usual, count = self._members
        have = sorted(ext for ext in sample if not (ext.startswith("__") and ext.endswith("__")))
        if have == usual:
            return
        missing = [ext for ext in usual if ext not in have]
        extra = [ext for ext in have if ext not in usual]
        what = "; ".join(part for part in (f"it lacks {', '.join(map(repr, missing))}" if missing else "",
                                           f"it has {', '.join(map(repr, extra))} besides" if extra else "") if part)
        raise ShardError(f"shard {sample['__url__']}, sample {sample['__key__']!r} has the members "
                         f"{', '.join(map(repr, have)) or 'none'} where {count} of the dataset's {len(self)} samples "
                         f"have {', '.join(map(repr, usual))} ({what}): a batch holding it cannot be collated by "
                         "default; pass on_error='skip' to the DataLoader to leave such samples out, give "
                         "WebDataset a decode= that makes them alike, or check_members=False for a collate_fn that "
                         "joins them")

    # -- statistics -----------------------------------------------------------------------------
    def io_figures(self) -> dict[str, Any]:
        """This dataset's own I/O figures for ``loader.stats()`` (see ``docs/stats.md``)."""
        if self._window is None:
            return {"shard_mode": "uniform", "shard_range_ignored": self._range_ignored}
        return {"shard_mode": "window", **self._window.figures()}

    def __repr__(self) -> str:
        mode = "uniform" if self.window is None else f"window={self.window}"
        return f"WebDataset({len(self.urls)} shards, {len(self)} samples, {mode})"


def decode_sample(sample: Mapping[str, Any], decoders: Mapping[str, Decoder] | None = None) -> dict[str, Any]:
    """``sample`` (``{"__key__": ..., "jpg": bytes, "cls": bytes, ...}``, as a WebDataset
    shard holds it) with each member decoded by its extension: images to uint8 ``(3, H, W)``
    tensors, ``cls``/``idx``/... to ``int``, ``txt`` to ``str``, ``json`` to its value,
    ``npy`` and ``pth`` to tensors; members without a decoder stay ``bytes``. ``decoders``
    (by extension) replaces the defaults of :attr:`aioload.WebDataset.decoders`.

    A member that does not decode raises :class:`aioload.ShardError` naming the member and
    its shard."""
    table = WebDataset.decoders if decoders is None else decoders
    out: dict[str, Any] = {}
    for ext, value in sample.items():
        fn = None if ext.startswith("__") else decoder_for(ext, table)
        if fn is None:
            out[ext] = value
            continue
        try:
            out[ext] = fn(value)
        except Exception as exc:
            where = f"member {sample.get('__key__', '?')}.{ext} of shard {sample.get('__url__', '?')}"
            raise ShardError(f"{where} does not decode as {ext!r} ({type(exc).__name__}: {exc}); the shard may be "
                             "corrupt, or give decoders={...} a function for this extension") from exc
    return out
