"""decode_device=: JPEGs delivered encoded, decoded in one batched call, transformed where they
were decoded.

The CUDA half (nvJPEG, the side stream, the consumer's stream waiting on an event) runs only
where a CUDA device exists. The rest of the path -- what the workers deliver, the batched decode
with its fallbacks, the per-sample seeding of the transforms, skipping, stacking -- does not
depend on the device, and runs everywhere with the decode pointed at the CPU: the dataset is
built without a device, then given ``decode_device = torch.device("cpu")``, which the public
argument refuses (the workers already decode on the CPU).
"""

from __future__ import annotations

import io
import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

import aioload
from aioload._data.synth import make_image_folder
from tests.reference import pil_image

ROOT = Path(__file__).resolve().parent.parent
CROP = v2.Compose([v2.RandomResizedCrop(48, antialias=True), v2.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("gpu-images"), images=30, classes=3, seed=4)


def on_cpu(dataset):
    """The device-independent half of decode_device=, run with the decode on the CPU."""
    dataset.decode_device = torch.device("cpu")
    return dataset


def epochs(dataset, epochs: int = 2, **kwargs) -> list:
    kwargs.setdefault("batch_size", 8)
    with aioload.DataLoader(dataset, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for epoch_got, epoch_expected in zip(got, expected):
        assert len(epoch_got) == len(epoch_expected)
        for a, b in zip(epoch_got, epoch_expected):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and torch.equal(x, y)


# -- construction -------------------------------------------------------------------------------
_NO_CUDA = """
import aioload, sys
try:
    aioload.ImageFolder(sys.argv[1], decode_device="cuda")
except RuntimeError as exc:
    print(exc)
"""


def test_decode_device_cuda_without_cuda_is_refused_at_construction(folder):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _NO_CUDA, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "decode_device='cuda' needs a CUDA GPU, and torch.cuda.is_available() is False in this process: "
        "leave decode_device=None to decode on the CPU in the worker processes")


@pytest.mark.parametrize("value, message", [
    ("cpu", "decode_device='cpu': only CUDA devices decode JPEGs here; leave decode_device=None to decode on "
            "the CPU in the worker processes"),
    ("gpu!", "decode_device must be None or a CUDA device such as 'cuda' or 'cuda:1', got 'gpu!'"),
])
def test_decode_device_that_is_no_cuda_device_is_refused(folder, value, message):
    with pytest.raises(ValueError) as info:
        aioload.ImageFolder(folder, decode_device=value)
    assert str(info.value) == message


# -- the device-independent half ----------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeded_batches_equal_the_cpu_paths(folder, num_workers):
    """With seed=, a sample's crop is drawn from (seed, epoch, index) wherever it runs: the
    batches equal those of the classic path (decode and transform in the workers), bit for bit."""
    expected = epochs(aioload.ImageFolder(folder, CROP), shuffle=True, seed=3, num_workers=2)
    got = epochs(on_cpu(aioload.ImageFolder(folder, CROP)), shuffle=True, seed=3, num_workers=num_workers)
    assert_same_batches(got, expected)
    assert got[0][0][0].shape == (8, 3, 48, 48)


def test_workers_deliver_jpegs_encoded(folder):
    ds = on_cpu(aioload.ImageFolder(folder, CROP))
    payload, target, index = ds.decode(ds.read_nowait(5))
    path, label = aioload.ImageFolder(folder).samples[5]
    assert index == 5 and target == label
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numpy().tobytes() == Path(path).read_bytes()
    image, target = ds[5]  # __getitem__ still decodes and transforms on the CPU
    assert image.shape == (3, 48, 48) and target == label


def test_the_training_loops_random_state_is_left_as_it_was(folder):
    """The transforms draw in the consumer's thread: torch's, random's and numpy's global
    generators must come out of an epoch as if no transform had drawn from them."""
    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    epochs(on_cpu(aioload.ImageFolder(folder, CROP)), epochs=1, seed=1, num_workers=0)
    assert draws() == expected


def test_image_files_without_labels_yield_image_batches(folder):
    paths = [p for p, _ in aioload.ImageFolder(folder).samples][:12]
    (batches,) = epochs(on_cpu(aioload.ImageFiles(paths, transform=v2.CenterCrop(32))), epochs=1, num_workers=1,
                        batch_size=6)
    expected = torch.stack([v2.CenterCrop(32)(pil_image(Path(p).read_bytes())) for p in paths])
    assert [b.shape for b in batches] == [(6, 3, 32, 32)] * 2
    assert torch.equal(torch.cat(batches), expected)


@pytest.fixture
def mixed(tmp_path, folder):
    """JPEGs, a PNG (which nvJPEG cannot read: decoded on the CPU in the worker) and a file that
    claims to be a JPEG but is not one."""
    root = tmp_path / "mixed" / "a"
    root.mkdir(parents=True)
    jpegs = sorted(Path(folder).rglob("*.jpg"))[:5]
    for i, src in enumerate(jpegs):
        (root / f"{i}.jpg").write_bytes(src.read_bytes())
    buf = io.BytesIO()
    Image.open(jpegs[0]).save(buf, format="PNG")
    (root / "5.png").write_bytes(buf.getvalue())
    (root / "6.jpg").write_bytes(b"\xff\xd8\xff" + bytes(range(256)) * 4)  # JPEG magic, no JPEG
    return root.parent


def test_other_formats_are_decoded_in_the_worker(mixed):
    ds = on_cpu(aioload.ImageFolder(mixed, v2.CenterCrop(40)))
    png = ds.decode(ds.read_nowait(5))[0]
    assert png.shape[0] == 3 and png.dim() == 3  # decoded, not bytes
    with aioload.DataLoader(ds, batch_size=6, num_workers=1) as loader:
        images, _ = next(iter(loader))  # indices 0-5; the file that is no JPEG is index 6
    expected = [v2.CenterCrop(40)(pil_image(Path(ds.path(i)).read_bytes())) for i in range(6)]
    assert torch.equal(images, torch.stack(expected))


def test_a_file_no_decoder_reads_raises_naming_it(mixed):
    ds = on_cpu(aioload.ImageFolder(mixed, v2.CenterCrop(40)))
    with aioload.DataLoader(ds, batch_size=7, num_workers=1) as loader:
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
    note = f"while decoding dataset index 6 ({ds.path(6)}) on cpu (decode_device=): neither nvJPEG nor the CPU " \
           "decoder could read it"
    assert note in info.value.__notes__


def test_a_file_no_decoder_reads_is_skipped_with_on_error_skip(mixed, caplog):
    ds = on_cpu(aioload.ImageFolder(mixed, v2.CenterCrop(40)))
    with caplog.at_level(logging.WARNING, logger="aioload"):
        with aioload.DataLoader(ds, batch_size=7, num_workers=1, on_error="skip") as loader:
            (images, targets), = list(loader)
            stats = loader.stats()
    assert images.shape == (6, 3, 40, 40) and targets.tolist() == [0] * 6
    assert stats.skipped == (6,)
    assert any("skipped dataset index 6" in r.getMessage() for r in caplog.records)


def test_a_batched_decode_that_fails_in_any_way_is_retried_image_by_image(folder, monkeypatch):
    from aioload._engine import gpudecode

    expected = epochs(on_cpu(aioload.ImageFolder(folder, CROP)), epochs=1, shuffle=True, seed=3, num_workers=1)

    def refuses(payloads, device):  # as the batched call might on another torchvision: not a RuntimeError
        raise TypeError("decode_jpegs_cuda(): incompatible function arguments")

    monkeypatch.setattr(gpudecode, "_decode_many", refuses)
    got = epochs(on_cpu(aioload.ImageFolder(folder, CROP)), epochs=1, shuffle=True, seed=3, num_workers=1)
    assert_same_batches(got, expected)  # each image decoded alone, by the same decoder


def test_an_epoch_that_ends_while_a_device_copy_runs_waits_for_the_copy(folder, monkeypatch):
    """The epoch's last batch is taken while its device copy still reads its slot: the stop
    that ends the epoch waits for the copy (the slot must not be reused under it), and nothing
    escapes the engine's thread (pytest fails a test on an exception in any thread)."""
    from aioload._engine import gpudecode

    finished = []

    class SlowCopy:  # a device copy that takes half a second
        def query(self) -> bool:
            return bool(finished)

        def synchronize(self) -> None:
            time.sleep(0.5)
            finished.append(threading.current_thread().name)

    start = gpudecode.DecodeTransfer.start
    monkeypatch.setattr(gpudecode.DecodeTransfer, "start", lambda self, batch: (start(self, batch)[0], SlowCopy()))
    with aioload.DataLoader(on_cpu(aioload.ImageFolder(folder, CROP)), batch_size=10, num_workers=1) as loader:
        assert [len(images) for images, _ in loader] == [10, 10, 10]  # taken before their copies end
        assert len(finished) == 3 and all(name.startswith("aioload-io") for name in finished)


def test_an_image_no_decoder_takes_is_named_whatever_the_decoders_raise(mixed, monkeypatch):
    from aioload._engine import gpudecode

    def out_of_memory(payloads, device):
        raise MemoryError("nvJPEG could not allocate its buffers")

    def gives_up(payload, device):
        raise OSError("the device decoder gave up")

    monkeypatch.setattr(gpudecode, "_decode_many", out_of_memory)
    monkeypatch.setattr(gpudecode, "_decode_one", gives_up)
    ds = on_cpu(aioload.ImageFolder(mixed, v2.CenterCrop(40)))
    with aioload.DataLoader(ds, batch_size=7, num_workers=1, on_error="skip") as loader:
        (images, _), = list(loader)  # the JPEGs decoded on the CPU, one by one
        assert images.shape == (6, 3, 40, 40) and loader.stats().skipped == (6,)
    with aioload.DataLoader(ds, batch_size=7, num_workers=1) as loader:
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
    assert (f"while decoding dataset index 6 ({ds.path(6)}) on cpu (decode_device=): neither nvJPEG nor the CPU "
            "decoder could read it") in info.value.__notes__


def test_each_sample_seeds_and_gives_back_every_generator_its_transform_draws_from():
    from aioload._engine import gpudecode

    cpu = torch.device("cpu")
    assert gpudecode.device_generators(cpu) == []  # on a CUDA device: that device's generator too
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with gpudecode.own_rngs(cpu):
        gpudecode.seed_sample(11, cpu)
        first = torch.randn(4), random.random(), float(np.random.rand())
        gpudecode.seed_sample(11, cpu)
        again = torch.randn(4), random.random(), float(np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert torch.equal(torch.get_rng_state(), before)


def test_images_of_different_sizes_after_the_transform_name_the_fix(mixed):
    ds = on_cpu(aioload.ImageFolder(mixed))  # no transform: each image keeps its own size
    ds._paths = ds._paths[:2]
    (Path(ds.path(1))).write_bytes(_resized_jpeg(Path(ds.path(0)), (30, 20)))
    with aioload.DataLoader(ds, batch_size=2, num_workers=0) as loader:
        with pytest.raises(ValueError, match=r"^decode_device= stacks a batch's images, and these differ in size "
                                             r"after the transform .*v2.RandomResizedCrop\(224\)"):
            next(iter(loader))


def _resized_jpeg(path: Path, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.open(path).resize(size).save(buf, format="JPEG")
    return buf.getvalue()


def test_device_and_decode_device_must_agree(folder):
    ds = on_cpu(aioload.ImageFolder(folder, CROP))
    ds.decode_device = torch.device("cuda:0")  # as the dataset would hold it on a GPU machine
    with pytest.raises(ValueError, match=r"^the dataset decodes on cuda:0 \(decode_device=\) but device='cuda:1'"):
        aioload.DataLoader(ds, batch_size=4, device=torch.device("cuda:1"))


# -- on a CUDA device ---------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_a_transform_that_draws_on_the_device_is_seeded_and_leaves_the_training_loops_cuda_generator():
    from aioload._engine import gpudecode

    device = torch.device("cuda")
    (generator,) = gpudecode.device_generators(device)
    torch.cuda.manual_seed(7)
    before = generator.get_state()
    noise = v2.GaussianNoise(sigma=0.5)
    image = torch.zeros(3, 8, 8, device=device)
    with gpudecode.own_rngs(device):
        gpudecode.seed_sample(11, device)
        first = noise(image)
        gpudecode.seed_sample(11, device)
        again = noise(image)
    assert torch.equal(first, again) and not torch.equal(first, image)
    assert torch.equal(generator.get_state(), before)


@needs_cuda
def test_cuda_decode_delivers_batches_on_the_device_close_to_the_cpu_decode(folder):
    center = v2.CenterCrop(48)
    expected = epochs(aioload.ImageFolder(folder, center), epochs=1, num_workers=2)[0]
    got = epochs(aioload.ImageFolder(folder, center, decode_device="cuda"), epochs=1, num_workers=2)[0]
    assert len(got) == len(expected)
    for (images, targets), (ref_images, ref_targets) in zip(got, expected):
        assert images.device.type == "cuda" and targets.device.type == "cuda"
        assert torch.equal(targets.cpu(), ref_targets)
        # nvJPEG's IDCT is not libjpeg's: close, not equal
        assert (images.cpu().int() - ref_images.int()).abs().float().mean() < 3.0
