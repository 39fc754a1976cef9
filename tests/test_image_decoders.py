"""decode_image: torchcodec's decoders where installed (torch >= 2.11), torchvision's operator
otherwise, the same pixels from both; the reduced-size JPEG decode unchanged."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from aioload import images
from aioload.images import decode_image


def encoded(fmt: str, mode: str = "RGB", **save) -> bytes:
    rng = np.random.default_rng(0)
    pixels = (rng.random((90, 120, 3)) * 60 + np.linspace(0, 180, 120)[None, :, None]).astype(np.uint8)
    image = Image.fromarray(pixels)
    image = image.convert(mode) if mode != "RGBA" else Image.fromarray(np.dstack([pixels, pixels[..., :1]]))
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


FILES = {
    "jpeg": encoded("JPEG", quality=90),
    "jpeg-gray": encoded("JPEG", "L"),
    "jpeg-cmyk": encoded("JPEG", "CMYK"),
    "jpeg-progressive": encoded("JPEG", progressive=True),
    "png": encoded("PNG"),
    "png-rgba": encoded("PNG", "RGBA"),
    "png-palette": encoded("PNG", "P"),
    "webp": encoded("WEBP"),
    "gif": encoded("GIF"),
}


def torchvision_op(data: bytes) -> torch.Tensor:
    return torch.ops.image.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), 3, False)


@pytest.fixture
def torchvision_only(monkeypatch):
    """decode_image as on a machine without torchcodec (or with torch < 2.11)."""
    monkeypatch.setattr(images, "_TORCHCODEC", False)
    assert images.torchcodec_images() is None


def test_torchcodec_decodes_where_it_can():
    import torchcodec.decoders

    assert images.torchcodec_images() is torchcodec.decoders  # torch 2.14 and torchcodec 0.17 here


@pytest.mark.parametrize("name", sorted(FILES))
def test_both_decoders_give_torchvisions_pixels(name, monkeypatch):
    expected = torchvision_op(FILES[name])
    assert expected.shape == (3, 90, 120)
    assert torch.equal(decode_image(FILES[name]), expected)
    monkeypatch.setattr(images, "_TORCHCODEC", False)
    assert torch.equal(decode_image(FILES[name]), expected)


def test_the_reduced_jpeg_decode_is_pillows_draft_bit_for_bit():
    big = Image.fromarray((np.random.default_rng(1).random((800, 1000, 3)) * 255).astype(np.uint8))
    out = io.BytesIO()
    big.save(out, "JPEG", quality=85)
    data = out.getvalue()
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", (224, 224))
        expected = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
    reduced = decode_image(data, size=(224, 224))
    assert reduced.shape == (3, 400, 500) and torch.equal(reduced, expected)
    assert decode_image(data).shape == (3, 800, 1000)


@pytest.mark.parametrize("backend", ["torchcodec", "torchvision"])
def test_bytes_that_are_no_image_raise_runtime_error(backend, monkeypatch):
    if backend == "torchvision":
        monkeypatch.setattr(images, "_TORCHCODEC", False)
    with pytest.raises(RuntimeError, match=r"^not an image format aioload decodes \(it begins b'not an i'\): JPEG, "
                                           r"PNG, WebP, GIF and every format Pillow reads"):
        decode_image(b"not an image at all" * 4)
    with pytest.raises(RuntimeError, match="(?i)truncated|incomplete"):
        decode_image(FILES["jpeg"][:200])


def test_the_fallback_emits_no_deprecation_warning(torchvision_only):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_image(FILES["png"]).shape == (3, 90, 120)


def test_before_torch_2_11_torchvisions_operator_decodes(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.setattr(images, "_TORCHCODEC", None)  # looked for again, under the older torch
    assert images.torchcodec_images() is None
    assert torch.equal(decode_image(FILES["jpeg"]), torchvision_op(FILES["jpeg"]))


def test_building_an_image_dataset_looks_the_decoder_up_so_forked_workers_inherit_it(tmp_path):
    """The lookup (importing torchcodec: 0.1-0.5 s) happens where the dataset is built, so a
    worker forked from that process decodes its first sample without importing anything."""
    import subprocess
    import sys

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(FILES["png"])
    probe = (
        "import sys, aioload\n"
        "before = 'torchcodec.decoders' in sys.modules\n"
        f"ds = aioload.ImageFolder({str(tmp_path)!r})\n"
        "print(before, 'torchcodec.decoders' in sys.modules, aioload.images.torchcodec_images() is not None)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    before, after, usable = (word == "True" for word in out)
    assert not before  # importing aioload does not import it
    assert after == usable  # building the dataset did, wherever torchcodec can decode here
