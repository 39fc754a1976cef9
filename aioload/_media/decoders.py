"""torchcodec's decoders, opened once per file within a worker, and their errors made plain.

torchcodec is PyTorch's own decoder (FFmpeg underneath, frames straight into tensors) and the
one every decode here goes through; it needs torch >= 2.11 and FFmpeg's shared libraries
(4 to 9) on the machine. PyAV was measured against it on ``benchmarks/video.py``: see
docs/video.md for the numbers and the choice.

**Reuse.** Opening a ``VideoDecoder`` reads the container's header and sets up the codec:
1-2 ms at 128x170 and 12 ms at 720p here (``seek_mode="approximate"``; ``"exact"`` also
demuxes the whole file, 3 ms for a 60 s 320x240 clip and in proportion to the file's length),
against 5-15 ms (128x170) and about 110 ms (720p) to decode a 16-frame clip. :class:`Decoders` keeps the last
:data:`KEPT` decoders of local files open in each process, so clips of one video that the
same worker decodes in a row (``clips="uniform"`` or ``"all"`` without shuffling: a batch of
neighbouring indices) open it once; a decoder over bytes read from a remote file serves only
that read and is not kept.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any

import torch

KEPT = 4
"""Open decoders kept per process (each holds FFmpeg's codec state and its reference frames:
at most about 2 MB of RSS at 128x170 and 9 MB at 720p, measured here)."""

FFMPEG_PACKAGES = ("libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4 libavfilter8 "
                   "libavdevice59")

_TORCHCODEC: Any = None


def torchcodec_decoders():
    """``torchcodec.decoders``, or an ``ImportError`` that says how to install what is missing."""
    global _TORCHCODEC
    if _TORCHCODEC is not None:
        return _TORCHCODEC
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if version < (2, 11):
        raise ImportError(f"video and audio decoding needs torchcodec, which needs torch >= 2.11 (this is torch "
                          f"{torch.__version__}): upgrade torch, then pip install 'aioload[video]'")
    try:
        import torchcodec
        import torchcodec.decoders as decoders
    except ImportError as exc:
        raise ImportError("video and audio decoding needs torchcodec: pip install 'aioload[video]'") from exc
    if getattr(torchcodec, "ffmpeg_major_version", None) is None:
        raise ImportError("torchcodec is installed but found no FFmpeg libraries (4 to 9) on this machine: "
                          f"apt-get install {FFMPEG_PACKAGES} (Debian 12), or conda install ffmpeg")
    _TORCHCODEC = decoders
    return decoders


class MediaError(RuntimeError):
    """A file that cannot be decoded as asked; the message names the file and the remedy."""


_SOURCE_LOCATION = re.compile(r"^\w+, \S+\.cpp:\d+, ")


def reason(exc: BaseException) -> str:
    """torchcodec's message without its C++ source location, on one line."""
    text = " ".join(str(exc).split())
    return _SOURCE_LOCATION.sub("", text).split(" This should never happen")[0].strip()


def _no_stream(exc: BaseException, kind: str) -> bool:
    return isinstance(exc, ValueError) and f"best {kind} stream is unknown" in str(exc)


def open_video(source, where: str, seek_mode: str = "approximate"):
    """A CPU ``VideoDecoder`` over ``source`` (a path, bytes, or a file-like object), one
    FFmpeg thread (the workers are the parallelism), frames as ``[N, C, H, W]``."""
    decoders = torchcodec_decoders()
    try:
        return decoders.VideoDecoder(source, seek_mode=seek_mode, num_ffmpeg_threads=1, dimension_order="NCHW",
                                     device="cpu")
    except (RuntimeError, ValueError) as exc:
        if _no_stream(exc, "video"):
            raise MediaError(f"{where} has no video stream: give video files to this dataset (an audio file "
                             "goes to aioload.AudioFiles), or pass on_error='skip' to the DataLoader to skip it") from exc
        raise MediaError(f"{where} cannot be opened as a video ({reason(exc)}): the file is corrupt, truncated or "
                         "not a video; check it with ffprobe, re-encode or remove it, or pass on_error='skip' to "
                         "the DataLoader to skip such files") from exc


def open_audio(source, where: str, sample_rate: int | None, channels: int | None):
    """An ``AudioDecoder`` over ``source``, resampling to ``sample_rate`` and mixing to
    ``channels`` where given."""
    decoders = torchcodec_decoders()
    try:
        return decoders.AudioDecoder(source, sample_rate=sample_rate, num_channels=channels)
    except (RuntimeError, ValueError) as exc:
        if _no_stream(exc, "audio"):
            raise MediaError(f"{where} has no audio stream: give audio files (or videos with sound) to "
                             "aioload.AudioFiles, or pass on_error='skip' to the DataLoader to skip it") from exc
        raise MediaError(f"{where} cannot be opened as audio ({reason(exc)}): the file is corrupt, truncated or "
                         "not audio; check it with ffprobe, re-encode or remove it, or pass on_error='skip' to "
                         "the DataLoader to skip such files") from exc


def frames_at(decoder, indices: list[int], where: str) -> torch.Tensor:
    """``decoder``'s frames at ``indices`` as uint8 ``[T, C, H, W]``, errors naming ``where``."""
    try:
        return decoder.get_frames_at(indices).data
    except (RuntimeError, IndexError) as exc:
        raise MediaError(f"{where}: frames {indices[0]}-{indices[-1]} could not be decoded ({reason(exc)}): the "
                         "file is corrupt or truncated, or holds fewer frames than its header says; re-encode or "
                         "remove it, or pass on_error='skip' to the DataLoader to skip such files") from exc


class Decoders:
    """The last :data:`KEPT` video decoders of local files opened in this process.

    Keyed by path and seek mode, and by process: a forked worker never uses a decoder its
    parent opened (the two would share the file descriptor's offset)."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._pid = os.getpid()
        self._open: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def video(self, path: str, where: str, seek_mode: str):
        if self._pid != os.getpid():
            self._open = collections.OrderedDict()
            self._pid = os.getpid()
        key = (path, seek_mode)
        decoder = self._open.get(key)
        if decoder is not None:
            self._open.move_to_end(key)
            return decoder
        decoder = open_video(path, where, seek_mode)
        self._open[key] = decoder
        while len(self._open) > self.kept:
            self._open.popitem(last=False)
        return decoder

    def forget(self, path: str) -> None:
        """Drop ``path``'s decoders (after one failed: the next use opens the file again)."""
        for key in [k for k in self._open if k[0] == path]:
            del self._open[key]

    def __len__(self) -> int:
        return len(self._open)


LOCAL = Decoders()
"""This process's decoders of local files."""
