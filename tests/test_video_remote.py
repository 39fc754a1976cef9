"""Videos behind a real HTTP server on 127.0.0.1 (tests/httpserver.py, with Range support):
MP4s read by range when the clip is known at read time, everything else read whole, each
file's index probed once per process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import aioload
from aioload._media.synth import write_video
from tests.httpserver import Server
from tests.media_data import faststart, top_boxes, video


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    # 240 frames, a keyframe every 12: about 100 kB, well past the 64 KiB first read
    write_video(root / "long.mp4", 240, 96, 128, seed=1, keyframe_every=12)
    faststart(root / "long.mp4", root / "fast.mp4")
    video(root / "short.mp4", 48, seed=2)
    video(root / "clip.webm", 24, seed=3, codec="libvpx-vp9")
    return root


@pytest.fixture
def server(served):
    with Server(served) as srv:
        yield srv


def spans(ranges: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in re.fullmatch(r"bytes=(\d+)-(\d+)", r).groups()) for r in ranges]


@pytest.mark.parametrize("name", ["long.mp4", "fast.mp4"])
def test_uniform_clips_of_a_remote_mp4_are_read_by_range(served, server, name):
    boxes = [kind for kind, _, _ in top_boxes(served / name)]
    assert boxes.index(b"moov") > boxes.index(b"mdat") if name == "long.mp4" else boxes.index(b"moov") == 1
    size = (served / name).stat().st_size
    args = dict(frames_per_clip=8, clips="uniform", clips_per_video=5)
    remote = aioload.VideoFiles([server.url(name)], [3], **args)
    local = aioload.VideoFiles([served / name], [3], **args)
    for i in range(5):
        clip, label = remote[i]
        assert label == 3 and torch.equal(clip, local[i][0]), i
    read = spans(server.ranges)
    assert read[0] == (0, 65535)  # the probe: the top-level boxes (and a moov at the front)
    clips = read[-5:]
    assert all(end - start + 1 < size / 3 for start, end in clips), (clips, size)
    assert sum(end - start + 1 for start, end in clips) < size
    assert server.requests[name] == len(read) <= 5 + 3  # no whole-file read; the probe took at most 3


def test_random_clips_read_a_small_file_whole(served, server):
    ds = aioload.VideoFiles([server.url("long.mp4"), server.url("short.mp4")], frames_per_clip=8)
    local = aioload.VideoFiles([served / "long.mp4", served / "short.mp4"], frames_per_clip=8)
    for index in (0, 0, 1):
        torch.manual_seed(index)
        clip = ds[index]
        torch.manual_seed(index)
        assert torch.equal(clip, local[index])
    # long.mp4 (100 kB): the head, its moov (the file is small: read whole), the file; then the file
    # again; short.mp4 (12 kB) came whole in its first 64 KiB
    assert spans(server.ranges) == [(0, 65535), spans(server.ranges)[1], (0, 65535)]
    assert server.requests["long.mp4"] == 4 and server.requests["short.mp4"] == 1


def test_random_clips_of_a_large_file_are_read_by_range_after_the_draw(served, server):
    size = (served / "long.mp4").stat().st_size
    ds = aioload.VideoFiles([server.url("long.mp4")], [1], frames_per_clip=8, clips_per_video=6,
                            whole_file_bytes=size // 2)
    local = aioload.VideoFiles([served / "long.mp4"], [1], frames_per_clip=8, clips_per_video=6)
    with aioload.DataLoader(ds, batch_size=6, num_workers=2, seed=3) as loader:
        (clips, labels), = list(loader)
    with aioload.DataLoader(local, batch_size=6, num_workers=0, seed=3) as loader:
        (expected, _), = list(loader)
    assert torch.equal(clips, expected) and labels.tolist() == [1] * 6
    read = spans(server.ranges)
    assert server.requests["long.mp4"] == len(read)  # never the whole file
    clip_reads = [end - start + 1 for start, end in read if start != 0 and end - start + 1 != 65536]
    assert len(clip_reads) >= 6 and max(clip_reads) < size / 3
    with pytest.raises(ValueError, match="^whole_file_bytes must be an int >= 0 [(]bytes[)], got -1$"):
        aioload.VideoFiles([server.url("long.mp4")], frames_per_clip=8, whole_file_bytes=-1)


def test_a_container_without_an_index_here_is_read_whole(served, server):
    ds = aioload.VideoFiles([server.url("clip.webm")], frames_per_clip=6, clips="uniform", clips_per_video=2)
    local = aioload.VideoFiles([served / "clip.webm"], frames_per_clip=6, clips="uniform", clips_per_video=2)
    assert torch.equal(ds[1], local[1])
    assert spans(server.ranges) == [(0, 65535)]  # the probe found no MP4, so the file came whole
    assert server.requests["clip.webm"] == 2


def test_all_probes_each_file_once_and_forked_workers_keep_the_probes(served, server):
    names = ["long.mp4", "fast.mp4", "short.mp4"]
    remote = aioload.VideoFiles([server.url(n) for n in names], [0, 1, 2], frames_per_clip=8, clips="all",
                                step_between_clips=40)
    local = aioload.VideoFiles([served / n for n in names], [0, 1, 2], frames_per_clip=8, clips="all",
                               step_between_clips=40)
    clips = {"long.mp4": (240 - 8) // 40 + 1, "fast.mp4": (240 - 8) // 40 + 1, "short.mp4": (48 - 8) // 40 + 1}
    assert len(remote) == len(local) == sum(clips.values()) and remote.metadata == local.metadata
    probes = dict(server.requests)
    with aioload.DataLoader(remote, batch_size=4, num_workers=2) as loader:
        got = list(loader)
    with aioload.DataLoader(local, batch_size=4, num_workers=0) as loader:
        expected = list(loader)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    assert {n: server.requests[n] - probes[n] for n in names} == clips  # one range read per clip, no probe again


def test_concurrent_reads_in_a_worker_share_one_probe(served, server):
    ds = aioload.VideoFiles([server.url("long.mp4")], frames_per_clip=8, clips="uniform", clips_per_video=8)
    server.latency = 0.05  # reads overlap: all eight start before the first probe is answered
    with aioload.DataLoader(ds, batch_size=8, num_workers=1, io_concurrency=8) as loader:
        (clips,) = list(loader)
    assert clips.shape == (8, 8, 3, 96, 128)
    assert server.requests["long.mp4"] == 2 + 8  # head, moov at the end; then one range per clip


def test_with_a_cache_the_reads_stay_in_the_training_process_and_the_ranges_are_kept(served, server):
    storage = aioload.Storage(cache=aioload.MemoryCache(max_bytes=8 << 20))
    ds = aioload.VideoFiles([server.url("long.mp4")], frames_per_clip=8, clips="uniform", clips_per_video=4,
                            storage=storage)
    assert ds.read_in_workers is False  # the cache lives here: range pieces travel to the workers
    local = aioload.VideoFiles([served / "long.mp4"], frames_per_clip=8, clips="uniform", clips_per_video=4)
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        first, second = list(loader), list(loader)
        asked = server.requests["long.mp4"]
    expected = torch.stack([local[i] for i in range(4)])
    assert torch.equal(first[0], expected) and torch.equal(second[0], expected)
    assert asked == 2 + 4  # the probe, then one range per clip; the second epoch came from the cache


def test_a_folder_in_an_fsspec_filesystem_lists_and_reads_by_range(served):
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"/aioload-videos-{uuid.uuid4().hex}"
    try:
        for name, cls in (("long.mp4", "a"), ("fast.mp4", "b")):
            fs.pipe(f"{base}/{cls}/{name}", (served / name).read_bytes())
        ds = aioload.VideoFolder(f"memory://{base}", 8, "uniform", clips_per_video=2)
        assert ds.classes == ["a", "b"] and [t for _, t in ds.samples] == [0, 1]
        local = aioload.VideoFiles([served / n for n in ("long.mp4", "fast.mp4")], frames_per_clip=8,
                                   clips="uniform", clips_per_video=2)
        with aioload.DataLoader(ds, batch_size=4, num_workers=1) as loader:
            (clips, labels), = list(loader)
        assert torch.equal(clips, torch.stack([local[i] for i in range(4)])) and labels.tolist() == [0, 0, 1, 1]
        raw = ds.read_blocking(1)
        assert raw.source.nbytes < (served / "long.mp4").stat().st_size / 2  # a range, not the file
    finally:
        fs.rm(base, recursive=True)


def test_a_read_cancelled_while_it_probes_leaves_the_reads_waiting_on_it_to_probe(served):
    import asyncio

    from aioload._media.source import Probes

    class Stalling(aioload.Storage):
        """Its first read never returns (a read whose read_timeout expires)."""

        calls = 0

        async def read_range(self, target, offset, length):
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(3600)
            return await super().read_range(target, offset, length)

    async def main():
        probes, storage, path = Probes(), Stalling(), str(served / "long.mp4")
        first = asyncio.create_task(probes.get(storage, path))
        await asyncio.sleep(0)  # the first read is probing (stalled)
        second = asyncio.create_task(probes.get(storage, path))
        await asyncio.sleep(0)  # the second waits on the first's probe
        first.cancel()
        probe = await asyncio.wait_for(second, 30)
        with pytest.raises(asyncio.CancelledError):
            await first
        return probe, await probes.get(storage, path), storage.calls

    probe, again, calls = asyncio.run(main())
    assert probe.info.num_frames == 240 and again is probe and calls == 3  # stalled, then head and moov
