"""Seeds derived from (seed, epoch, index): the only inputs that decide order and augmentation."""

from __future__ import annotations

import hashlib
import operator
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


def sample_seed(base_seed: int, index) -> int:
    """The seed of one sample: from the epoch's base seed and the index. A non-integer index
    (a key, a tuple) is mixed in by its ``repr``, stable across processes and runs (unlike
    ``hash``, which Python randomises per process for strings)."""
    try:
        key = operator.index(index)
    except TypeError:
        key = int.from_bytes(hashlib.blake2b(repr(index).encode(), digest_size=8).digest(), "little")
    return derive_seed(base_seed, key)


def seed_everything(seed: int) -> None:
    """Seed torch's default generator, ``random`` and numpy's legacy global generator."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed a worker's RNGs exactly as torch's DataLoader seeds its workers; returns the seed
    ``get_worker_info().seed`` reports. torch and ``random`` get ``base_seed + worker_id``;
    numpy's global generator gets torch's own mix of the two."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(_numpy_state(base_seed, worker_id))
    return seed


def _numpy_state(base_seed: int, worker_id: int):
    try:
        from torch.utils.data._utils.worker import _generate_state
    except ImportError:  # pragma: no cover - every torch this package supports has it
        return derive_seed(base_seed, worker_id) & 0xFFFFFFFF
    return _generate_state(base_seed, worker_id)


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw a base seed the way torch's DataLoader does at the start of every epoch."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
