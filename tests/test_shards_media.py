"""Video and audio members of WebDataset shards decode as aioload's video and audio datasets do.

Shards written by ``aioload.ShardWriter`` hold real H.264 MP4s and WAVs made by the tests; the
dataset's ``decoders`` take ``aioload.decode_clip`` and ``aioload.decode_audio`` (with their
clip settings bound), and the loader's batches are compared with those functions' own output
on the same bytes and seeds.
"""

from __future__ import annotations

import functools

import pytest
import torch

import aioload
from aioload._media.synth import write_sound, write_video
from aioload._base.seeding import derive_seed, sample_seed, seed_everything

FRAMES, RATE, SECONDS = 8, 8000, 0.5


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("media-shards")
    members = []
    for i in range(6):
        video = write_video(root / f"v{i}.mp4", count=24, height=48, width=64, seed=i).read_bytes()
        audio = write_sound(root / f"a{i}.wav", seconds=1.0, sample_rate=RATE, seed=i).read_bytes()
        members.append({"__key__": f"s{i:03d}", "mp4": video, "wav": audio, "cls": i % 2})
    with aioload.ShardWriter(str(root / "media-%03d.tar"), maxcount=3) as sink:
        for sample in members:
            sink.write(sample)
    return str(root / "media-{000..001}.tar"), members


def decoders():
    return {"mp4": functools.partial(aioload.decode_clip, frames_per_clip=FRAMES),
            "wav": functools.partial(aioload.decode_audio, sample_rate=RATE, seconds=SECONDS)}


def test_video_and_audio_members_decode_in_the_workers_as_the_media_functions_do(shards):
    urls, members = shards
    ds = aioload.WebDataset(urls, decoders=decoders())
    assert len(ds) == 6
    seed = 4
    with aioload.DataLoader(ds, batch_size=3, num_workers=2, seed=seed) as loader:
        batches = list(loader)
    base = derive_seed(seed, 0, 1)  # the epoch's per-sample seed base (aioload._plan.sampling)
    seen = 0
    for batch in batches:
        assert batch["mp4"].shape == (3, FRAMES, 3, 48, 64) and batch["mp4"].dtype == torch.uint8
        assert batch["wav"].shape == (3, 1, int(RATE * SECONDS)) and batch["wav"].dtype == torch.float32
        for row, key in enumerate(batch["__key__"]):
            index = int(key[1:])
            seed_everything(sample_seed(base, index))  # what the worker did before decoding sample `index`
            clip = aioload.decode_clip(members[index]["mp4"], FRAMES)
            sound = aioload.decode_audio(members[index]["wav"], sample_rate=RATE, seconds=SECONDS)
            assert torch.equal(batch["mp4"][row], clip), key
            assert torch.equal(batch["wav"][row], sound), key
            seen += 1
    assert seen == 6


def test_the_clips_drawn_reproduce_with_seed_and_change_with_the_epoch(shards):
    urls, _ = shards
    ds = aioload.WebDataset(urls, decoders=decoders())

    def clips(workers: int) -> list[torch.Tensor]:
        with aioload.DataLoader(ds, batch_size=6, num_workers=workers, seed=1) as loader:
            return [next(iter(loader))["mp4"] for _ in range(2)]

    one, two = clips(0), clips(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two)), "the same clips at any worker count"
    assert not torch.equal(one[0], one[1]), "another epoch draws other clips"


def test_a_corrupt_video_member_names_its_key_and_shard(tmp_path):
    with aioload.ShardWriter(str(tmp_path / "bad-%03d.tar"), maxcount=10) as sink:
        sink.write({"__key__": "broken", "mp4": b"\x00\x00\x00\x18ftypmp42" + bytes(200), "cls": 0})
    ds = aioload.WebDataset(str(tmp_path / "bad-000.tar"), decoders=decoders())
    with aioload.DataLoader(ds, batch_size=1, num_workers=1) as loader:
        with pytest.raises(aioload.ShardError, match=r"member broken\.mp4 of shard .*bad-000\.tar does not "
                                                     r"decode as 'mp4'"):
            list(loader)


def test_a_mix_of_shard_datasets_reports_their_shard_statistics(shards):
    urls, members = shards
    windowed = aioload.WebDataset(urls, window=2)
    other = aioload.WebDataset(urls)
    mix = aioload.Mix({"window": windowed, "uniform": other}, {"window": 1, "uniform": 1})
    with aioload.DataLoader(mix, batch_size=4, shuffle=True, num_workers=1, seed=0) as loader:
        keys = [key for batch in loader for key in batch["__key__"]]
        stats = loader.stats()
    assert sorted(keys) == sorted([m["__key__"] for m in members] * 2)  # 6 from each source: none repeats
    assert stats.per_source == {"window": 6, "uniform": 6}
    assert stats.shard_mode == "window"
