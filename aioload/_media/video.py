"""``VideoFolder`` and ``VideoFiles``: clips of videos, read on the event loop, decoded in the workers.

A sample is ``(frames, label)``: ``frames`` a uint8 ``[T, C, H, W]`` tensor of one clip
(:mod:`aioload._media.clips` says which frames), after ``transform``, which sees the whole clip
at once, so a ``torchvision.transforms.v2`` pipeline applies the same random crop and flip to
every frame. Samples per video: ``clips_per_video`` (``"random"``, ``"uniform"``), or every
clip (``"all"``, which probes each video's frame count once, at construction).

The split protocol (:class:`aioload.Dataset`): ``read`` hands over what a clip needs
(:mod:`aioload._media.source`: a local path, a byte range of a remote MP4, or a whole file);
``decode`` draws the clip where it is random, decodes it with torchcodec
(:mod:`aioload._media.decoders`) and transforms it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from aioload._data.dataset import NOT_READY, Dataset
from aioload._media import clips as _clips
from aioload._media import decoders as _decoders
from aioload._media import source as _source
from aioload._media.frombytes import clip_from
from aioload._media.probe import VideoInfo
from aioload._storage import scope as _scope
from aioload._storage.storage import Storage, locate

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv", ".ogv", ".wmv")

PROBES_AT_ONCE = 32
"""Remote files probed at once at construction (``clips="all"``)."""

SEEK_MODES = ("approximate", "exact")

WHOLE_FILE_BYTES = 32 * 1024 * 1024
"""Remote MP4s up to this size are read whole for ``clips="random"``; larger ones are read by
range in ``decode`` (see :mod:`aioload._media.source`)."""


class ClipRaw(NamedTuple):
    """What ``read`` hands ``decode``: the bytes' source, where they come from (for errors),
    the label, the clip's number within its video, and its frames when the read already chose
    them (a range read)."""

    source: Any  # LocalVideo, Sparse, Deferred or bytes
    where: str
    target: Any
    clip: int
    frames: list[int] | None = None


class _Videos(Dataset):
    """What the video datasets share: locations and labels in numpy arrays, the clip policy,
    reads through a :class:`aioload.Storage`, decoding with torchcodec."""

    def _setup(self, locations: Sequence[str], targets, frames_per_clip, clips, clips_per_video, frame_step,
               frame_rate, step_between_clips, transform, target_transform, storage, seek_mode, metadata,
               whole_file_bytes) -> None:
        _decoders.torchcodec_decoders()  # fail here, not in a worker, when torchcodec or FFmpeg is missing
        self.spec = _clips.ClipSpec(frames_per_clip, clips, clips_per_video, frame_step, frame_rate,
                                    step_between_clips)
        if seek_mode not in SEEK_MODES:
            raise ValueError(f"seek_mode must be 'approximate' or 'exact', got {seek_mode!r}")
        self.seek_mode = seek_mode
        if isinstance(whole_file_bytes, bool) or not isinstance(whole_file_bytes, int) or whole_file_bytes < 0:
            raise ValueError(f"whole_file_bytes must be an int >= 0 (bytes), got {whole_file_bytes!r}")
        self.whole_file_bytes = whole_file_bytes
        self.transform = transform
        self.target_transform = target_transform
        if storage is not None and not isinstance(storage, Storage):
            raise TypeError(f"storage must be an aioload.Storage, got {type(storage).__name__}")
        self.storage = storage if storage is not None else Storage()
        self._paths = np.array([os.fsencode(p) for p in locations], dtype=np.bytes_)
        self._local = np.array([locate(p)[0] == "local" for p in locations], dtype=bool)
        self._targets = targets
        self._probes = _source.Probes()
        self._info: np.ndarray | None = None  # (num_frames, fps) per video, once probed
        if metadata is not None:
            self._info = _checked_metadata(metadata, len(locations))
        elif not self.spec.per_video_fixed:
            self._info = self._probe_all()
        self._ends: np.ndarray | None = None
        if self._info is not None and not self.spec.per_video_fixed:
            counts = [_clips.clips_in(int(n), float(f), self.spec) for n, f in self._info]
            self._ends = np.cumsum(np.array(counts, dtype=np.int64))

    # -- what the dataset holds ---------------------------------------------------------
    def __len__(self) -> int:
        if self._ends is None:
            return len(self._paths) * self.spec.clips_per_video
        return int(self._ends[-1]) if len(self._ends) else 0

    def path(self, video: int) -> str:
        """The local path or URL of video ``video`` (not a sample index: see :meth:`clip_of`)."""
        return os.fsdecode(self._paths[video])

    def clip_of(self, index: int) -> tuple[int, int]:
        """``(video, clip)``: which video sample ``index`` comes from, and its clip's number there."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a dataset of {n} clips")
        index %= n
        if self._ends is None:
            return divmod(index, self.spec.clips_per_video)
        video = int(np.searchsorted(self._ends, index, side="right"))
        first = int(self._ends[video - 1]) if video else 0
        return video, index - first

    def describe(self, index: int) -> str:
        video, clip = self.clip_of(index)
        return self.path(video) if self.spec.clips == "random" else f"{self.path(video)}, clip {clip}"

    @property
    def metadata(self) -> list[tuple[int, float]] | None:
        """``(num_frames, fps)`` of every video, once probed (``clips="all"``, or ``metadata=``
        given): pass it back as ``metadata=`` to skip the probe (it is plain data: JSON takes it)."""
        if self._info is None:
            return None
        return [(int(n), float(f)) for n, f in self._info]

    def _sample_targets(self) -> list | None:
        if self._targets is None:
            return None
        if self._ends is None:
            return np.repeat(self._targets, self.spec.clips_per_video).tolist()
        return np.repeat(self._targets, np.diff(np.concatenate([[0], self._ends]))).tolist()

    def _target(self, video: int):
        return None if self._targets is None else self._targets[video].item()

    # -- reading ------------------------------------------------------------------------
    def read_nowait(self, index: int) -> ClipRaw | Any:
        if type(self).read is not _Videos.read:
            return NOT_READY
        video, clip = self.clip_of(index)
        if not self._local[video]:
            return NOT_READY
        return self._local_raw(video, clip)

    def _local_raw(self, video: int, clip: int) -> ClipRaw:
        where = self.path(video)
        return ClipRaw(_source.LocalVideo(locate(where)[1]), where, self._target(video), clip,
                       self._known_frames(video, clip, where))

    def _known_frames(self, video: int, clip: int, where: str) -> list[int] | None:
        """The clip's frames where they follow from the probed metadata (``"uniform"`` and
        ``"all"`` with ``metadata``), so the decoder's own header does not override it."""
        if self._info is None or self.spec.clips == "random":
            return None
        return _clips.clip_frames(int(self._info[video, 0]), float(self._info[video, 1]), self.spec, clip, where)

    async def read(self, index: int) -> ClipRaw:
        video, clip = self.clip_of(index)
        where, target = self.path(video), self._target(video)
        if self._local[video]:
            return self._local_raw(video, clip)
        if self.spec.clips == "random" and self.seek_mode == "approximate":
            head = None
            if not self._probes.known(where):
                head = await self.storage.read_range(where, 0, _source.HEAD_BYTES)
                if len(head) < _source.HEAD_BYTES:  # that was the whole file
                    return ClipRaw(head, where, target, clip)
            probe = await self._probes.get(self.storage, where, head)
            if probe is not None and probe.size > self.whole_file_bytes:
                return ClipRaw(_source.Deferred(where), where, target, clip)
        elif self.seek_mode == "approximate":
            probe = await self._probes.get(self.storage, where)
            if probe is not None:
                frames = self._known_frames(video, clip, where)
                if frames is None:
                    frames = _clips.clip_frames(probe.info.num_frames, probe.info.fps, self.spec, clip, where)
                sparse = await _source.read_range_of(self.storage, where, probe, frames)
                return ClipRaw(sparse, where, target, clip, frames)
        return ClipRaw(await self.storage.read_bytes(where), where, target, clip, self._known_frames(video, clip, where))

    def read_blocking(self, index: int) -> ClipRaw:
        raw = self.read_nowait(index)
        if raw is not NOT_READY:
            return raw
        return _scope.run_blocking(lambda: self.read(index))

    # -- decoding -----------------------------------------------------------------------
    def decode(self, raw: ClipRaw) -> Any:
        source, where, target, clip, frames = raw
        if isinstance(source, _source.LocalVideo):
            decoder = _decoders.LOCAL.video(source.path, where, self.seek_mode)
        elif isinstance(source, _source.Deferred):
            decoder, frames = self._read_in_decode(source.url, clip)
        else:
            decoder = _decoders.open_video(source, where, self.seek_mode)
        try:
            video = clip_from(decoder, self.spec, clip, where, frames)
        except _decoders.MediaError:
            if isinstance(source, _source.LocalVideo):
                _decoders.LOCAL.forget(source.path)
            raise
        if self.transform is not None:
            video = self.transform(video)
        if self._targets is None:
            return video
        if self.target_transform is not None:
            target = self.target_transform(target)
        return video, target

    def _read_in_decode(self, url: str, clip: int):
        """A random clip of a remote MP4 too large to read whole: drawn here, then its range
        read (blocking: one round trip, on a loop of this thread's own)."""
        probe = self._probes.kept(url)
        if probe is None:
            probe = _scope.run_blocking(lambda: self._probes.get(self.storage, url))
        if probe is None:  # the probe was dropped, and the file is no longer an MP4 it can index
            raise _decoders.MediaError(f"{url} could not be indexed again for a range read: it changed since it was "
                                       "first read; re-create the dataset, or pass on_error='skip'")
        frames = _clips.clip_frames(probe.info.num_frames, probe.info.fps, self.spec, clip, url)
        sparse = _scope.run_blocking(lambda: _source.read_range_of(self.storage, url, probe, frames))
        return _decoders.open_video(sparse, url, self.seek_mode), frames

    # -- probing ------------------------------------------------------------------------
    def _probe_all(self) -> np.ndarray:
        """``(num_frames, fps)`` of every video: local files through a decoder's header (one
        open each), remote ones through :func:`aioload._media.source.probe_remote`, many at
        once (or, for a container without an index, one whole read each)."""
        out = np.zeros((len(self._paths), 2), dtype=np.float64)
        remote = []
        for video in range(len(self._paths)):
            if self._local[video]:
                path = locate(self.path(video))[1]
                out[video] = _source.info_of(_decoders.open_video(path, path, self.seek_mode)).as_tuple()[:2]
            else:
                remote.append(video)
        if remote:
            for video, info in zip(remote, _scope.run_blocking(lambda: self._probe_remote(remote))):
                out[video] = info.as_tuple()[:2]
        return out

    async def _probe_remote(self, videos: list[int]) -> list[VideoInfo]:
        limit = asyncio.Semaphore(PROBES_AT_ONCE)

        async def one(video: int) -> VideoInfo:
            where = self.path(video)
            async with limit:
                probe = await self._probes.get(self.storage, where) if self.seek_mode == "approximate" else None
                if probe is not None:
                    return probe.info
                data = await self.storage.read_bytes(where)
            return _source.info_of(_decoders.open_video(data, where, self.seek_mode))

        return list(await asyncio.gather(*(one(v) for v in videos)))


def _checked_metadata(metadata, videos: int) -> np.ndarray:
    try:
        info = np.asarray(metadata, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError("metadata must be what dataset.metadata returned: one (num_frames, fps) pair per video") from exc
    if info.shape != (videos, 2):
        raise ValueError(f"metadata must hold one (num_frames, fps) pair per video: got shape {info.shape} "
                         f"for {videos} videos")
    if not np.isfinite(info).all() or (info < 0).any():
        raise ValueError("metadata must hold frame counts and frame rates >= 0")
    return info


class VideoFiles(_Videos):
    """Clips of the videos at a list of local paths or URLs (``http(s)://``, ``s3://``, any fsspec URL).

    A sample is ``(frames, label)`` with ``labels`` (one number per video), or ``frames``
    alone without: a uint8 ``[T, C, H, W]`` tensor of ``frames_per_clip`` frames, every
    ``frame_step``-th, of the video resampled to ``frame_rate`` fps (its own rate when None).

    ``clips``: ``"random"`` (a random clip per video per epoch, ``clips_per_video`` of them;
    drawn in ``decode`` from torch's generator, which ``DataLoader(seed=...)`` seeds per sample,
    so runs reproduce and resume exactly), ``"uniform"`` (``clips_per_video`` evenly spaced
    clips: ``len()`` is videos times clips) or ``"all"`` (every clip, a new one every
    ``step_between_clips`` frames, as torchvision's ``VideoClips``: ``len()`` counts the clips,
    which probes each video's frame count at construction; pass ``metadata=dataset.metadata``
    from an earlier run to skip that).

    ``transform`` gets the whole clip (``torchvision.transforms.v2`` applies one random crop to
    every frame). ``storage=`` (an :class:`aioload.Storage`) sets retries, timeouts, headers,
    a cache and ``max_bytes`` (the largest file read whole) for URLs; ``whole_file_bytes``
    (32 MiB): a remote MP4 larger than this, sampled with ``clips="random"``, is not read whole
    but by range in ``decode``, after the clip is drawn (one blocking round trip per clip), so
    memory stays bounded whatever the files' sizes. ``seek_mode``:
    torchcodec's, ``"approximate"`` (the header's frame count and rate: right for
    constant-frame-rate video, no scan) or ``"exact"`` (each decoder first demuxes the whole
    file; for variable frame rates). See docs/video.md.
    """

    def __init__(self, paths_or_urls: Sequence[str | os.PathLike], labels: Sequence[Any] | None = None, *,
                 frames_per_clip: int, clips: str = "random", clips_per_video: int = 1, frame_step: int = 1,
                 frame_rate: float | None = None, step_between_clips: int = 1, transform: Callable | None = None,
                 target_transform: Callable | None = None, storage: Storage | None = None,
                 seek_mode: str = "approximate", metadata: Sequence[tuple[int, float]] | None = None,
                 whole_file_bytes: int = WHOLE_FILE_BYTES):
        if isinstance(paths_or_urls, (str, bytes, os.PathLike)):
            raise TypeError("paths_or_urls must be a sequence of paths or URLs, not a single one: "
                            "wrap it in a list, or use aioload.VideoFolder for a folder")
        locations = [os.fspath(p) for p in paths_or_urls]
        self._setup(locations, _source.labels_of(labels, len(locations)), frames_per_clip, clips, clips_per_video, frame_step,
                    frame_rate, step_between_clips, transform, target_transform, storage, seek_mode, metadata,
                    whole_file_bytes)

    @property
    def targets(self) -> list | None:
        """The label of every sample (clip), in order; None without labels."""
        return self._sample_targets()

    def __repr__(self) -> str:
        return (f"VideoFiles(videos={len(self._paths)}, clips={self.spec.clips!r}, samples={len(self)}, "
                f"frames_per_clip={self.spec.frames_per_clip})")


class VideoFolder(_Videos):
    """``torchvision.datasets.ImageFolder``'s layout, for videos: ``root/<class>/<video>``.

    Same ``classes``, ``class_to_idx``, ``samples`` and order as torchvision's folder
    datasets (``extensions``: :data:`VIDEO_EXTENSIONS`). A sample is ``(frames, target)``,
    with the clip arguments of :class:`VideoFiles`. ``root`` may also be an fsspec URL that can
    list (``s3://bucket/videos``; options in ``storage=Storage(storage_options=...)``).
    """

    def __init__(self, root: str | os.PathLike, frames_per_clip: int, clips: str = "random",
                 clips_per_video: int = 1, frame_step: int = 1, transform: Callable | None = None,
                 target_transform: Callable | None = None, *, frame_rate: float | None = None,
                 step_between_clips: int = 1, extensions: tuple[str, ...] | None = VIDEO_EXTENSIONS,
                 is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
                 storage: Storage | None = None, seek_mode: str = "approximate",
                 metadata: Sequence[tuple[int, float]] | None = None, whole_file_bytes: int = WHOLE_FILE_BYTES):
        from aioload.images import class_folder

        self.root = os.fspath(root)
        if is_valid_file is not None:
            extensions = None
        self.classes, self.class_to_idx, samples = class_folder(self.root, storage, extensions, is_valid_file,
                                                                allow_empty, "VideoFolder", "aioload.VideoFiles")
        self.extensions = extensions
        targets = np.array([t for _, t in samples], dtype=np.int64)
        self._setup([p for p, _ in samples], targets, frames_per_clip, clips, clips_per_video, frame_step,
                    frame_rate, step_between_clips, transform, target_transform, storage, seek_mode, metadata,
                    whole_file_bytes)

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, class index)`` of every video (not of every clip)."""
        return [(os.fsdecode(p), int(t)) for p, t in zip(self._paths, self._targets)]

    @property
    def targets(self) -> list[int]:
        """The class index of every sample (clip), in order."""
        return self._sample_targets() or []

    def __repr__(self) -> str:
        return (f"VideoFolder(root={self.root!r}, videos={len(self._paths)}, classes={len(self.classes)}, "
                f"clips={self.spec.clips!r}, samples={len(self)})")

