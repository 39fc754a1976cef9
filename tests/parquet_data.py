"""Parquet files for the Parquet tests: the test images written by pyarrow (plain binary
columns, several files and row groups) and by ``datasets`` (its ``Image`` feature, the
``{"bytes", "path"}`` struct), and what pyarrow itself reads from them (the reference)."""

from __future__ import annotations

from pathlib import Path

from tests.shards_data import image_samples

__all__ = ["image_samples", "plain", "reference", "write_datasets", "write_pyarrow"]


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


def reference(paths: list[str], columns: list[str]) -> list[dict]:
    """Every row of the files, in order, as pyarrow reads them."""
    import pyarrow.parquet as pq

    return [row for p in paths for row in pq.read_table(p, columns=columns).to_pylist()]


def plain(row: dict) -> dict:
    """A row with its numpy arrays as lists, to compare with :func:`reference`'s."""
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()}
