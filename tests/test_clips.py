"""Clip policies (aioload._media.clips): which frames make a clip, with no file and no decoder."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchvision.datasets.video_utils import VideoClips

from aioload._media.clips import ClipSpec, ShortVideoError, clip_frames, clips_in, resampled


def torchvision_clips(num_frames: int, fps: float, frames_per_clip: int, step: int, frame_rate=None) -> list:
    """The frame indices of every clip torchvision's VideoClips makes of a video of ``num_frames``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "There aren't enough frames ..." for short videos
        clips, _ = VideoClips.compute_clips_for_video(torch.arange(num_frames), frames_per_clip, step, fps, frame_rate)
    return clips.tolist()


@pytest.mark.parametrize(("num_frames", "fps", "frames_per_clip", "step", "frame_rate"), [
    (48, 25, 8, 1, None), (48, 25, 8, 8, None), (100, 30, 16, 5, 15), (100, 30, 16, 4, 12),
    (61, 29.97, 8, 3, 10), (40, 10, 8, 2, 25), (7, 25, 8, 1, None),
])
def test_all_makes_torchvisions_clips(num_frames, fps, frames_per_clip, step, frame_rate):
    spec = ClipSpec(frames_per_clip, "all", frame_rate=frame_rate, step_between_clips=step)
    expected = torchvision_clips(num_frames, fps, frames_per_clip, step, frame_rate)
    assert clips_in(num_frames, fps, spec) == len(expected)
    assert [clip_frames(num_frames, fps, spec, k) for k in range(len(expected))] == expected


def test_frame_step_takes_every_nth_frame_of_the_resampled_video():
    spec = ClipSpec(4, "all", frame_step=3, frame_rate=12.5, step_between_clips=2)
    index = resampled(50, 25, 12.5)  # every other frame: 0, 2, ..., 48
    assert index.tolist() == list(range(0, 50, 2))
    assert clip_frames(50, 25, spec, 0) == [0, 6, 12, 18]
    assert clip_frames(50, 25, spec, 1) == [4, 10, 16, 22]
    assert clips_in(50, 25, spec) == (25 - 10) // 2 + 1


def test_uniform_spaces_the_clips_from_end_to_end():
    spec = ClipSpec(10, "uniform", clips_per_video=3)
    starts = [clip_frames(100, 25, spec, k)[0] for k in range(3)]
    assert starts == [0, 45, 90]  # 91 possible starts, first and last used
    assert clip_frames(100, 25, spec, 2)[-1] == 99
    middle = ClipSpec(10, "uniform")
    assert clip_frames(100, 25, middle, 0) == list(range(45, 55))


def test_random_draws_from_torchs_generator_and_stays_in_the_video():
    spec = ClipSpec(8, "random", frame_step=2)
    torch.manual_seed(3)
    first = [clip_frames(40, 25, spec, 0) for _ in range(50)]
    torch.manual_seed(3)
    again = [clip_frames(40, 25, spec, 0) for _ in range(50)]
    assert first == again
    starts = {clip[0] for clip in first}
    assert len(starts) > 5 and min(starts) >= 0
    assert all(clip[-1] <= 39 and clip == list(range(clip[0], clip[0] + 16, 2)) for clip in first)
    torch.manual_seed(0)
    assert {clip_frames(25, 25, spec, 0)[0] for _ in range(300)} == set(range(11))  # every start is reachable


def test_a_video_shorter_than_a_clip_names_itself_and_the_fixes():
    spec = ClipSpec(16, "random", frame_step=2)
    message = ("clip.mp4 holds 20 frames at 25 fps, too few for a clip of 16 frames every 2 (it spans 31 frames): "
               "lower frames_per_clip or frame_step, leave the file out, or pass on_error='skip' to the DataLoader "
               "to skip such videos")
    with pytest.raises(ShortVideoError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        clip_frames(20, 25, spec, 0, "clip.mp4")
    assert clips_in(20, 25, ClipSpec(16, "all", frame_step=2)) == 0


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"frames_per_clip": 0}, ValueError, "frames_per_clip must be >= 1, got 0"),
    ({"frames_per_clip": 2.0}, TypeError, "frames_per_clip must be an int >= 1, got 2.0"),
    ({"frames_per_clip": 8, "clips": "every"}, ValueError, "clips must be 'random', 'uniform' or 'all', got 'every'"),
    ({"frames_per_clip": 8, "frame_step": 0}, ValueError, "frame_step must be >= 1, got 0"),
    ({"frames_per_clip": 8, "frame_rate": -5}, ValueError,
     "frame_rate must be None (the video's own) or a number of frames per second > 0, got -5"),
    ({"frames_per_clip": 8, "clips": "all", "clips_per_video": 2}, ValueError,
     "clips_per_video applies to clips='random' and 'uniform'; clips='all' takes every clip, every "
     "step_between_clips frames"),
])
def test_bad_clip_arguments_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error) as info:
        ClipSpec(**kwargs)
    assert str(info.value) == message
