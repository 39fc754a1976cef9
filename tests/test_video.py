"""VideoFolder / VideoFiles on real H.264 (and VP9) files made here: clips, transforms, seeding,
resume, probing, decoder reuse and the in-memory API."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torchcodec.decoders import VideoDecoder
from torchvision.transforms import v2

import aioload
from aioload._media import decoders as _decoders
from tests.media_data import SIZE, folder, video


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return folder(tmp_path_factory.mktemp("videos"))  # 6 videos, 48, 56, ..., 88 frames, 2 classes


def own_frames(path, frames: list[int]) -> torch.Tensor:
    """What torchcodec itself gives for ``frames`` (its default, exact seek mode)."""
    return VideoDecoder(str(path)).get_frames_at(frames).data


def test_the_folder_reads_as_torchvisions_and_a_sample_is_a_uint8_clip(root):
    ds = aioload.VideoFolder(root, 8)
    assert ds.classes == ["class_000", "class_001"] and ds.class_to_idx == {"class_000": 0, "class_001": 1}
    assert [Path(p).name for p, _ in ds.samples] == [f"video_{i:06d}.mp4" for i in (0, 2, 4, 1, 3, 5)]
    assert ds.targets == [0, 0, 0, 1, 1, 1] and len(ds) == 6
    frames, label = ds[4]
    assert frames.dtype == torch.uint8 and frames.shape == (8, 3, *SIZE) and label == 1
    assert repr(ds) == f"VideoFolder(root={str(root)!r}, videos=6, classes=2, clips='random', samples=6)"


def test_uniform_clips_are_torchcodecs_own_frames(root):
    ds = aioload.VideoFolder(root, 8, "uniform", clips_per_video=3, frame_step=2)
    assert len(ds) == 18 and ds.targets == [0] * 9 + [1] * 9
    for index in range(len(ds)):
        video_index, k = divmod(index, 3)
        path = ds.samples[video_index][0]
        count = len(VideoDecoder(path)) - 15 + 1  # starts a clip of 8 frames every 2 (15 frames) can take
        start = round(k * (count - 1) / 2)
        frames, _ = ds[index]
        assert torch.equal(frames, own_frames(path, list(range(start, start + 16, 2)))), index


def test_all_clips_are_every_clip_with_a_stride(root):
    ds = aioload.VideoFolder(root, 8, "all", step_between_clips=6)
    counts = [(len(VideoDecoder(p)) - 8) // 6 + 1 for p, _ in ds.samples]
    assert len(ds) == sum(counts) and ds.metadata == [(len(VideoDecoder(p)), 25.0) for p, _ in ds.samples]
    index = 0
    for video_index, count in enumerate(counts):
        for k in (0, count - 1):
            frames, label = ds[index + k]
            assert ds.clip_of(index + k) == (video_index, k)
            assert label == ds.samples[video_index][1]
            assert torch.equal(frames, own_frames(ds.samples[video_index][0], list(range(6 * k, 6 * k + 8))))
        index += count
    assert ds.describe(1) == f"{ds.samples[0][0]}, clip 1"


def test_metadata_from_an_earlier_run_skips_the_probe(root, tmp_path):
    ds = aioload.VideoFolder(root, 8, "all", step_between_clips=6)
    missing = [str(tmp_path / f"gone_{i}.mp4") for i in range(6)]  # nothing to probe: any open would fail
    again = aioload.VideoFiles(missing, list(range(6)), frames_per_clip=8, clips="all", step_between_clips=6,
                               metadata=ds.metadata)
    assert len(again) == len(ds) and again.metadata == ds.metadata
    with pytest.raises(ValueError, match=r"^metadata must hold one \(num_frames, fps\) pair per video: got shape "
                                         r"\(5, 2\) for 6 videos$"):
        aioload.VideoFiles(missing, frames_per_clip=8, clips="all", metadata=ds.metadata[:5])


def test_frame_rate_resamples_before_the_clip_is_cut(root):
    path = str(sorted(root.rglob("*.mp4"))[0])  # 48 frames at 25 fps
    ds = aioload.VideoFiles([path], frames_per_clip=6, clips="all", frame_rate=12.5, frame_step=2)
    assert len(ds) == 24 - 11 + 1  # 24 frames at 12.5 fps; a clip spans 11 of them
    assert torch.equal(ds[3], own_frames(path, [6, 10, 14, 18, 22, 26]))
    up = aioload.VideoFiles([path], frames_per_clip=4, clips="all", frame_rate=50)
    assert torch.equal(up[1], own_frames(path, [0, 1, 1, 2]))  # upsampled: frames repeat


def test_the_transform_applies_one_crop_to_every_frame(root):
    seen = []

    def crop(clip):
        seen.append(tuple(clip.shape))
        return v2.RandomCrop(24)(clip)

    ds = aioload.VideoFolder(root, 8, "uniform", transform=crop)
    torch.manual_seed(1)
    out, _ = ds[0]
    assert seen == [(8, 3, *SIZE)] and out.shape == (8, 3, 24, 24)
    full = own_frames(ds.samples[0][0], list(range(20, 28)))  # the middle clip of 48 frames
    spots = [(y, x) for y in range(SIZE[0] - 23) for x in range(SIZE[1] - 23)
             if torch.equal(full[0, :, y:y + 24, x:x + 24], out[0])]
    assert len(spots) == 1
    y, x = spots[0]
    assert torch.equal(full[:, :, y:y + 24, x:x + 24], out)


def batches(ds, **kwargs) -> list:
    with aioload.DataLoader(ds, batch_size=2, shuffle=True, **kwargs) as loader:
        return list(loader)


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_seeded_random_clips_do_not_depend_on_the_workers_and_change_per_epoch(root):
    tf = v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()])
    ds = aioload.VideoFolder(root, 8, transform=tf)
    in_process = batches(ds, num_workers=0, seed=4)
    assert equal(in_process, batches(ds, num_workers=2, seed=4))
    assert not equal(in_process, batches(ds, num_workers=2, seed=5))
    with aioload.DataLoader(ds, batch_size=2, shuffle=False, num_workers=2, seed=4) as loader:
        first, second = list(loader), list(loader)  # epochs 0 and 1: other clips, other crops
    assert not equal(first, second)


def test_without_seed_the_clips_are_torchs_dataloaders(root):
    ds = aioload.VideoFolder(root, 8, "random", clips_per_video=2, frame_step=3)
    ours = batches(ds, num_workers=2, generator=torch.Generator().manual_seed(11))
    torchs = list(torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2,
                                              generator=torch.Generator().manual_seed(11)))
    assert equal(ours, torchs)


def test_a_resumed_loader_delivers_the_rest_of_the_epoch_exactly(root):
    ds = aioload.VideoFolder(root, 8, "random", clips_per_video=2)
    full = batches(ds, num_workers=2, seed=9)
    with aioload.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, seed=9) as loader:
        it = iter(loader)
        head = [next(it), next(it)]
        state = loader.state_dict()
    with aioload.DataLoader(ds, batch_size=2, shuffle=True, num_workers=1, seed=9) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert equal(head + rest, full)


def test_decoders_are_kept_per_file_and_bounded(root):
    paths = [p for p, _ in aioload.VideoFolder(root, 8).samples]
    kept = _decoders.Decoders(kept=2)
    first = kept.video(paths[0], paths[0], "approximate")
    assert kept.video(paths[0], paths[0], "approximate") is first and len(kept) == 1
    kept.video(paths[1], paths[1], "approximate")
    kept.video(paths[2], paths[2], "approximate")
    assert len(kept) == 2 and kept.video(paths[0], paths[0], "approximate") is not first  # evicted, reopened
    ds = aioload.VideoFolder(root, 8, "uniform", clips_per_video=3)
    _decoders.LOCAL.forget(paths[0])
    before = len(_decoders.LOCAL)
    for i in range(3):
        ds[i]  # three clips of one video: one decoder
    assert len(_decoders.LOCAL) == min(_decoders.KEPT, before + 1)


def test_a_vp9_webm_decodes_like_h264(tmp_path):
    path = video(tmp_path / "clip.webm", 24, seed=3, codec="libvpx-vp9")
    ds = aioload.VideoFiles([path], [7], frames_per_clip=6, clips="uniform", clips_per_video=2)
    assert VideoDecoder(str(path)).metadata.codec == "vp9"
    clip, label = ds[1]
    assert label == 7 and torch.equal(clip, own_frames(path, list(range(18, 24))))


def test_clips_from_bytes_equal_the_datasets(root):
    path = sorted(root.rglob("*.mp4"))[1]
    data = path.read_bytes()
    ds = aioload.VideoFiles([path], frames_per_clip=8, clips="uniform", clips_per_video=4)
    for source in (data, memoryview(data), torch.frombuffer(bytearray(data), dtype=torch.uint8), io.BytesIO(data)):
        assert torch.equal(aioload.decode_clip(source, 8, clips="uniform", clip=2, clips_per_video=4), ds[2])
    assert aioload.count_clips(data, 8, step_between_clips=4) == (len(VideoDecoder(str(path))) - 8) // 4 + 1
    torch.manual_seed(2)
    drawn = aioload.decode_clip(data, 8)
    torch.manual_seed(2)
    random = aioload.VideoFiles([path], frames_per_clip=8)
    assert torch.equal(drawn, random[0])  # the same draw from the same generator state
    with pytest.raises(TypeError, match="^data must be the encoded file as bytes, a memoryview, a 1-D uint8 tensor "
                                        "or a seekable file object, got str$"):
        aioload.decode_clip(str(path), 8)


def test_bad_dataset_arguments_are_refused(root):
    with pytest.raises(ValueError, match="^seek_mode must be 'approximate' or 'exact', got 'fast'$"):
        aioload.VideoFolder(root, 8, seek_mode="fast")
    with pytest.raises(TypeError, match="^paths_or_urls must be a sequence of paths or URLs, not a single one"):
        aioload.VideoFiles(str(root), frames_per_clip=8)
    with pytest.raises(ValueError, match=r"^labels must hold one label per path: got \(2,\) labels for 3 paths$"):
        aioload.VideoFiles(["a.mp4", "b.mp4", "c.mp4"], [0, 1], frames_per_clip=8)
    with pytest.raises(ValueError, match="^VideoFolder needs a root it can list"):
        aioload.VideoFolder("http://127.0.0.1:1/videos", 8)


def test_before_torch_2_11_a_video_dataset_says_what_to_upgrade(root, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.setattr(_decoders, "_TORCHCODEC", None)
    with pytest.raises(ImportError, match=r"^video and audio decoding needs torchcodec, which needs torch >= 2\.11 "
                                          r"\(this is torch 2\.10\.0\): upgrade torch, then pip install "
                                          r"'aioload\[video\]'$"):
        aioload.VideoFolder(root, 8)
    with pytest.raises(ImportError, match="^video and audio decoding needs torchcodec, which needs torch >= 2.11"):
        aioload.AudioFiles(["a.wav"], sample_rate=8000, seconds=1.0)
