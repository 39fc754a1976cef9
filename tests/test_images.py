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


PIL_FORMATS = {".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF", ".ppm": "PPM", ".pgm": "PPM", ".png": "PNG",
               ".webp": "WEBP", ".jpg": "JPEG"}
"""An image of each extension torchvision's ImageFolder lists (``IMG_EXTENSIONS``), as Pillow writes it."""


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "PPM", "TGA", "GIF", "PNG", "WEBP"])
def test_decode_image_reads_what_pillow_reads(fmt):
    pixels = np.random.default_rng(1).integers(0, 256, (31, 45, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    with Image.open(io.BytesIO(out.getvalue())) as im:
        expected = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    assert torch.equal(decode_image(out.getvalue()), expected)


def test_imagefolder_decodes_every_format_it_lists_as_pillow_does(tmp_path):
    # torchvision's ImageFolder lists these extensions and reads them with PIL; so does ours,
    # whose workers decode JPEG/PNG/WebP/GIF with torchcodec and the rest with Pillow
    rng = np.random.default_rng(7)
    for k, (ext, fmt) in enumerate(PIL_FORMATS.items()):
        folder = tmp_path / ("gray" if ext == ".pgm" else "color")
        folder.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).convert("L") if ext == ".pgm" else Image.fromarray(pixels)
        image.save(folder / f"{k}{ext}", fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    theirs = torchvision.datasets.ImageFolder(str(tmp_path))
    ours = aioload.ImageFolder(tmp_path)
    assert ours.samples == theirs.samples and len(ours) == len(PIL_FORMATS)
    with aioload.DataLoader(ours, batch_size=len(ours), num_workers=2) as loader:
        (images, targets), = list(loader)
    for i, (path, target) in enumerate(theirs.samples):
        pil, _ = theirs[i]
        expected = torch.from_numpy(np.array(pil)).permute(2, 0, 1)
        assert int(targets[i]) == target
        assert torch.equal(images[i], expected), path


def test_bytes_no_decoder_reads_raise_an_error_naming_the_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "fine.png").write_bytes(_png())
    (tmp_path / "a" / "notes.bmp").write_bytes(b"these are notes, not a bitmap")
    dataset = aioload.ImageFolder(tmp_path)
    with aioload.DataLoader(dataset, batch_size=1, num_workers=1) as loader:
        with pytest.raises(RuntimeError, match="not an image format aioload decodes") as info:
            list(loader)
    assert "notes.bmp" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()
