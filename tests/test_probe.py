"""The MP4 index parsed here (aioload._media.probe) against PyAV's demuxer on the same files."""

from __future__ import annotations

import struct
import tracemalloc

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
    (track,) = video_tracks(moov_of(files[layout]), files[layout].stat().st_size)
    pos, size, key, pts = (np.array(column) for column in zip(*packets(files[layout])))
    assert len(track) == 120 and track.codec == "avc1"
    assert (track.offsets == pos).all() and (track.sizes == size).all() and (track.sync == key).all()
    assert (np.argsort(track.cts, kind="stable") == np.argsort(pts, kind="stable")).all()  # display order
    # a keyframe every 20 frames at least (x264 adds some at scene cuts), and B-frames
    assert track.keys.tolist() == np.flatnonzero(key).tolist() and len(track.keys) >= 6 and track.reorder >= 1


def test_a_span_starts_at_the_keyframe_before_the_clip_and_covers_its_frames(files):
    path = files["moov at the end"]
    (track,) = video_tracks(moov_of(path), path.stat().st_size)
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
        video_tracks(webm, len(webm))
    with pytest.raises(NotIndexed, match="is shorter than its header"):
        box_at(b"\x00\x00\x00\x04moov", 0)
    assert box_at(b"\x00\x00", 0) is None


# -- crafted moov boxes: every count is the file's word, and is bounded before it is believed ------
def box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def table(kind: bytes, *entries: tuple[int, ...], count: int | None = None, fmt: str = "I") -> bytes:
    rows = b"".join(struct.pack(f">{fmt * len(e)}", *e) for e in entries)
    return box(kind, b"\0\0\0\0", struct.pack(">I", len(entries) if count is None else count), rows)


def moov(stsz: bytes | None = None, stsc: bytes | None = None, stts: bytes | None = None, chunks: bytes | None = None,
         ctts: bytes = b"") -> bytes:
    """A one-track video ``moov``: 3 samples of 10 bytes in one chunk at byte 100, unless told."""
    stsd = box(b"stsd", b"\0\0\0\0", struct.pack(">I", 1), struct.pack(">I4s", 16, b"avc1"), bytes(8))
    stsz = stsz if stsz is not None else box(b"stsz", b"\0\0\0\0", struct.pack(">II", 10, 3))
    stsc = stsc if stsc is not None else table(b"stsc", (1, 3, 1))
    stts = stts if stts is not None else table(b"stts", (3, 512))
    chunks = chunks if chunks is not None else table(b"stco", (100,))
    stbl = box(b"stbl", stsd, stsz, stsc, stts, chunks, ctts)
    hdlr = box(b"hdlr", bytes(8), b"vide", bytes(12))
    return box(b"moov", box(b"trak", box(b"mdia", hdlr, box(b"minf", stbl))))


def test_a_crafted_moovs_good_form_is_indexed():
    (track,) = video_tracks(moov(), 4096)
    assert track.offsets.tolist() == [100, 110, 120] and track.cts.tolist() == [0, 512, 1024] and len(moov()) < 300


HUGE = 2**32 - 1


@pytest.mark.parametrize("parts, reason", [
    ({"stsz": box(b"stsz", b"\0\0\0\0", struct.pack(">II", 1000, 300_000_000))},
     "^the video track counts 300000000 samples, more than 16777216 indexed here$"),
    ({"stsz": box(b"stsz", b"\0\0\0\0", struct.pack(">II", 1000, 1_000_000))},
     r"^the video track's 1000000 samples of 1000 bytes do not fit in the file's 4096 bytes$"),
    ({"stsz": box(b"stsz", b"\0\0\0\0", struct.pack(">II", 0, 20), struct.pack(">3I", 1, 2, 3))},
     "^the sample size table runs past the end of its box$"),  # the moov's next boxes are not its entries
    ({"chunks": table(b"stco", (100,), count=HUGE)}, "^a sample table counts 4294967295 entries, more than its box"),
    ({"chunks": table(b"co64", (100,), count=2, fmt="Q")}, "^a sample table counts 2 entries, more than its box"),
    ({"stsz": box(b"stsz", b"\0\0\0\0", b"\0\0")}, "^the sample size table's box of 6 bytes is cut short$"),
])
def test_counts_past_their_box_or_the_file_are_refused(parts, reason):
    crafted = moov(**parts)
    tracemalloc.start()
    try:
        with pytest.raises(NotIndexed, match=reason):
            video_tracks(crafted, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(crafted) < 300 and peak < 1_000_000


@pytest.mark.parametrize("parts", [
    {"stts": table(b"stts", (HUGE, 512))},  # a run of samples longer than the track
    {"stsc": table(b"stsc", (1, HUGE, 1))},  # a chunk of more samples than the track has
    {"stsc": table(b"stsc", (1, 1, 1), (HUGE, 1, 1)), "chunks": table(b"stco", (100,), (110,), (120,))},
    {"ctts": table(b"ctts", (2**31 - 1, 1))},
], ids=["stts", "stsc-samples", "stsc-chunks", "ctts"])
def test_runs_longer_than_the_track_are_cut_at_its_samples(parts):
    crafted = moov(**parts)
    tracemalloc.start()
    try:
        (track,) = video_tracks(crafted, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(track) == 3 and len(track.cts) == 3 and track.offsets.tolist() == [100, 110, 120]
    assert len(crafted) < 300 and peak < 1_000_000
