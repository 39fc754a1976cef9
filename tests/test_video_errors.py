"""Bad video and audio files made here: each fails with an error naming the file and the fix,
in the caller's process and from a worker; ``on_error="skip"`` leaves them out."""

from __future__ import annotations

import re

import pytest
import torch

import aioload
from aioload._media.clips import ShortVideoError
from aioload._media.decoders import MediaError
from tests.media_data import broken, video

SKIP = "or pass on_error='skip' to the DataLoader to skip such files"


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    return broken(tmp_path_factory.mktemp("bad"))


def expected(name: str, path) -> tuple[type, str]:
    """The error's type and a pattern of its whole message (the decoder's own reason, in
    parentheses, varies with where the cut falls)."""
    kind, message = _expected(name, str(path))
    return kind, re.escape(message).replace(re.escape("(REASON)"), r"\(.+\)")


def _expected(name: str, p: str) -> tuple[type, str]:
    return {
        "corrupt": (MediaError, f"{p} cannot be opened as a video (Could not open input file: {p} Invalid data found "
                                f"when processing input): the file is corrupt, truncated or not a video; check it "
                                f"with ffprobe, re-encode or remove it, {SKIP}"),
        "truncated": (MediaError, f"{p} cannot be opened as a video (Could not open input file: {p} Invalid data "
                                  f"found when processing input): the file is corrupt, truncated or not a video; "
                                  f"check it with ffprobe, re-encode or remove it, {SKIP}"),
        "cut": (MediaError, f"{p}: frames 20-27 could not be decoded (REASON): the file is corrupt or truncated, or "
                            f"holds fewer frames than its header says; re-encode or remove it, {SKIP}"),
        "short": (ShortVideoError, f"{p} holds 5 frames at 25 fps, too few for a clip of 8 frames (it spans 8 "
                                   f"frames): lower frames_per_clip or frame_step, leave the file out, or pass "
                                   f"on_error='skip' to the DataLoader to skip such videos"),
        "sound": (MediaError, f"{p} has no video stream: give video files to this dataset (an audio file goes to "
                              f"aioload.AudioFiles), or pass on_error='skip' to the DataLoader to skip it"),
    }[name]


@pytest.mark.parametrize("name", ["corrupt", "truncated", "cut", "short", "sound"])
def test_a_bad_video_names_itself_and_the_fix(bad, name):
    ds = aioload.VideoFiles([bad[name]], [0], frames_per_clip=8, clips="uniform")
    kind, message = expected(name, bad[name])
    with pytest.raises(kind) as info:
        ds[0]
    assert type(info.value) is kind and re.fullmatch(message, str(info.value)), str(info.value)


@pytest.mark.parametrize("name", ["corrupt", "short", "sound"])
def test_from_a_worker_the_error_keeps_its_type_and_names_the_index(bad, name):
    files = [bad["good"], bad[name]]
    ds = aioload.VideoFiles(files, [0, 1], frames_per_clip=8, clips="uniform")
    kind, message = expected(name, bad[name])
    with aioload.DataLoader(ds, batch_size=1, num_workers=1) as loader:
        it = iter(loader)
        clip, label = next(it)
        assert clip.shape == (1, 8, 3, 48, 64) and label.tolist() == [0]
        with pytest.raises(kind) as info:
            next(it)
    assert type(info.value) is kind and re.fullmatch(message, str(info.value))
    note = f"while running decode for dataset index 1 ({bad[name]}, clip 0) in an aioload worker"
    assert any(re.fullmatch(re.escape(note) + r".*", n) for n in info.value.__notes__), info.value.__notes__


def test_on_error_skip_leaves_the_bad_files_out(bad):
    names = ["good", "corrupt", "truncated", "cut", "short", "sound", "good"]
    ds = aioload.VideoFiles([bad[n] for n in names], list(range(len(names))), frames_per_clip=8, clips="uniform")
    with aioload.DataLoader(ds, batch_size=2, num_workers=2, on_error="skip") as loader:
        got = list(loader)
        stats = loader.stats()
    labels = torch.cat([labels for _, labels in got]).tolist()
    assert labels == [0, 6] and stats.skipped_total == 5
    assert torch.equal(got[0][0][0], ds[0][0])


def test_clips_all_probes_at_construction_and_names_a_file_it_cannot_open(bad, tmp_path):
    with pytest.raises(MediaError) as info:
        aioload.VideoFiles([bad["good"], bad["corrupt"]], frames_per_clip=8, clips="all")
    assert re.fullmatch(expected("corrupt", bad["corrupt"])[1], str(info.value))
    short = aioload.VideoFiles([bad["short"], bad["good"]], frames_per_clip=8, clips="all", step_between_clips=8)
    assert len(short) == (48 - 8) // 8 + 1 and short.clip_of(0) == (1, 0)  # no clip in the short one, as torchvision


def test_an_audio_file_without_sound_names_itself(bad, tmp_path):
    silent = video(tmp_path / "silent.mp4", 12)
    ds = aioload.AudioFiles([silent], sample_rate=8000, seconds=0.2)
    with pytest.raises(MediaError) as info:
        ds[0]
    assert str(info.value) == (f"{silent} has no audio stream: give audio files (or videos with sound) to "
                               "aioload.AudioFiles, or pass on_error='skip' to the DataLoader to skip it")
    junk = tmp_path / "junk.flac"
    junk.write_bytes(b"fLaC" + bytes(range(256)) * 8)
    with pytest.raises(MediaError, match=rf"^{re.escape(str(junk))} cannot be opened as audio \(.*\): the file is "
                                         rf"corrupt, truncated or not audio; check it with ffprobe, re-encode or "
                                         rf"remove it, {re.escape(SKIP)}$"):
        aioload.AudioFiles([junk], sample_rate=8000, seconds=0.2)[0]
