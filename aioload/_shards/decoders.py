"""What the default ``decode`` of :class:`aioload.WebDataset` makes of each member, by extension.

:data:`DECODERS` maps an extension to a function of the member's bytes. A member's full
extension is looked up first (``seg.png``), then its last part (``png``); a member with no
decoder stays ``bytes``. Extend it for every dataset (``aioload.WebDataset.decoders["mp4"] =
decode_clip``) or per dataset (``WebDataset(urls, decoders={"mp4": decode_clip})``): video and
audio decoders plug in there.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable, Mapping


Decoder = Callable[[bytes], Any]


def image(data: bytes) -> Any:
    """An image to a uint8 ``(3, H, W)`` tensor (RGB), as :func:`aioload.decode_image`."""
    from aioload.images import decode_image

    return decode_image(data)


def pil_image(data: bytes) -> Any:
    """A format ``torchvision.io`` does not read (PPM, BMP, TIFF) through Pillow, to the same tensor."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im.convert("RGB"))
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def integer(data: bytes) -> int:
    return int(bytes(data).strip())


def text(data: bytes) -> str:
    return bytes(data).decode("utf-8")


def json_value(data: bytes) -> Any:
    return json.loads(data)


def npy(data: bytes) -> Any:
    """A ``.npy`` array as a tensor (no pickled objects)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))


def torch_file(data: bytes) -> Any:
    """A ``torch.save`` file, loaded with ``weights_only=True`` (tensors and plain containers)."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


DECODERS: dict[str, Decoder] = {
    **dict.fromkeys(("jpg", "jpeg", "png", "webp", "gif"), image),
    **dict.fromkeys(("ppm", "pgm", "pbm", "pnm", "bmp", "tif", "tiff"), pil_image),
    **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "idx", "id"), integer),
    **dict.fromkeys(("txt", "text", "transcript"), text),
    **dict.fromkeys(("json", "jsn"), json_value),
    "npy": npy,
    **dict.fromkeys(("pth", "pt"), torch_file),
}
"""The default decoders, by extension (see the module's docstring)."""


def decoder_for(ext: str, decoders: Mapping[str, Decoder]) -> Decoder | None:
    found = decoders.get(ext)
    if found is None and "." in ext:
        found = decoders.get(ext.rsplit(".", 1)[1])
    return found
