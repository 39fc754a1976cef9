"""Seeds derived from (seed, epoch, index): the only inputs that decide order and augmentation;
and a worker's random streams as plain data (a persistent worker's, carried by a saved state)."""

from __future__ import annotations

import base64
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


# -- a worker's random streams ------------------------------------------------------------
# Persistent workers' streams go on from epoch to epoch (as torch's do): a state saved between
# epochs carries each worker's streams as they are (its seed, torch's, ``random``'s and numpy's
# global generators), and a resumed epoch's workers take them back (see aioload._plan.resume).
_RANDOM = struct.Struct("<625I?d")  # random.getstate(): 624 words and the index, then gauss_next
_NUMPY = struct.Struct("<624IIid")  # numpy's legacy MT19937: words, position, has_gauss, cached


def capture_streams(seed: int) -> dict:
    """This process's random streams as plain data: ``{"seed", "torch", "random", "numpy"}``
    (``seed``: what ``get_worker_info().seed`` reports; the rest base64)."""
    version, words, gauss = random.getstate()
    packed_random = _RANDOM.pack(*words, gauss is not None, gauss or 0.0)
    packed_numpy = None
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        packed_numpy = _b64(_NUMPY.pack(*keys.tolist(), pos, has_gauss, cached))
    return {"seed": seed, "torch": _b64(torch.get_rng_state().numpy().tobytes()), "random": _b64(packed_random),
            "numpy": packed_numpy}


def restore_streams(record: dict) -> None:
    """Give this process the streams :func:`capture_streams` saved (checked by :func:`check_streams`)."""
    parts = _decoded(record)
    torch.set_rng_state(parts[0])
    random.setstate(parts[1])
    if np is not None and parts[2] is not None:
        np.random.set_state(parts[2])


def check_streams(record: dict) -> None:
    """Raise ``ValueError`` where ``record`` (its keys checked by the caller) is not a set of
    streams :func:`restore_streams` can give back; nothing is changed."""
    torch_state, random_state, numpy_state = _decoded(record)
    torch.Generator().set_state(torch_state)
    random.Random().setstate(random_state)
    if numpy_state is not None and np is not None:
        np.random.RandomState().set_state(numpy_state)


def _decoded(record: dict) -> tuple:
    torch_state = torch.frombuffer(bytearray(_unb64(record["torch"])), dtype=torch.uint8)
    raw = _unb64(record["random"])
    if len(raw) != _RANDOM.size:
        raise ValueError(f"'random' must decode to {_RANDOM.size} bytes, got {len(raw)}")
    *words, has_gauss, gauss = _RANDOM.unpack(raw)
    random_state = (3, tuple(words), gauss if has_gauss else None)
    numpy_state = None
    if record["numpy"] is not None:
        raw = _unb64(record["numpy"])
        if len(raw) != _NUMPY.size:
            raise ValueError(f"'numpy' must decode to {_NUMPY.size} bytes, got {len(raw)}")
        *keys, pos, has_gauss, cached = _NUMPY.unpack(raw)
        if np is not None:
            numpy_state = ("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    return torch_state, random_state, numpy_state


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"must be a base64 string, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)
