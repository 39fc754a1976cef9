"""Hugging Face streaming datasets over local files written by the tests (module level, so the
worker processes and the rank scripts import them too).

:func:`write_files` writes ``files`` Parquet or JSON-lines files of ``rows`` rows each: row
``id`` of file ``f`` is ``f * 1000 + r``, with a ``text`` column. :func:`stream` opens them as
``datasets.load_dataset(..., streaming=True)``, optionally shuffled with a buffer
(``.shuffle(seed, buffer_size)``, which also shuffles the order of the files), and always
``.map``-ped to add a derived column, the pipeline a training recipe builds.

A shuffled Parquet stream reads its files from a thread pool (``datasets`` interleaves up to
10 shards into the buffer) and, when a pass ends or is closed, sleeps
``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`` (5 s) so that pyarrow's own threads can wind
down before the interpreter might exit (apache/arrow#45214, a crash at exit). Every run, stop and
resume of the tests pays that sleep, in each worker: the tests' processes set it to
:data:`THREADS_SHUTDOWN_S`. The rows, their order and the streams' states are the same; a test
process never exits within it (workers leave through ``os._exit``, which runs no destructor;
the rank scripts exit after their files are written and their process group is torn down).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BUFFER = 8  # the shuffle buffer: a few rows, so that a save lands with rows held in it
THREADS_SHUTDOWN_S = 0.2  # what a shuffled Parquet stream sleeps after each pass, instead of 5 s

try:
    import datasets.config
except ImportError:  # the tests that need datasets skip without it
    pass
else:
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = THREADS_SHUTDOWN_S


def write_files(folder: Path, kind: str, files: int = 4, rows: int = 24) -> list[str]:
    """``files`` files of ``kind`` ("parquet" or "json") in ``folder``; their paths, sorted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        ids = [f * 1000 + r for r in range(rows)]
        texts = [f"row {i}" for i in ids]
        path = folder / f"part-{f:02d}.{'parquet' if kind == 'parquet' else 'jsonl'}"
        if kind == "parquet":
            pq.write_table(pa.table({"id": ids, "text": texts}), path)
        else:
            path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
        paths.append(str(path))
    return paths


def _derive(row: dict) -> dict:
    return {"double": row["id"] * 2, "length": len(row["text"])}


def stream(paths: list[str], shuffle: bool = False, seed: int = 0, rank: int | None = None, world: int = 1):
    """The files as a streaming ``datasets.IterableDataset``: shuffled with a buffer of
    ``BUFFER`` rows if asked, mapped, and split with ``split_dataset_by_node`` when ``rank``
    is given."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    kind = "parquet" if paths[0].endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=paths, split="train", streaming=True)
    if shuffle:
        ds = ds.shuffle(seed=seed, buffer_size=BUFFER)
    ds = ds.map(_derive)
    if rank is not None:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    return ds


class Replayed(torch.utils.data.IterableDataset):
    """A stream without ``state_dict``/``load_state_dict`` of its own: a loader resumes it by
    replaying it (fast-forward), which holds the rows a shuffle buffer held at the save."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def ids(batch) -> list[int] | int:
    """A batch's row ids (a row's id with ``batch_size=None``), checked against its derived column."""
    got = torch.as_tensor(batch["id"]).tolist()  # batch_size=None leaves a row uncollated
    double = torch.as_tensor(batch["double"]).tolist()
    if (double != [i * 2 for i in got]) if isinstance(got, list) else double != got * 2:
        raise AssertionError(f"the mapped column does not follow its rows: {got} {double}")
    return got
