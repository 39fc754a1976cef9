"""Seeds derived from (seed, epoch, index): the only inputs that decide order and augmentation."""

from __future__ import annotations

import hashlib
import random
import struct

import torch

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel
    np = None

_MASK = (1 << 63) - 1


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed; equal inputs give equal seeds on every platform."""
    data = struct.pack(f"<{len(parts)}q", *(p & _MASK for p in parts))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK


def seed_everything(seed: int) -> None:
    """Seed torch's default generator, ``random`` and numpy's legacy global generator."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw a base seed the way torch's DataLoader does at the start of every epoch."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
