"""AudioFiles and decode_audio on real WAV, FLAC and MP3 files made here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchcodec.decoders import AudioDecoder

import aioload
from aioload._media.synth import write_sound
from tests.httpserver import Server


@pytest.fixture(scope="module")
def sounds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sounds")
    return {
        "wav": write_sound(root / "tone.wav", 2.0, 22050, channels=2, seed=1),
        "flac": write_sound(root / "tone.flac", 2.0, 22050, channels=2, seed=2),
        "mp3": write_sound(root / "tone.mp3", 2.0, 22050, channels=1, seed=3),
        "short": write_sound(root / "short.wav", 0.25, 16000, channels=1, seed=4),
    }


def full(path, sample_rate: int, mono: bool) -> torch.Tensor:
    """torchcodec's own decode of the whole file, resampled the same way."""
    return AudioDecoder(str(path), sample_rate=sample_rate, num_channels=1 if mono else None).get_all_samples().data


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3"])
@pytest.mark.parametrize(("sample_rate", "mono"), [(22050, False), (16000, True)])
def test_uniform_crops_are_slices_of_the_whole_decode(sounds, kind, sample_rate, mono):
    ds = aioload.AudioFiles([sounds[kind]], [5], sample_rate=sample_rate, seconds=0.5, mono=mono, crops="uniform",
                            crops_per_file=3)
    whole = full(sounds[kind], sample_rate, mono)
    meta = AudioDecoder(str(sounds[kind])).metadata
    promised = int((meta.duration_seconds - (meta.begin_stream_seconds or 0)) * sample_rate)  # the header's
    assert 0 <= promised - whole.shape[1] < sample_rate // 50  # an MP3's header promises a few ms more
    n = sample_rate // 2
    positions = promised - n + 1
    for k in range(3):
        wave, label = ds[k]
        first = round(k * (positions - 1) / 2)
        assert label == 5 and wave.dtype == torch.float32 and wave.shape == (whole.shape[0], n)
        expected = whole[:, first:first + n] if k < 2 else whole[:, -n:]  # the last crop ends with the sound
        # an MP3 decoded from a seek differs from the decode from the start in its first frame
        # (1152 samples: the decoder's overlap has not filled); lossless formats are exact
        settled = 1152 if kind == "mp3" else 0
        assert torch.equal(wave[:, settled:], expected[:, settled:]), (kind, k)
    assert whole.shape[0] == (1 if mono or kind == "mp3" else 2)


def test_a_file_shorter_than_the_crop_is_padded_with_zeros(sounds):
    ds = aioload.AudioFiles([sounds["short"]], sample_rate=16000, seconds=0.5)
    wave = ds[0]
    assert wave.shape == (1, 8000)
    assert torch.equal(wave[:, :4000], full(sounds["short"], 16000, False)) and not wave[:, 4000:].any()


def test_random_crops_are_seeded_per_sample_and_torchs_without_seed(sounds):
    files = [sounds["wav"], sounds["flac"]] * 3
    ds = aioload.AudioFiles(files, list(range(6)), sample_rate=8000, seconds=0.25, mono=True)

    def run(**kwargs):
        with aioload.DataLoader(ds, batch_size=2, shuffle=True, **kwargs) as loader:
            return list(loader)

    def same(a, b):
        return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))

    seeded = run(num_workers=2, seed=1)
    assert same(seeded, run(num_workers=0, seed=1)) and not same(seeded, run(num_workers=2, seed=2))
    ours = run(num_workers=2, generator=torch.Generator().manual_seed(3))
    torchs = list(torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2,
                                              generator=torch.Generator().manual_seed(3)))
    assert same(ours, torchs)
    starts = set()
    for wave, label in ((w, l) for batch in seeded for w, l in zip(*batch)):
        whole = full(files[int(label)], 8000, True)[0]
        found = [s for s in range(whole.shape[0] - 2000 + 1) if torch.equal(whole[s:s + 2000], wave[0])]
        assert found, int(label)
        starts.add(found[0])
    assert len(starts) > 1


def test_remote_files_are_read_whole_and_decode_as_local_ones(sounds):
    with Server(sounds["wav"].parent) as server:
        remote = aioload.AudioFiles([server.url("tone.flac"), server.url("tone.mp3")], sample_rate=16000,
                                    seconds=0.5, mono=True, crops="uniform", crops_per_file=2)
        local = aioload.AudioFiles([sounds["flac"], sounds["mp3"]], sample_rate=16000, seconds=0.5, mono=True,
                                   crops="uniform", crops_per_file=2)
        with aioload.DataLoader(remote, batch_size=4, num_workers=1) as loader:
            (waves,) = list(loader)
        assert torch.equal(waves, torch.stack([local[i] for i in range(4)]))
        assert server.ranges == [] and server.requests["tone.flac"] == 2 and server.requests["tone.mp3"] == 2


def test_decode_audio_from_bytes_equals_the_dataset(sounds):
    data = sounds["flac"].read_bytes()
    ds = aioload.AudioFiles([sounds["flac"]], sample_rate=11025, seconds=0.3, crops="uniform", crops_per_file=4)
    assert torch.equal(aioload.decode_audio(data, sample_rate=11025, seconds=0.3, crops="uniform", crop=3,
                                            crops_per_file=4), ds[3])
    assert ds.describe(3) == str(sounds["flac"]) and ds.targets is None and len(ds) == 4


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"sample_rate": 0, "seconds": 1.0}, ValueError, "sample_rate must be an int >= 1 (samples per second), got 0"),
    ({"sample_rate": 8000, "seconds": 0}, ValueError, "seconds must be a number > 0 (the length of every crop), got 0"),
    ({"sample_rate": 8000, "seconds": 1.0, "crops": "all"}, ValueError, "crops must be 'random' or 'uniform', got 'all'"),
    ({"sample_rate": 8000, "seconds": 1.0, "mono": 1}, TypeError, "mono must be True or False, got 1"),
    ({"sample_rate": 8000, "seconds": 1.0, "crops_per_file": 0}, ValueError, "crops_per_file must be >= 1, got 0"),
])
def test_bad_arguments_are_refused(sounds, kwargs, error, message):
    with pytest.raises(error) as info:
        aioload.AudioFiles([sounds["wav"]], **kwargs)
    assert str(info.value) == message
