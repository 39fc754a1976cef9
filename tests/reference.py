"""Independent references for what aioload computes: images decoded by Pillow, not by aioload."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def pil_image(data: bytes) -> torch.Tensor:
    """``data`` decoded by Pillow to a uint8 ``(3, H, W)`` RGB tensor, as aioload.decode_image
    should give it."""
    with Image.open(io.BytesIO(data)) as im:
        return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
