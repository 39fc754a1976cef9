"""Generated videos and sounds that look and sound like real ones, for examples, tests and benchmarks.

A video is a textured scene that the camera pans across, a few solid shapes that move and
bounce over it, and a light grain that changes every frame: content a codec compresses as
it does real footage (motion it can predict, detail it must spend bits on), unlike white
noise. A sound is a few tones that glide in pitch under a quiet noise floor. Both are encoded
with torchcodec's encoders and depend only on their arguments: the same seed gives the same
file. Nothing is downloaded.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from aioload._storage.cachedir import cache_dir

DEFAULT_VIDEOS = 64
DEFAULT_CLASSES = 4


def frames(count: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """``count`` frames, uint8 ``[T, 3, H, W]``, of one generated scene."""
    rng = np.random.default_rng(seed)
    scene_w = width * 2
    coarse = torch.from_numpy(rng.uniform(28, 228, (1, 3, 5, 9)).astype(np.float32))
    fine = torch.from_numpy(rng.uniform(-35, 35, (1, 1, height // 6 + 2, scene_w // 6 + 2)).astype(np.float32))
    scene = (F.interpolate(coarse, size=(height, scene_w), mode="bicubic", align_corners=False)
             + F.interpolate(fine, size=(height, scene_w), mode="bilinear", align_corners=False))[0].numpy()
    speed = 1 + int(rng.integers(3))
    shapes = []
    for _ in range(3):
        size = int(rng.integers(max(4, height // 8), max(5, height // 3)))
        pos = rng.uniform(0, 1, 2) * np.array([height - size, width - size])
        shapes.append((size, pos, rng.uniform(-4, 4, 2), rng.uniform(0, 255, (3, 1, 1))))
    out = np.empty((count, 3, height, width), dtype=np.uint8)
    for t in range(count):
        offset = (t * speed) % (scene_w - width)
        image = scene[:, :, offset:offset + width] + rng.normal(0, 3, (1, height, width)).astype(np.float32)
        for size, pos, vel, colour in shapes:
            y, x = int(pos[0]), int(pos[1])
            image[:, y:y + size, x:x + size] = colour
            pos += vel
            for axis, limit in ((0, height - size), (1, width - size)):
                if not 0 <= pos[axis] <= limit:
                    vel[axis] = -vel[axis]
                    pos[axis] = min(max(pos[axis], 0), limit)
        np.clip(image, 0, 255, out=image)
        out[t] = image
    return torch.from_numpy(out)


def write_video(path: str | os.PathLike, count: int = 48, height: int = 112, width: int = 144, fps: float = 25,
                seed: int = 0, codec: str = "libx264", keyframe_every: int = 24, crf: int = 23) -> Path:
    """Encode a generated video of ``count`` frames to ``path`` (the container from its suffix)."""
    from torchcodec.encoders import VideoEncoder

    path = Path(path)
    options = {"g": str(keyframe_every)}
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    VideoEncoder(frames(count, height, width, seed), frame_rate=fps).to_file(
        tmp, codec=codec, crf=crf if codec in ("libx264", "libx265") else None,
        preset="veryfast" if codec == "libx264" else None, extra_options=options)
    os.replace(tmp, path)
    return path


def sound(seconds: float, sample_rate: int, channels: int = 1, seed: int = 0) -> torch.Tensor:
    """A generated sound, float32 ``[channels, samples]`` in ``[-1, 1]``."""
    g = torch.Generator().manual_seed(seed)
    n = int(round(seconds * sample_rate))
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    out = torch.zeros((channels, n), dtype=torch.float64)
    for c in range(channels):
        for _ in range(3):
            f0 = 110 + float(torch.rand((), generator=g)) * 880
            glide = (float(torch.rand((), generator=g)) - 0.5) * 200
            phase = 2 * math.pi * (f0 * t + glide * t * t / (2 * max(seconds, 1e-9)))
            out[c] += 0.2 * torch.sin(phase)
        out[c] += 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    return out.clamp_(-1, 1).to(torch.float32)


def write_sound(path: str | os.PathLike, seconds: float = 1.0, sample_rate: int = 16000, channels: int = 1,
                seed: int = 0) -> Path:
    """Encode a generated sound to ``path`` (WAV, FLAC, MP3, ... from its suffix)."""
    from torchcodec.encoders import AudioEncoder

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    AudioEncoder(sound(seconds, sample_rate, channels, seed), sample_rate=sample_rate).to_file(tmp)
    os.replace(tmp, path)
    return path


def default_root(videos: int, classes: int, frames_per_video: int, size: tuple[int, int], seed: int) -> Path:
    return cache_dir() / f"videos-{videos}-{classes}-{frames_per_video}f-{size[0]}x{size[1]}-s{seed}"


def make_videos(root: str | os.PathLike | None = None, n: int = DEFAULT_VIDEOS, *, classes: int = DEFAULT_CLASSES,
                frames_per_video: int = 48, size: tuple[int, int] = (112, 144), fps: float = 25, seed: int = 0,
                quiet: bool = True) -> Path:
    """Make (once) a folder of ``n`` generated H.264 videos in MP4 for trying a video loader.

    The layout is :class:`aioload.VideoFolder`'s: ``root/class_000/video_000000.mp4`` and so
    on, video ``i`` in class ``i % classes``, each ``frames_per_video`` frames of ``size``
    (height, width) at ``fps``, a keyframe every 24 frames. ``root=None`` puts the folder in
    the data cache (``$AIOLOAD_CACHE``, default ``~/.cache/aioload``); a complete folder is
    reused as it is. Video ``i`` depends only on ``(seed, i)``. Returns the folder.
    """
    for name, value in (("n", n), ("classes", classes), ("frames_per_video", frames_per_video)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_videos: {name} must be an int >= 1, got {value!r}")
    height, width = size
    if height < 16 or width < 16 or height % 2 or width % 2:
        raise ValueError(f"make_videos: size must be (height, width), even and >= 16 each (H.264's 4:2:0), got {size!r}")
    root = Path(root) if root is not None else default_root(n, classes, frames_per_video, size, seed)
    marker = root / ".complete"
    if marker.exists():
        return root
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = root / f"class_{i % classes:03d}" / f"video_{i:06d}.mp4"
        if not path.exists():
            write_video(path, frames_per_video, height, width, fps, seed=seed * 1_000_003 + i)
        if not quiet and (i + 1) % 16 == 0:
            print(f"  generated {i + 1}/{n} videos", file=sys.stderr, flush=True)
    marker.touch()
    return root
