"""Image datasets and decoding: JPEG/PNG bytes to uint8 ``C, H, W`` tensors in the workers.

Decoding uses ``torchvision.io`` (libjpeg-turbo). When ``decode_size`` says the transform only
needs a much smaller image, JPEGs are decoded at 1/2, 1/4 or 1/8 scale in the DCT domain
(Pillow's ``draft``), which is several times cheaper than decoding at full size and resizing.
Images stay uint8 until the device, where :class:`aioload.transforms.Normalize` converts them.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable

import numpy as np
import torch
import torchvision.io
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from aioload._dataset import Dataset
from aioload._storage import read_bytes, read_bytes_blocking

__all__ = ["ImageFolder", "decode_image"]

_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(data: bytes | bytearray | memoryview, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode image bytes to a uint8 RGB tensor of shape ``(3, H, W)``.

    With ``size=(h, w)``, a JPEG at least twice as large in both sides is decoded at a reduced
    scale that still covers ``size`` (never smaller than asked).
    """
    if size is not None and bytes(data[:3]) == _JPEG_MAGIC:
        reduced = _decode_jpeg_reduced(data, size)
        if reduced is not None:
            return reduced
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return torchvision.io.decode_image(buf, mode=torchvision.io.ImageReadMode.RGB)


def _decode_jpeg_reduced(data, size: tuple[int, int]) -> torch.Tensor | None:
    from PIL import Image

    h, w = size
    with Image.open(io.BytesIO(data)) as im:
        if im.width < 2 * w or im.height < 2 * h:
            return None
        im.draft("RGB", (w, h))
        rgb = im.convert("RGB")
        arr = np.asarray(rgb)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


class ImageFolder(Dataset):
    """``torchvision.datasets.ImageFolder``, read by the event loop and decoded in the workers.

    Same ``classes``, ``class_to_idx``, ``samples``, ``targets`` and order as torchvision's.
    A sample is ``(image, target)`` where ``image`` is a uint8 ``(3, H, W)`` tensor (RGB), so
    ``torchvision.transforms.v2`` pipelines apply directly. ``decode_size=(h, w)``: the
    smallest image the transform needs, which lets large JPEGs decode at reduced scale.

    Paths are kept in one numpy array rather than a list of Python strings, so forked workers
    do not copy the list page by page as reference counts change (the copy-on-read problem).
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None, *, is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False, decode_size: tuple[int, int] | None = None):
        self.root = os.fspath(root)
        self.transform = transform
        self.target_transform = target_transform
        self.decode_size = decode_size
        self.classes, self.class_to_idx = find_classes(self.root)
        extensions = IMG_EXTENSIONS if is_valid_file is None else None
        samples = make_dataset(self.root, self.class_to_idx, extensions, is_valid_file, allow_empty)
        self.extensions = extensions
        self._paths = np.array([os.fsencode(p) for p, _ in samples], dtype=np.bytes_)
        self._targets = np.array([t for _, t in samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._targets)

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(os.fsdecode(p), int(t)) for p, t in zip(self._paths, self._targets)]

    imgs = samples

    @property
    def targets(self) -> list[int]:
        return self._targets.tolist()

    def path(self, index: int) -> str:
        return os.fsdecode(self._paths[index])

    def describe(self, index: int) -> str:
        return self.path(index)

    async def read(self, index: int) -> tuple[bytes, int]:
        return await read_bytes(self.path(index)), int(self._targets[index])

    def read_blocking(self, index: int) -> tuple[bytes, int]:
        return read_bytes_blocking(self.path(index)), int(self._targets[index])

    def decode(self, raw: tuple[bytes, int]) -> tuple[Any, Any]:
        data, target = raw
        image = decode_image(data, self.decode_size)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        return f"ImageFolder(root={self.root!r}, samples={len(self)}, classes={len(self.classes)})"
