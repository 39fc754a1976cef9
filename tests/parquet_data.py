"""Parquet files for the Parquet tests: the test images written by pyarrow (plain binary
columns, several files and row groups) and by ``datasets`` (its ``Image`` feature, the
``{"bytes", "path"}`` struct), and what pyarrow itself reads from them (the reference)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tests.shards_data import image_samples

__all__ = ["image_samples", "pil_pixels", "plain", "reference", "write_by_path", "write_datasets", "write_pyarrow"]


def write_pyarrow(samples, folder: Path, per_file: int, row_group_size: int, **options) -> list[str]:
    """Files ``part-NNN.parquet`` of ``per_file`` rows each (``key``, ``image`` bytes, ``label``,
    ``tokens``: a list of ints as long as the key), in row groups of ``row_group_size``
    (``options``: more of ``pq.write_table``'s, a page index say)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, at in enumerate(range(0, len(samples), per_file)):
        part = samples[at:at + per_file]
        table = pa.table({"key": [k for k, _, _ in part], "image": pa.array([d for _, d, _ in part], pa.binary()),
                          "label": [t for _, _, t in part],
                          "tokens": [[ord(c) for c in k] for k, _, _ in part]})
        path = folder / f"part-{n:03d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size, **options)
        paths.append(str(path))
    return paths


def write_datasets(samples, path: Path, batch_size: int) -> str:
    """One file written by ``datasets``' ``to_parquet`` with an ``Image`` and a ``ClassLabel``
    feature, ``batch_size`` rows per row group."""
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=3),
                                  "key": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": d, "path": None} for _, d, _ in samples],
                                     "label": [t for _, _, t in samples], "key": [k for k, _, _ in samples]},
                                    features=features)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path), batch_size=batch_size)
    return str(path)


def write_by_path(paths: list[str], labels: list[int], target: Path, writer: str) -> str:
    """One file whose ``image`` column holds paths, not bytes (``{"bytes": None, "path": p}``):
    written by ``datasets`` (``Image()`` cast from the paths, then ``to_parquet``, which keeps
    them as they are) or by pyarrow (the same struct, without ``datasets``' metadata: pass
    ``images=``). Relative paths are relative
    to ``target``'s folder (``datasets`` checks them from there while it writes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if writer == "pyarrow":
        import pyarrow as pa
        import pyarrow.parquet as pq

        image = pa.array([{"bytes": None, "path": p} for p in paths],
                         pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
        pq.write_table(pa.table({"image": image, "label": labels}), target, row_group_size=5, write_page_index=True)
        return str(target)
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"image": paths, "label": labels}).cast_column("image", datasets.Image())
    here = os.getcwd()
    os.chdir(target.parent)  # datasets sizes the files while it writes: relative paths from there
    try:
        ds.to_parquet(str(target), batch_size=5)
    finally:
        os.chdir(here)
    return str(target)


def pil_pixels(path) -> torch.Tensor:
    """An image file's pixels as PIL decodes them, uint8 ``(3, H, W)``."""
    from PIL import Image

    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def reference(paths: list[str], columns: list[str]) -> list[dict]:
    """Every row of the files, in order, as pyarrow reads them."""
    import pyarrow.parquet as pq

    return [row for p in paths for row in pq.read_table(p, columns=columns).to_pylist()]


def plain(row: dict) -> dict:
    """A row with its numpy arrays as lists, to compare with :func:`reference`'s."""
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}


# -- crafting corrupt files: Thrift's compact protocol written back -----------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _kind(value) -> int:
    if isinstance(value, bool):
        return 1 if value else 2
    if isinstance(value, int):
        return 5 if -(1 << 31) <= value < 1 << 31 else 6
    return {bytes: 8, list: 9, dict: 12}[type(value)]


def _element(value) -> bytes:
    if isinstance(value, bool):
        return b"\x01" if value else b"\x02"
    return _value(value)


def _value(value) -> bytes:
    if isinstance(value, bool):
        return b""
    if isinstance(value, int):
        return _zigzag(value)
    if isinstance(value, bytes):
        return _varint(len(value)) + value
    if isinstance(value, list):
        kind = _kind(value[0]) if value else 5
        head = bytes([len(value) << 4 | kind]) if len(value) < 15 else bytes([0xF0 | kind]) + _varint(len(value))
        return head + b"".join(_element(v) for v in value)
    return compact(value)


def compact(struct: dict) -> bytes:
    """``{field id: value}`` (as :func:`aioload._parquet.thrift.read_struct` reads it) in the
    compact protocol: ints as i32 where they fit, else i64."""
    out, last = bytearray(), 0
    for key in sorted(struct):
        value = struct[key]
        delta = key - last
        out += bytes([delta << 4 | _kind(value)]) if 0 < delta <= 15 else bytes([_kind(value)]) + _zigzag(key)
        out += _value(value)
        last = key
    return bytes(out) + b"\x00"


def rewrite_struct(data: bytes, at: int, change) -> bytes:
    """``data`` with the struct at byte ``at`` read, changed in place by ``change(struct)`` and
    written back; the new encoding must be as long as the old (nothing after it moves)."""
    from aioload._parquet.thrift import read_struct

    struct, end = read_struct(data, at)
    change(struct)
    new = compact(struct)
    if len(new) != end - at:
        raise ValueError(f"the changed struct takes {len(new)} bytes, the old {end - at}: pick values of the same "
                         "encoded length")
    return data[:at] + new + data[end:]
