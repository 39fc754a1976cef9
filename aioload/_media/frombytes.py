"""Decoding a clip, or an audio crop, from bytes in memory: for datasets of one's own and shard members.

:func:`decode_clip` and :func:`decode_audio` take an encoded file (``bytes``, a
``memoryview``, a 1-D uint8 tensor or a seekable file object) and the clip or crop arguments of
:class:`aioload.VideoFiles` / :class:`aioload.AudioFiles`, and return what those datasets'
samples hold. They are what a ``decode`` of one's own calls -- for instance on the ``mp4``,
``webm``, ``wav``, ``flac`` or ``mp3`` member of a WebDataset tar sample -- and they draw a
random clip from torch's global generator, which the loader seeds per sample, exactly as the
datasets do.
"""

from __future__ import annotations

from typing import Any

import torch

from aioload._media import audio as _audio
from aioload._media import clips as _clips
from aioload._media import decoders as _decoders
from aioload._media import source as _source


def _bytes(data: Any) -> Any:
    if isinstance(data, memoryview):
        return data.tobytes()
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"data as a tensor must be 1-D uint8 (the encoded file), got {data.dtype} {tuple(data.shape)}")
        return data.contiguous()
    if isinstance(data, (bytes, bytearray)) or (hasattr(data, "read") and hasattr(data, "seek")):
        return data
    raise TypeError(f"data must be the encoded file as bytes, a memoryview, a 1-D uint8 tensor or a seekable file "
                    f"object, got {type(data).__name__}")


def clip_from(decoder, spec: _clips.ClipSpec, clip: int, where: str, frames: list[int] | None = None) -> torch.Tensor:
    """Clip ``clip`` (ignored for ``"random"``) of the video ``decoder`` opened, uint8 ``[T, C, H, W]``;
    ``frames`` where they were chosen already."""
    if frames is None:
        info = _source.info_of(decoder)
        frames = _clips.clip_frames(info.num_frames, info.fps, spec, clip, where)
    return _decoders.frames_at(decoder, frames, where)


def decode_clip(data: bytes | memoryview | torch.Tensor | Any, frames_per_clip: int, *, clips: str = "random",
                clip: int = 0, clips_per_video: int = 1, frame_step: int = 1, frame_rate: float | None = None,
                step_between_clips: int = 1, seek_mode: str = "approximate",
                where: str = "the video") -> torch.Tensor:
    """One clip of an encoded video in memory, as uint8 ``[T, C, H, W]`` frames.

    ``frames_per_clip``, ``frame_step``, ``frame_rate``, ``clips`` and ``step_between_clips``
    mean what they mean to :class:`aioload.VideoFiles`. ``clips="random"`` draws the start
    from torch's global generator (seeded per sample inside the loader's workers);
    ``"uniform"`` returns clip ``clip`` of ``clips_per_video`` evenly spaced ones; ``"all"``
    clip ``clip`` of every ``step_between_clips``-th start (:func:`count_clips` says how many).
    ``where`` names the data in errors (a shard member's key, say).
    """
    spec = _clips.ClipSpec(frames_per_clip, clips, clips_per_video, frame_step, frame_rate, step_between_clips)
    decoder = _decoders.open_video(_bytes(data), where, seek_mode)
    return clip_from(decoder, spec, clip, where)


def count_clips(data: bytes | memoryview | torch.Tensor | Any, frames_per_clip: int, *, frame_step: int = 1,
                frame_rate: float | None = None, step_between_clips: int = 1, seek_mode: str = "approximate",
                where: str = "the video") -> int:
    """How many clips ``clips="all"`` finds in an encoded video (0 when it is shorter than one)."""
    spec = _clips.ClipSpec(frames_per_clip, "all", 1, frame_step, frame_rate, step_between_clips)
    info = _source.info_of(_decoders.open_video(_bytes(data), where, seek_mode))
    return _clips.clips_in(info.num_frames, info.fps, spec)


def decode_audio(data: bytes | memoryview | torch.Tensor | Any, *, sample_rate: int, seconds: float,
                 mono: bool = False, crops: str = "random", crop: int = 0, crops_per_file: int = 1,
                 where: str = "the audio") -> torch.Tensor:
    """A crop of ``seconds`` of an encoded sound in memory, float32 ``[channels, samples]``.

    Resampled to ``sample_rate`` (``samples = round(seconds * sample_rate)``), mixed to one
    channel with ``mono=True``. ``crops="random"`` draws the start from torch's global
    generator; ``"uniform"`` returns crop ``crop`` of ``crops_per_file`` evenly spaced ones. A
    sound shorter than ``seconds`` is padded with zeros at the end. ``where`` names the data in
    errors.
    """
    _audio.check_audio(sample_rate, seconds, mono, crops, crops_per_file)
    source = _bytes(data)
    if hasattr(source, "read"):
        source = source.read()  # in memory: the crop may open a second decoder over it
    return _audio.crop(lambda: _decoders.open_audio(source, where, sample_rate, 1 if mono else None), where,
                       sample_rate, int(round(seconds * sample_rate)), crops, crop, crops_per_file)
