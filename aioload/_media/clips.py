"""Clip policies: which frames of a video make a clip.

A clip is ``frames_per_clip`` frames, every ``frame_step``-th, of the video resampled to
``frame_rate`` frames per second (the video's own rate when ``None``). What varies is where the
clip starts:

* ``"random"``: anywhere, drawn with ``torch.randint`` from torch's global generator. The
  dataset draws it in ``decode``, after the loader has seeded that generator for the sample
  (with ``DataLoader(seed=S)`` from ``(S, epoch, index)``; without, as torch seeds a worker),
  so the clip is reproduced exactly, by a resumed run too, as any random augmentation is.
* ``"uniform"``: clip ``k`` of ``clips_per_video`` evenly spaced ones, first and last at the
  video's ends (one clip: the middle one).
* ``"all"``: every ``step_between_clips``-th start, as torchvision's ``VideoClips``.

Everything here is a pure function of its arguments (and, for ``"random"``, of the
generator's state): no I/O, no decoder. The same functions serve datasets
(:mod:`aioload._media.video`) and in-memory bytes (:mod:`aioload._media.frombytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POLICIES = ("random", "uniform", "all")


class ShortVideoError(ValueError):
    """A video holds too few frames for one clip."""


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class ClipSpec:
    """What a clip is, checked once at construction (``ValueError``/``TypeError``)."""

    frames_per_clip: int
    clips: str = "random"
    clips_per_video: int = 1
    frame_step: int = 1
    frame_rate: float | None = None
    step_between_clips: int = 1

    def __post_init__(self) -> None:
        positive_int("frames_per_clip", self.frames_per_clip)
        positive_int("clips_per_video", self.clips_per_video)
        positive_int("frame_step", self.frame_step)
        positive_int("step_between_clips", self.step_between_clips)
        if self.clips not in POLICIES:
            raise ValueError(f"clips must be 'random', 'uniform' or 'all', got {self.clips!r}")
        rate = self.frame_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not math.isfinite(rate) or rate <= 0):
            raise ValueError(f"frame_rate must be None (the video's own) or a number of frames per second > 0, "
                             f"got {rate!r}")
        if self.clips == "all" and self.clips_per_video != 1:
            raise ValueError("clips_per_video applies to clips='random' and 'uniform'; clips='all' takes every "
                             "clip, every step_between_clips frames")

    @property
    def span(self) -> int:
        """How many (resampled) frames one clip covers, first to last."""
        return (self.frames_per_clip - 1) * self.frame_step + 1

    @property
    def per_video_fixed(self) -> bool:
        """Whether each video yields a fixed number of samples (``clips_per_video``), known
        without probing it; ``"all"`` needs each video's frame count."""
        return self.clips != "all"

    def describe(self) -> str:
        text = f"a clip of {self.frames_per_clip} frames"
        if self.frame_step > 1:
            text += f" every {self.frame_step}"
        if self.frame_rate is not None:
            text += f" at {self.frame_rate:g} fps"
        return text


def resampled(num_frames: int, fps: float, frame_rate: float | None) -> torch.Tensor:
    """Source frame indices of the video resampled to ``frame_rate``, by torchvision's
    ``VideoClips`` rule: every ``fps / frame_rate``-th frame (rounded down, in float32 as
    there; an integer ratio keeps every n-th frame), repeating frames when upsampling. The
    identity without ``frame_rate``."""
    if frame_rate is None or num_frames == 0 or fps <= 0:
        return torch.arange(num_frames)
    step = fps / frame_rate
    if float(step).is_integer():
        return torch.arange(0, num_frames, int(step))
    count = int(math.floor(num_frames * frame_rate / fps))
    return (torch.arange(count, dtype=torch.float32) * step).floor().to(torch.int64).clamp_(max=num_frames - 1)


def starts(num_frames: int, fps: float, spec: ClipSpec) -> int:
    """How many positions a clip can start at (0 when the video is shorter than a clip)."""
    return max(0, len(resampled(num_frames, fps, spec.frame_rate)) - spec.span + 1)


def clips_in(num_frames: int, fps: float, spec: ClipSpec) -> int:
    """How many samples a video gives: ``clips_per_video``, or for ``"all"`` every
    ``step_between_clips``-th start (0 for a video shorter than a clip, as in torchvision)."""
    if spec.clips != "all":
        return spec.clips_per_video
    count = starts(num_frames, fps, spec)
    return 0 if count == 0 else (count - 1) // spec.step_between_clips + 1


def uniform_start(count: int, k: int, n: int) -> int:
    """The start of clip ``k`` of ``n`` evenly spaced over ``count`` positions."""
    if n == 1:
        return (count - 1) // 2
    return int(round(k * (count - 1) / (n - 1)))


def clip_frames(num_frames: int, fps: float, spec: ClipSpec, k: int, where: str = "the video") -> list[int]:
    """The source frame indices of clip ``k`` of a video of ``num_frames`` frames at ``fps``.

    ``k`` is the clip's number within the video for ``"uniform"`` and ``"all"``; for
    ``"random"`` it is ignored and the start is drawn from torch's global generator. A video
    too short for one clip raises :class:`ShortVideoError` naming ``where``."""
    index = resampled(num_frames, fps, spec.frame_rate)
    count = len(index) - spec.span + 1
    if count <= 0:
        rate = f" resampled to {spec.frame_rate:g} fps ({len(index)} frames)" if spec.frame_rate is not None else ""
        raise ShortVideoError(
            f"{where} holds {num_frames} frames at {fps:g} fps{rate}, too few for {spec.describe()} "
            f"(it spans {spec.span} frames): lower frames_per_clip or frame_step, leave the file out, "
            "or pass on_error='skip' to the DataLoader to skip such videos")
    if spec.clips == "random":
        start = int(torch.randint(count, ()).item())
    elif spec.clips == "uniform":
        start = uniform_start(count, k, spec.clips_per_video)
    else:
        start = k * spec.step_between_clips
        if not 0 <= start < count:
            raise IndexError(f"clip {k} of {where} does not exist: it has {clips_in(num_frames, fps, spec)} clips")
    return index[start:start + spec.span:spec.frame_step].tolist()
