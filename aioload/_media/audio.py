"""``AudioFiles``: fixed-length crops of sound files, resampled, decoded in the workers.

A sample is ``(waveform, label)``: ``waveform`` float32 ``[channels, samples]`` in ``[-1, 1]``,
``samples = round(seconds * sample_rate)`` whatever the file, resampled by FFmpeg to
``sample_rate`` and mixed down to one channel with ``mono=True``. Crops are placed like
video clips (:mod:`aioload._media.clips`): ``"random"`` (drawn in ``decode``, seeded per
sample) or ``"uniform"`` (``crops_per_file`` evenly spaced). A file shorter than ``seconds``
gives all of itself followed by zeros.

Reads: a local file is opened by the worker's decoder; a remote one is read whole through the
dataset's :class:`aioload.Storage` (compressed audio has no byte index of its samples, and a
few minutes of it is a few MB; see docs/video.md).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, Dataset
from aioload._media import clips as _clips
from aioload._media import decoders as _decoders
from aioload._media.source import labels_of
from aioload._storage import scope as _scope
from aioload._storage.storage import Storage, locate

CROPS = ("random", "uniform")


class LocalAudio(NamedTuple):
    path: str


class AudioRaw(NamedTuple):
    source: Any  # LocalAudio or bytes
    where: str
    target: Any
    crop: int


def check_audio(sample_rate, seconds, mono, crops, crops_per_file) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate must be an int >= 1 (samples per second), got {sample_rate!r}")
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
            or seconds <= 0):
        raise ValueError(f"seconds must be a number > 0 (the length of every crop), got {seconds!r}")
    if not isinstance(mono, bool):
        raise TypeError(f"mono must be True or False, got {mono!r}")
    if crops not in CROPS:
        raise ValueError(f"crops must be 'random' or 'uniform', got {crops!r}")
    _clips.positive_int("crops_per_file", crops_per_file)


def crop(opener: Callable, where: str, sample_rate: int, length: int, crops: str, k: int, count: int) -> torch.Tensor:
    """Crop ``k`` of ``count`` (or a random one) of ``length`` samples, float32 ``[C, length]``.

    Crops are placed over the samples the header's duration promises; one that would run past
    the sound's real end (the header can overstate it by a frame) ends at that end instead.
    ``opener()`` opens a decoder (twice in that case: a compressed stream decoded again after
    seeking back does not give the samples a fresh seek gives)."""
    decoder = opener()
    meta = decoder.metadata
    begin = float(meta.begin_stream_seconds or 0.0)
    duration = meta.duration_seconds
    if duration is None:  # no duration in the header: decode it all, then crop
        samples = _samples(lambda: decoder.get_all_samples(), where)
        data, total, first = samples.data, samples.data.shape[1], 0
    else:
        total = max(0, int(math.floor((float(duration) - begin) * sample_rate)))
        data = None
    positions = max(1, total - length + 1)
    if crops == "random":
        first = int(torch.randint(positions, ()).item())
    else:
        first = _clips.uniform_start(positions, k, count)
    if data is None:
        data = _window(decoder, where, begin + first / sample_rate, sample_rate, length)
        if data.shape[1] < length and first > 0:
            # the header's duration overstates the samples (an MP3's padding): the last crop
            # ends where the sound does, rather than in zeros
            back = min(first, length - data.shape[1])
            data = _window(opener(), where, begin + (first - back) / sample_rate, sample_rate, length)
    else:
        data = data[:, first:first + length]
    if data.shape[1] < length:
        data = torch.nn.functional.pad(data, (0, length - data.shape[1]))
    return data.to(torch.float32).contiguous()


def _window(decoder, where: str, start: float, sample_rate: int, length: int) -> torch.Tensor:
    """Up to ``length`` samples from ``start`` (seconds)."""
    samples = _samples(lambda: decoder.get_samples_played_in_range(start, start + length / sample_rate), where)
    shift = max(0, int(round((start - float(samples.pts_seconds)) * sample_rate)))
    return samples.data[:, shift:shift + length]


def _samples(get: Callable, where: str):
    try:
        return get()
    except (RuntimeError, ValueError) as exc:
        raise _decoders.MediaError(f"{where}: its audio could not be decoded ({_decoders.reason(exc)}): the file "
                                   "is corrupt or truncated; re-encode or remove it, or pass on_error='skip' to the "
                                   "DataLoader to skip such files") from exc


class AudioFiles(Dataset):
    """Fixed-length crops of the sound files at a list of local paths or URLs.

    A sample is ``(waveform, label)`` with ``labels`` (one number per file), or ``waveform``
    alone without: float32 ``[channels, samples]``, ``samples = round(seconds * sample_rate)``,
    resampled to ``sample_rate``; ``mono=True`` mixes every file down to one channel (without,
    files must share a channel count to be batched). ``crops``: ``"random"`` (one random crop
    per file per epoch, ``crops_per_file`` of them, drawn from torch's generator, which
    ``DataLoader(seed=...)`` seeds per sample) or ``"uniform"`` (``crops_per_file`` evenly
    spaced crops). A file shorter than a crop is padded with zeros at the end.

    Any format FFmpeg reads (WAV, FLAC, MP3, Ogg, M4A/AAC, the sound of a video). ``transform``
    gets the waveform; ``storage=`` (an :class:`aioload.Storage`) sets retries, timeouts,
    headers, a cache and ``max_bytes`` for URLs.
    """

    def __init__(self, paths_or_urls: Sequence[str | os.PathLike], labels: Sequence[Any] | None = None, *,
                 sample_rate: int, seconds: float, mono: bool = False, crops: str = "random",
                 crops_per_file: int = 1, transform: Callable | None = None,
                 target_transform: Callable | None = None, storage: Storage | None = None):
        if isinstance(paths_or_urls, (str, bytes, os.PathLike)):
            raise TypeError("paths_or_urls must be a sequence of paths or URLs, not a single one: wrap it in a list")
        _decoders.torchcodec_decoders()
        check_audio(sample_rate, seconds, mono, crops, crops_per_file)
        if storage is not None and not isinstance(storage, Storage):
            raise TypeError(f"storage must be an aioload.Storage, got {type(storage).__name__}")
        locations = [os.fspath(p) for p in paths_or_urls]
        self.sample_rate = sample_rate
        self.seconds = seconds
        self.length = int(round(seconds * sample_rate))
        self.mono = mono
        self.crops = crops
        self.crops_per_file = crops_per_file
        self.transform = transform
        self.target_transform = target_transform
        self.storage = storage if storage is not None else Storage()
        self._paths = np.array([os.fsencode(p) for p in locations], dtype=np.bytes_)
        self._local = np.array([locate(p)[0] == "local" for p in locations], dtype=bool)
        self._targets = labels_of(labels, len(locations))

    def __len__(self) -> int:
        return len(self._paths) * self.crops_per_file

    def path(self, file: int) -> str:
        """The local path or URL of file ``file`` (not a sample index: sample ``i`` is crop
        ``i % crops_per_file`` of file ``i // crops_per_file``)."""
        return os.fsdecode(self._paths[file])

    def describe(self, index: int) -> str:
        return self.path(index // self.crops_per_file)

    @property
    def targets(self) -> list | None:
        """The label of every sample (crop), in order; None without labels."""
        return None if self._targets is None else np.repeat(self._targets, self.crops_per_file).tolist()

    def _raw(self, index: int, source) -> AudioRaw:
        file, k = divmod(index, self.crops_per_file)
        target = None if self._targets is None else self._targets[file].item()
        return AudioRaw(source, self.path(file), target, k)

    def _local_source(self, index: int):
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a dataset of {n} crops")
        file = (index % n) // self.crops_per_file
        return LocalAudio(locate(self.path(file))[1]) if self._local[file] else None

    def read_nowait(self, index: int) -> AudioRaw | Any:
        if type(self).read is not AudioFiles.read:
            return NOT_READY
        source = self._local_source(index)
        return NOT_READY if source is None else self._raw(index % len(self), source)

    async def read(self, index: int) -> AudioRaw:
        source = self._local_source(index)
        index %= len(self)
        if source is None:
            source = await self.storage.read_bytes(self.path(index // self.crops_per_file))
        return self._raw(index, source)

    def read_blocking(self, index: int) -> AudioRaw:
        raw = self.read_nowait(index)
        return raw if raw is not NOT_READY else _scope.run_blocking(lambda: self.read(index))

    def decode(self, raw: AudioRaw) -> Any:
        source, where, target, k = raw
        data = source.path if isinstance(source, LocalAudio) else source
        channels = 1 if self.mono else None
        wave = crop(lambda: _decoders.open_audio(data, where, self.sample_rate, channels), where, self.sample_rate,
                    self.length, self.crops, k, self.crops_per_file)
        if self.transform is not None:
            wave = self.transform(wave)
        if self._targets is None:
            return wave
        if self.target_transform is not None:
            target = self.target_transform(target)
        return wave, target

    def __repr__(self) -> str:
        return (f"AudioFiles(files={len(self._paths)}, samples={len(self)}, sample_rate={self.sample_rate}, "
                f"seconds={self.seconds:g}, mono={self.mono})")
