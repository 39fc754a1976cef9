"""What a video holds, and where its frames lie in the file: from the container's own index.

Two things are probed, each once per file and process:

* :class:`VideoInfo` (frames, frames per second, size, codec): what the clip policies need.
  It comes from torchcodec's metadata of the file's header (``seek_mode="approximate"``: the
  header only, no scan of the packets), so that frame ``i`` here is frame ``i`` to the decoder.
* :class:`TrackIndex`, for MP4/MOV (ISO base media) files only: the byte offset, size,
  keyframe flag and presentation time of every video sample, parsed here from the ``moov``
  box's sample tables (``stsz``, ``stco``/``co64``, ``stsc``, ``stss``, ``stts``, ``ctts``).
  :meth:`TrackIndex.span` turns the frames of a clip into the one byte range that decoding
  them reads, so a remote file is read by range instead of whole (:mod:`aioload._media.source`).

Other containers (WebM/Matroska, AVI, MPEG-TS) have no index this module reads, and fragmented
MP4 keeps its tables in ``moof`` boxes spread through the file; those are read whole.
Everything here is pure parsing of bytes already in hand: no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEAD_BYTES = 64 * 1024
"""The first read of a remote MP4: its top-level boxes (and, in a "fast start" file, the whole
``moov``) are usually in it."""

MAX_INDEX_BYTES = 64 * 1024 * 1024
"""The largest ``moov`` box read for an index (an hour of 30 fps video takes about 2 MB)."""

MAX_SAMPLES = MAX_INDEX_BYTES // 4
"""The most samples a video track indexed here may have: as many as a ``moov`` of
:data:`MAX_INDEX_BYTES` can list the sizes of (155 hours at 30 fps). Every count in the sample
tables is bounded before anything is allocated: a table's entries by its own box's bytes, the
samples by the size table's box (or, where every sample has one size, by the bytes of the file
they must fit in), and the runs that the tables repeat by the samples."""

_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf"}


@dataclass(frozen=True)
class VideoInfo:
    """A video stream as its container's header describes it."""

    num_frames: int
    fps: float
    width: int
    height: int
    codec: str

    def as_tuple(self) -> tuple[int, float, int, int, str]:
        return (self.num_frames, self.fps, self.width, self.height, self.codec)


class NotIndexed(ValueError):
    """The bytes are no MP4 index this module can use (the file is then read whole)."""


@dataclass(frozen=True)
class Box:
    kind: bytes
    offset: int
    size: int | None  # None: extends to the end of the file
    header: int  # header bytes: 8, or 16 with a 64-bit size


def box_at(data: bytes, pos: int, base: int = 0) -> Box | None:
    """The box whose header starts at ``data[pos:]`` (the file offset is ``base + pos``), or
    ``None`` when fewer than its header's bytes are there."""
    if pos + 8 > len(data):
        return None
    size, kind = struct.unpack_from(">I4s", data, pos)
    header = 8
    if size == 1:
        if pos + 16 > len(data):
            return None
        size = struct.unpack_from(">Q", data, pos + 8)[0]
        header = 16
    if size == 0:
        return Box(kind, base + pos, None, header)
    if size < header:
        raise NotIndexed(f"a box of {size} bytes at offset {base + pos} is shorter than its header")
    return Box(kind, base + pos, size, header)


def children(data: bytes, start: int, end: int):
    """The boxes inside ``data[start:end]``."""
    pos = start
    while pos + 8 <= end:
        box = box_at(data, pos)
        if box is None:
            return
        size = box.size if box.size is not None else end - pos
        yield box.kind, pos + box.header, min(pos + size, end)
        pos += size


def _full(data: bytes, start: int) -> tuple[int, int]:
    """The version and the offset after a full box's version and flags."""
    return data[start], start + 4


def _table(data: bytes, box: tuple[int, int], fields: int, dtype: str = ">u4") -> np.ndarray:
    """A sample table after its version/flags and entry count: ``(entries, fields)`` int64.
    ``box``: the table's body, ``(start, stop)``, which must hold every entry it counts."""
    start, stop = box
    _, pos = _full(data, start)
    if pos + 4 > stop:
        raise NotIndexed(f"a sample table's box of {stop - start} bytes is cut short")
    (count,) = struct.unpack_from(">I", data, pos)
    width = np.dtype(dtype).itemsize * fields
    if count * width > stop - (pos + 4):
        raise NotIndexed(f"a sample table counts {count} entries, more than its box of {stop - start} bytes holds")
    return np.frombuffer(data, dtype=dtype, count=count * fields, offset=pos + 4).reshape(count, fields).astype(np.int64)


def _runs(values: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """``values[i]`` repeated ``lengths[i]`` times, the first ``total`` of them at most: a run
    length in a table is the file's word, and is cut where the samples end before it counts."""
    lengths = np.maximum(lengths, 0)
    before = np.cumsum(lengths) - lengths
    return np.repeat(values, np.clip(total - before, 0, lengths))


@dataclass
class TrackIndex:
    """A video track's samples, in decoding order, and the order they are shown in."""

    offsets: np.ndarray  # int64 byte offset of each sample
    sizes: np.ndarray  # int64 bytes of each sample
    sync: np.ndarray  # bool: whether each sample is a keyframe
    cts: np.ndarray  # int64 presentation time of each sample (media timescale)
    codec: str

    def __post_init__(self) -> None:
        self.shown = np.argsort(self.cts, kind="stable")  # frame r (presentation order) -> sample
        # how far decoding runs ahead of display: a frame comes out of the decoder a few
        # samples after its own (B-frames), so those samples are read too
        lag = self.shown - np.arange(len(self.shown))
        self.reorder = int(max(0, lag.max())) if len(lag) else 0
        self.keys = np.flatnonzero(self.sync)

    def __len__(self) -> int:
        return len(self.sizes)

    def span(self, frames: list[int], margin: int = 2) -> tuple[int, int]:
        """The byte range ``[start, end)`` that decoding ``frames`` (presentation order) reads:
        from the last keyframe at or before the first of them, to a few samples past the last
        one decoded (the reordering depth, plus ``margin`` frames on either side against an
        edit list that shifts the numbering)."""
        n = len(self)
        lo = min(max(0, min(frames) - margin), n - 1)
        hi = min(n - 1, max(frames) + margin)
        samples = self.shown[lo:hi + 1]
        first, last = int(samples.min()), int(samples.max())
        shown_first = self.cts[self.shown[lo]]
        keys = self.keys[(self.keys <= first) & (self.cts[self.keys] <= shown_first)]
        start = int(keys[-1]) if len(keys) else 0
        stop = min(n - 1, last + self.reorder + margin)
        chosen = slice(start, stop + 1)
        return int(self.offsets[chosen].min()), int((self.offsets[chosen] + self.sizes[chosen]).max())


def _track(data: bytes, start: int, end: int, file_size: int) -> TrackIndex | None:
    """The index of a ``trak`` box if it is a video track, else ``None``."""
    found: dict[bytes, tuple[int, int]] = {}  # each table's body: (start, stop)
    handler = None

    def walk(lo: int, hi: int) -> None:
        nonlocal handler
        for kind, body, stop in children(data, lo, hi):
            if kind in _CONTAINERS:
                walk(body, stop)
            elif kind == b"hdlr":
                handler = data[body + 8:body + 12]
            elif kind in (b"stsd", b"stts", b"ctts", b"stss", b"stsz", b"stz2", b"stsc", b"stco", b"co64"):
                found[kind] = (body, stop)

    walk(start, end)
    if handler != b"vide":
        return None
    if b"stz2" in found and b"stsz" not in found:
        raise NotIndexed("compact sample sizes (stz2) are not read here")
    for need in (b"stsz", b"stsc", b"stts", b"stsd"):
        if need not in found:
            raise NotIndexed(f"the video track has no {need.decode()} table")
    if b"stco" not in found and b"co64" not in found:
        raise NotIndexed("the video track has no chunk offsets (stco/co64)")
    # sizes
    body, stop = found[b"stsz"]
    _, pos = _full(data, body)
    if pos + 8 > stop:
        raise NotIndexed(f"the sample size table's box of {stop - body} bytes is cut short")
    uniform, count = struct.unpack_from(">II", data, pos)
    if count == 0:
        raise NotIndexed("the video track's sample tables are empty (a fragmented MP4)")
    if count > MAX_SAMPLES:
        raise NotIndexed(f"the video track counts {count} samples, more than {MAX_SAMPLES} indexed here")
    if uniform:
        if count * uniform > file_size:
            raise NotIndexed(f"the video track's {count} samples of {uniform} bytes do not fit in the file's "
                             f"{file_size} bytes")
        sizes = np.full(count, uniform, dtype=np.int64)
    else:
        if pos + 8 + 4 * count > stop:
            raise NotIndexed("the sample size table runs past the end of its box")
        sizes = np.frombuffer(data, ">u4", count, pos + 8).astype(np.int64)
    # chunk offsets and the samples in each chunk
    if b"co64" in found:
        chunk_offsets = _table(data, found[b"co64"], 1, ">u8")[:, 0]
    else:
        chunk_offsets = _table(data, found[b"stco"], 1)[:, 0]
    stsc = _table(data, found[b"stsc"], 3)
    chunks = len(chunk_offsets)
    if len(stsc) == 0 or chunks == 0:
        raise NotIndexed("the video track has no chunks")
    firsts = np.clip(stsc[:, 0] - 1, 0, chunks)
    lasts = np.clip(np.append(firsts[1:], chunks), 0, chunks)
    per_chunk = _runs(stsc[:, 1], lasts - firsts, chunks)
    chunk_of = _runs(np.arange(len(per_chunk)), per_chunk, count)
    if len(chunk_of) < count:
        raise NotIndexed("the chunk tables hold fewer samples than the size table")
    ends = np.cumsum(sizes)
    chunk_first = np.concatenate([[0], np.cumsum(per_chunk)])[chunk_of]
    before = ends - sizes - np.concatenate([[0], ends])[chunk_first]
    offsets = chunk_offsets[chunk_of] + before
    # timing
    stts = _table(data, found[b"stts"], 2)
    deltas = _runs(stts[:, 1], stts[:, 0], count)
    if len(deltas) < count:
        deltas = np.concatenate([deltas, np.full(count - len(deltas), deltas[-1] if len(deltas) else 1)])
    dts = np.concatenate([[0], np.cumsum(deltas)[:-1]])
    cts = dts
    if b"ctts" in found:
        ctts = _table(data, found[b"ctts"], 2, ">i4")
        shifts = _runs(ctts[:, 1], ctts[:, 0], count)
        if len(shifts) == count:
            cts = dts + shifts
    if b"stss" in found:
        sync = np.zeros(count, dtype=bool)
        numbers = _table(data, found[b"stss"], 1)[:, 0] - 1
        sync[numbers[(numbers >= 0) & (numbers < count)]] = True
        if not sync.any():
            sync[0] = True
    else:
        sync = np.ones(count, dtype=bool)
    entry = found[b"stsd"][0] + 8  # version/flags, entry count, then the first entry's size
    codec = data[entry + 4:entry + 8].decode("latin-1", "replace") if entry + 8 <= found[b"stsd"][1] else "?"
    return TrackIndex(offsets, sizes, sync, cts, codec)


def video_tracks(moov: bytes, file_size: int) -> list[TrackIndex]:
    """The indexes of the video tracks in a ``moov`` box (the box itself, header included) of
    a file of ``file_size`` bytes. What is no index this module can use (a table cut short or
    counting more than its box holds, say) raises :class:`NotIndexed`."""
    box = box_at(moov, 0)
    if box is None or box.kind != b"moov":
        raise NotIndexed("no moov box")
    try:
        tracks = [_track(moov, body, stop, file_size)
                  for kind, body, stop in children(moov, box.header, len(moov)) if kind == b"trak"]
    except struct.error as exc:  # a box cut short before its fields
        raise NotIndexed(f"a box of the moov is cut short ({exc})") from None
    found = [t for t in tracks if t is not None]
    if not found:
        raise NotIndexed("the file has no video track")
    return found
