"""Reading the bytes a clip needs: a local path, a byte range of a remote MP4, or a whole file.

Which, and why:

* **A local file** is not read here at all: the worker's decoder opens the path and FFmpeg
  reads the header and the packets it decodes, seeking past the rest (:class:`LocalVideo`).
* **A remote MP4/MOV** (``http(s)://``, any fsspec URL) whose clip frames are known when it
  is read (``clips="uniform"`` or ``"all"``) is read by range through the dataset's
  :class:`aioload.Storage`: once per file and process, the top-level boxes and the ``moov``
  box (:func:`probe_remote`: one 64 KiB read, plus one or two for a ``moov`` at the end of
  the file); then, per clip, the one range from the keyframe before the clip to its end
  (:meth:`~aioload._media.probe.TrackIndex.span`). The decoder reads that through
  :class:`Sparse`, a file object holding the pieces read, in which every other byte is zero
  and never decoded. A clip then costs its group of pictures, not the file.
* **A remote MP4 sampled at random** (``clips="random"``) is read whole when it is small:
  the clip is drawn in ``decode``, seeded per sample, so the read cannot know which bytes it
  will need. Its first read is the 64 KiB head (the whole of a smaller file); a larger one is
  probed, and read whole up to the dataset's ``whole_file_bytes``; beyond that, ``decode``
  draws the clip and then reads its range itself, one blocking round trip (:class:`Deferred`),
  so memory stays bounded whatever the files' sizes.
* **Everything else** is read whole, through the same storage, bounded by its ``max_bytes``
  (1 GiB unless set): containers without an index read here (WebM/Matroska, AVI, MPEG-TS,
  fragmented MP4), ``seek_mode="exact"`` (its scan reads every packet), and audio
  (compressed audio has no byte index of sample positions, and audio files are small).
"""

from __future__ import annotations

import asyncio
import collections
import io
import os
from dataclasses import dataclass

import numpy as np

from aioload._media import decoders as _decoders
from aioload._media.probe import HEAD_BYTES, MAX_INDEX_BYTES, NotIndexed, TrackIndex, VideoInfo, box_at, video_tracks

PROBES_KEPT_BYTES = 64 * 1024 * 1024
"""The ``moov`` bytes of remote files kept per process (each file's index is probed once)."""

MAX_TOP_BOXES = 64


class LocalVideo:
    """The raw item of a local file: its path, opened by the worker's decoder."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (LocalVideo, (self.path,))

    def __repr__(self) -> str:
        return f"LocalVideo({self.path!r})"


class Deferred:
    """The raw item of a remote MP4 too large to read whole for a random clip: ``decode``
    draws the clip, then reads its range (a blocking round trip, in the worker)."""

    __slots__ = ("url",)

    def __init__(self, url: str):
        self.url = url

    def __reduce__(self):
        return (Deferred, (self.url,))

    def __repr__(self) -> str:
        return f"Deferred({self.url!r})"


class Sparse(io.RawIOBase):
    """A file of ``size`` bytes of which only ``pieces`` (``(offset, bytes)``) were read;
    reading anywhere else gives zeros."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]):
        super().__init__()
        self.size = size
        self.pieces = sorted(pieces)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        start = self.pos
        stop = self.size if n is None or n < 0 else min(self.size, start + n)
        if stop <= start:
            return b""
        out = bytearray(stop - start)
        for offset, data in self.pieces:
            lo, hi = max(start, offset), min(stop, offset + len(data))
            if lo < hi:
                out[lo - start:hi - start] = data[lo - offset:hi - offset]
        self.pos = stop
        return bytes(out)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    @property
    def nbytes(self) -> int:
        """The bytes actually held (what was read)."""
        return sum(len(d) for _, d in self.pieces)


@dataclass
class RemoteIndex:
    """What a remote MP4's probe found: its size, the header pieces every decoder over it
    needs (the boxes before the media data, the ``moov``), its video track's index and info."""

    size: int
    pieces: list[tuple[int, bytes]]
    track: TrackIndex
    info: VideoInfo

    @property
    def nbytes(self) -> int:
        return sum(len(d) for _, d in self.pieces)

    def with_range(self, offset: int, data: bytes) -> Sparse:
        return Sparse(self.size, [*self.pieces, (offset, data)])


def info_of(decoder) -> VideoInfo:
    meta = decoder.metadata
    fps = float(meta.average_fps or 0.0)
    return VideoInfo(int(meta.num_frames or 0), fps, int(meta.width or 0), int(meta.height or 0), str(meta.codec))


async def probe_remote(storage, url: str, head: bytes | None = None) -> RemoteIndex | None:
    """The index of the remote MP4 at ``url``, from its top-level boxes and its ``moov``;
    ``None`` when it is no MP4 with one (it is then read whole). ``head``: its first
    :data:`HEAD_BYTES`, where they were read already."""
    if head is None:
        head = await storage.read_range(url, 0, HEAD_BYTES)
    if head[4:8] != b"ftyp":
        return None
    pieces: list[tuple[int, bytes]] = []
    moov: bytes | None = None
    offset, size = 0, None
    buffer, buffer_at = head, 0  # the bytes in hand and their offset in the file
    eof = len(head) if len(head) < HEAD_BYTES else None  # a short read ends at the end of the file
    for _ in range(MAX_TOP_BOXES):
        if eof is not None and offset >= eof:
            size = offset
            break
        pos = offset - buffer_at
        if not 0 <= pos or pos + 16 > len(buffer):
            buffer, buffer_at, pos = await storage.read_range(url, offset, HEAD_BYTES), offset, 0
            if len(buffer) < HEAD_BYTES:
                eof = offset + len(buffer)
        try:
            box = box_at(buffer, pos, buffer_at)
        except NotIndexed:
            return None
        if box is None:  # the end of the file
            size = offset
            break
        if box.size is None:  # the last box runs to the end of the file, whose size is unknown
            return None
        if box.kind == b"mdat":
            pieces.append((offset, buffer[pos:pos + box.header]))
        else:  # the moov, and any other box the demuxer parses: read whole
            if box.size > MAX_INDEX_BYTES:
                return None
            data = buffer[pos:pos + box.size]
            if len(data) < box.size:
                data = await storage.read_range(url, offset, box.size)
            pieces.append((offset, data))
            if box.kind == b"moov":
                moov = data
        offset += box.size
    if moov is None or size is None:
        return None
    try:
        tracks = video_tracks(moov, size)
    except NotIndexed:
        return None
    info = info_of(_decoders.open_video(Sparse(size, pieces), url))
    # the track the decoder plays (its "best" stream): the one with as many samples as it has
    # frames; none such (an edit list that drops frames, say): no range reads for this file
    same = [t for t in tracks if len(t) == info.num_frames]
    if len(same) != 1:
        return None
    return RemoteIndex(size, pieces, same[0], info)


class Probes:
    """Remote files' probes kept in this process: at most :data:`PROBES_KEPT_BYTES` of them,
    least recently used first out; one probe per file even when many reads ask at once. A
    forked copy starts with its parent's; a pickled one (spawned workers) starts empty."""

    def __init__(self, kept_bytes: int = PROBES_KEPT_BYTES):
        self.kept_bytes = kept_bytes
        self._pid = os.getpid()
        self._kept: collections.OrderedDict[str, RemoteIndex | None] = collections.OrderedDict()
        self._held = 0
        self._pending: dict[str, asyncio.Future] = {}

    def _check_process(self) -> None:
        # A forked worker keeps the probes made before the fork (plain data: the probes of
        # clips="all" at construction serve every worker); probes under way belong to the
        # parent's loop.
        if self._pid != os.getpid():
            self._pending, self._pid = {}, os.getpid()

    def known(self, url: str) -> bool:
        """Whether ``url`` was probed in this process (and is still kept)."""
        self._check_process()
        return url in self._kept

    def kept(self, url: str) -> RemoteIndex | None:
        """``url``'s probe if this process holds it, else ``None`` (no I/O)."""
        self._check_process()
        return self._kept.get(url)

    async def get(self, storage, url: str, head: bytes | None = None) -> RemoteIndex | None:
        self._check_process()
        if url in self._kept:
            self._kept.move_to_end(url)
            return self._kept[url]
        pending = self._pending.get(url)
        if pending is not None and pending.get_loop() is asyncio.get_running_loop():
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not pending.cancelled() or (task is not None and task.cancelling()):
                    raise
                return await self.get(storage, url, head)  # the read probing it was cancelled, not this one
        future = asyncio.get_running_loop().create_future()
        self._pending[url] = future
        try:
            probe = await probe_remote(storage, url, head)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a probe nobody else awaited is not reported twice
            raise
        finally:
            self._pending.pop(url, None)
        future.set_result(probe)
        self._keep(url, probe)
        return probe

    def _keep(self, url: str, probe: RemoteIndex | None) -> None:
        self._kept[url] = probe
        self._held += probe.nbytes if probe is not None else 0
        while self._held > self.kept_bytes and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._held -= old.nbytes if old is not None else 0

    def __getstate__(self) -> dict:
        return {"kept_bytes": self.kept_bytes}  # a copy starts empty (a worker probes for itself)

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["kept_bytes"])


async def read_range_of(storage, url: str, probe: RemoteIndex, frames: list[int]) -> Sparse:
    """The pieces a decoder needs for ``frames`` of the remote file ``probe`` describes."""
    start, end = probe.track.span(frames)
    data = await storage.read_range(url, start, end - start)
    return probe.with_range(start, data)


def labels_of(labels, count: int) -> np.ndarray | None:
    """``labels`` (one class index per file of a dataset of ``count`` files) checked, as an array."""
    if labels is None:
        return None
    targets = np.asarray(labels)
    if targets.ndim != 1 or len(targets) != count:
        raise ValueError(f"labels must hold one label per path: got {targets.shape} labels for {count} paths")
    if targets.dtype.kind not in "biuf":
        raise TypeError(f"labels must be numbers (class indices), got dtype {targets.dtype}")
    return targets
