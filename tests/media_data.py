"""Real encoded media for the video and audio tests, made by the tests (small: 2 vCPUs).

Videos are aioload's generated ones (a panned scene, moving shapes, grain) in H.264/MP4 from
torchcodec's encoder; :func:`faststart` rewrites one with its ``moov`` first (PyAV's muxer),
and :func:`broken` makes the damaged files the error tests need.
"""

from __future__ import annotations

import os
from pathlib import Path

from aioload._media.probe import box_at
from aioload._media.synth import write_sound, write_video

SIZE = (48, 64)  # height, width: even, and small enough to decode fast


def video(path: Path, frames: int = 48, seed: int = 0, codec: str = "libx264", keyframe_every: int = 12) -> Path:
    return write_video(path, frames, SIZE[0], SIZE[1], 25, seed=seed, codec=codec, keyframe_every=keyframe_every)


def folder(root: Path, videos: int = 6, classes: int = 2, frames: int = 48) -> Path:
    """``root/class_00c/video_00000i.mp4``, video ``i`` of ``frames + 8 * i`` frames in class ``i % classes``."""
    for i in range(videos):
        folder = root / f"class_{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        video(folder / f"video_{i:06d}.mp4", frames + 8 * i, seed=i)
    return root


def top_boxes(path: Path) -> list[tuple[bytes, int, int]]:
    data = path.read_bytes()
    pos, out = 0, []
    while pos < len(data):
        box = box_at(data, pos)
        out.append((box.kind, box.offset, box.size))
        pos += box.size
    return out


def faststart(src: Path, dst: Path) -> Path:
    """``src`` remuxed (not re-encoded) with its ``moov`` box before the media data."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is None:
                continue
            packet.stream = stream
            out.mux(packet)
    return dst


def broken(root: Path) -> dict[str, Path]:
    """Damaged and unsuitable files: ``corrupt`` (no video at all), ``truncated`` (its moov,
    at the end, cut off), ``cut`` (moov first, media data cut off after a third), ``short``
    (fewer frames than a clip), ``sound`` (a WAV: no video stream)."""
    root.mkdir(parents=True, exist_ok=True)
    good = video(root / "good.mp4", 48, seed=7)
    data = good.read_bytes()
    (root / "corrupt.mp4").write_bytes(bytes((i * 7919) % 251 for i in range(6000)))
    (root / "truncated.mp4").write_bytes(data[:len(data) // 2])
    fast = faststart(good, root / "fast.mp4").read_bytes()
    (root / "cut.mp4").write_bytes(fast[:len(fast) // 3])
    video(root / "short.mp4", 5, seed=8)
    write_sound(root / "sound.wav", 0.5, 8000)
    os.remove(root / "fast.mp4")
    return {name: root / f"{name}.{'wav' if name == 'sound' else 'mp4'}"
            for name in ("good", "corrupt", "truncated", "cut", "short", "sound")}
