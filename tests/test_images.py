"""ImageFolder: torchvision's parity, uint8 decoding, reduced-size JPEG decoding, Normalize."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms import v2

import aioload
from aioload.images import decode_image


def test_imagefolder_matches_torchvision(image_root):
    ours = aioload.ImageFolder(image_root)
    theirs = torchvision.datasets.ImageFolder(image_root)
    assert ours.classes == theirs.classes
    assert ours.class_to_idx == theirs.class_to_idx
    assert ours.samples == theirs.samples
    assert ours.targets == theirs.targets
    assert len(ours) == len(theirs)
    image, target = ours[5]
    pil, ref_target = theirs[5]
    assert target == ref_target
    assert image.dtype == torch.uint8 and image.shape == (3, pil.height, pil.width)
    reference = torch.from_numpy(np.array(pil)).permute(2, 0, 1)
    assert (image.int() - reference.int()).abs().float().mean() < 2.0


def test_imagefolder_through_the_loader_with_v2_transforms(image_root):
    transform = v2.Compose([v2.RandomResizedCrop(64, antialias=True), v2.RandomHorizontalFlip()])
    dataset = aioload.ImageFolder(image_root, transform)
    with aioload.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, seed=3) as loader:
        labels = []
        for images, targets in loader:
            assert images.shape == (len(targets), 3, 64, 64) and images.dtype == torch.uint8
            labels += targets.tolist()
    assert sorted(labels) == sorted(dataset.targets)


def _jpeg(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_reduced_size_decoding_covers_the_requested_size():
    data = _jpeg(1600, 1200)
    full = decode_image(data)
    reduced = decode_image(data, size=(224, 224))
    assert full.shape == (3, 1200, 1600)
    assert reduced.shape[1] >= 224 and reduced.shape[2] >= 224
    assert reduced.shape[1] <= 1200 // 4, "decoded at 1/4 scale or less"
    # the picture is the same: compare with the full decode resized to the same size
    resized = v2.functional.resize(full, list(reduced.shape[1:]), antialias=True)
    assert (resized.int() - reduced.int()).abs().float().mean() < 6.0


def test_small_images_are_decoded_at_full_size():
    data = _jpeg(300, 200)
    assert decode_image(data, size=(224, 224)).shape == (3, 200, 300)


def test_normalize_on_uint8_matches_float_reference():
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    out = aioload.transforms.Normalize(mean, std)(x)
    reference = v2.functional.normalize(x.float() / 255, mean, std)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    half = aioload.transforms.Normalize(mean, std, dtype=torch.bfloat16, channels_last=True)(x)
    assert half.dtype == torch.bfloat16 and half.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (([0.5], [0.5, 0.5]), ValueError, "mean and std must have the same length, got 1 and 2"),
        (([0.5], [0.0]), ValueError, "std must not contain zeros"),
    ],
)
def test_normalize_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        aioload.transforms.Normalize(*args)


def test_local_files_are_read_where_it_is_cheapest(image_root):
    import asyncio

    auto = aioload.ImageFolder(image_root)
    loop = aioload.ImageFolder(image_root, read_in="loop")
    assert auto._read_in_worker and not loop._read_in_worker
    raw_auto = asyncio.run(auto.read(3))
    raw_loop = asyncio.run(loop.read(3))
    assert isinstance(raw_loop[0], bytes) and not isinstance(raw_auto[0], bytes)
    assert torch.equal(auto.decode(raw_auto)[0], loop.decode(raw_loop)[0])
    transform = v2.RandomResizedCrop(48, antialias=True)
    batches = []
    for read_in in ("worker", "loop"):
        dataset = aioload.ImageFolder(image_root, transform, read_in=read_in)
        with aioload.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, seed=5) as loader:
            batches.append(list(loader))
    for (a, ta), (b, tb) in zip(*batches):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def test_read_in_is_validated(image_root):
    with pytest.raises(ValueError, match="^read_in must be 'auto', 'loop' or 'worker', got 'gpu'$"):
        aioload.ImageFolder(image_root, read_in="gpu")
