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

from aioload._shards.index import ShardError

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


def decode_sample(sample: Mapping[str, Any], decoders: Mapping[str, Decoder] | None = None) -> dict[str, Any]:
    """``sample`` (``{"__key__": ..., "jpg": bytes, "cls": bytes, ...}``, as a WebDataset
    shard holds it) with each member decoded by its extension: images to uint8 ``(3, H, W)``
    tensors, ``cls``/``idx``/... to ``int``, ``txt`` to ``str``, ``json`` to its value,
    ``npy`` and ``pth`` to tensors; members without a decoder stay ``bytes``. ``decoders``
    (by extension) replaces the defaults of :attr:`aioload.WebDataset.decoders`.

    A member that does not decode raises :class:`aioload.ShardError` naming the member and
    its shard."""
    from aioload._shards.dataset import WebDataset

    table = WebDataset.decoders if decoders is None else decoders
    out: dict[str, Any] = {}
    for ext, value in sample.items():
        fn = None if ext.startswith("__") else decoder_for(ext, table)
        if fn is None:
            out[ext] = value
            continue
        try:
            out[ext] = fn(value)
        except Exception as exc:
            where = f"member {sample.get('__key__', '?')}.{ext} of shard {sample.get('__url__', '?')}"
            raise ShardError(f"{where} does not decode as {ext!r} ({type(exc).__name__}: {exc}); the shard may be "
                             "corrupt, or give decoders={...} a function for this extension") from exc
    return out
