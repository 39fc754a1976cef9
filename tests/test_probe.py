"""The MP4 index parsed here (aioload._media.probe) against PyAV's demuxer on the same files."""

from __future__ import annotations

import av
import numpy as np
import pytest

from aioload._media.probe import NotIndexed, box_at, video_tracks
from aioload._media.synth import write_video
from tests.media_data import faststart, top_boxes, video


def moov_of(path) -> bytes:
    data = path.read_bytes()
    (offset, size), = [(o, s) for kind, o, s in top_boxes(path) if kind == b"moov"]
    return data[offset:offset + size]


def packets(path) -> list:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [(p.pos, p.size, p.is_keyframe, p.pts) for p in container.demux(stream) if p.size]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    end = write_video(root / "end.mp4", 120, 48, 64, seed=4, keyframe_every=20)
    return {"moov at the end": end, "moov first": faststart(end, root / "first.mp4")}


@pytest.mark.parametrize("layout", ["moov at the end", "moov first"])
def test_the_sample_tables_match_pyavs_packets(files, layout):
    (track,) = video_tracks(moov_of(files[layout]))
    pos, size, key, pts = (np.array(column) for column in zip(*packets(files[layout])))
    assert len(track) == 120 and track.codec == "avc1"
    assert (track.offsets == pos).all() and (track.sizes == size).all() and (track.sync == key).all()
    assert (np.argsort(track.cts, kind="stable") == np.argsort(pts, kind="stable")).all()  # display order
    # a keyframe every 20 frames at least (x264 adds some at scene cuts), and B-frames
    assert track.keys.tolist() == np.flatnonzero(key).tolist() and len(track.keys) >= 6 and track.reorder >= 1


def test_a_span_starts_at_the_keyframe_before_the_clip_and_covers_its_frames(files):
    path = files["moov at the end"]
    (track,) = video_tracks(moov_of(path))
    shown = packets(path)
    order = sorted(range(len(shown)), key=lambda i: shown[i][3])  # frame r is packet order[r]
    for frames in ([0, 1, 2], [45, 46, 47, 48], [100, 119], [60]):
        start, end = track.span(frames)
        key = max(i for i in range(len(shown)) if shown[i][2] and i <= min(order[f] for f in frames))
        assert start <= shown[key][0]
        assert all(shown[order[f]][0] + shown[order[f]][1] <= end for f in frames)
        assert end - start < path.stat().st_size / 2 or frames == [100, 119]


def test_what_is_no_mp4_index_says_so(tmp_path):
    webm = video(tmp_path / "clip.webm", 12, codec="libvpx-vp9").read_bytes()
    with pytest.raises(NotIndexed, match="^no moov box$"):
        video_tracks(webm)
    with pytest.raises(NotIndexed, match="is shorter than its header"):
        box_at(b"\x00\x00\x00\x04moov", 0)
    assert box_at(b"\x00\x00", 0) is None
