"""Each document's token count: what the packing is computed from.

From, in order of cost:

* ``lengths=`` a sequence of counts (read from a lengths column, saved by a tokenizing job);
* ``lengths="field"``: a field of each document holding its count (a source that reads a
  column whole, ``read_column`` as ``aioload.Parquet`` has, reads that column alone), or
* nothing: the documents tokenized (or their token ids counted) once,

otherwise in one *index pass* over the source: the documents in ranges of ``PASS_BATCH``, in
index order, each range's reads awaited together on one event loop and then counted, in this
process or in ``index_workers`` processes (a ``concurrent.futures`` pool of this process's
default start method, which receives the source once).
With ``cache=path`` the counts are kept in that file (``.npz``) with what they were computed
from (the number of documents, the source's type, the column, the field or the tokenizer's
definition); a later dataset over the same key loads them instead of passing again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, Dataset
from aioload._tokens.documents import Documents

PASS_BATCH = 256


class Counts(Dataset):
    """The documents' token counts (or a field of them), one per index: the index pass."""

    def __init__(self, documents: Documents, field: str | None):
        self.documents = documents
        self.field = field

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def read_in_workers(self) -> bool:
        return self.documents.read_in_workers

    def read_nowait(self, index: int) -> Any:
        raw = self.documents.read_nowait(index)
        return NOT_READY if raw is NOT_READY else (index, raw)

    async def read(self, index: int) -> Any:
        return index, await self.documents.read(index)

    def read_blocking(self, index: int) -> Any:
        return index, self.documents.read_blocking(index)

    def decode(self, raw: Any) -> int:
        doc, item = raw
        document = self.documents.load(doc, item)
        if self.field is None:
            return self.documents.count(doc, document)
        return field_count(self.documents, doc, document, self.field)

    def describe(self, index: int) -> str:
        return self.documents.describe(index)


def field_count(documents: Documents, doc: int, document: Any, field: str) -> int:
    try:
        value = document[field]
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"{documents.describe(doc)} has no field {field!r}: lengths= names the field of each "
                         "document that holds its token count") from None
    count = int(value)
    if count != value or count < 0:
        raise ValueError(f"{documents.describe(doc)}'s {field!r} is {value!r}, not a count of tokens (an int >= 0)")
    return count


def given_lengths(lengths, documents: int) -> np.ndarray:
    """``lengths`` as given, checked: one int >= 0 per document."""
    try:
        found = np.asarray(lengths.numpy() if isinstance(lengths, torch.Tensor) else lengths)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"lengths must be a sequence of token counts, a field name or None, got "
                        f"{type(lengths).__name__}") from exc
    if found.ndim != 1 or found.size != documents:
        raise ValueError(f"lengths has {found.size} entries of shape {found.shape} for {documents} documents: "
                         "it must hold one token count per document")
    if found.size and not np.issubdtype(found.dtype, np.integer):
        raise TypeError(f"lengths must hold integers (token counts), got {found.dtype}")
    found = found.astype(np.int64)
    if found.size and int(found.min()) < 0:
        bad = int(np.flatnonzero(found < 0)[0])
        raise ValueError(f"lengths[{bad}] is {int(found[bad])}: token counts must be >= 0")
    return found


def index_pass(documents: Documents, field: str | None, workers: int) -> np.ndarray:
    """Every document's token count (or ``field``), in index order: every document, on every
    rank (a dataset made under torch.distributed packs all of them)."""
    counts = Counts(documents, field)
    ranges = [(start, min(start + PASS_BATCH, len(counts))) for start in range(0, len(counts), PASS_BATCH)]
    if workers == 0:
        # a thread of its own: the caller may be inside a running event loop
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioload-index-pass") as pool:
            parts = list(pool.map(lambda bounds: count_range(counts, *bounds), ranges))
    else:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(),
                                                    initializer=_keep, initargs=(counts,)) as pool:
            parts = list(pool.map(_count_kept, ranges))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def count_range(counts: Counts, start: int, stop: int) -> np.ndarray:
    """The counts of documents ``start`` to ``stop - 1``: their reads awaited together, then each
    decoded; a document that fails raises, with a note naming it."""
    async def read_one(index: int) -> Any:
        try:
            raw = counts.read_nowait(index)
            return await counts.read(index) if raw is NOT_READY else raw
        except Exception as exc:
            exc.add_note(f"while reading document {index} ({counts.describe(index)}) to count its tokens")
            raise

    async def read_all() -> list:
        return await asyncio.gather(*(read_one(index) for index in range(start, stop)))

    found = np.empty(stop - start, dtype=np.int64)
    for index, raw in enumerate(asyncio.run(read_all()), start):
        try:
            found[index - start] = counts.decode(raw)
        except Exception as exc:
            exc.add_note(f"while counting the tokens of document {index} ({counts.describe(index)})")
            raise
    return found


_KEPT: list[Counts] = []  # in an index pass's process: the pass's documents, received once


def _keep(counts: Counts) -> None:
    _KEPT[:] = [counts]


def _count_kept(bounds: tuple[int, int]) -> np.ndarray:
    return count_range(_KEPT[0], *bounds)


def cache_key(documents: Documents, field: str | None) -> str:
    source = type(documents.source)
    fingerprint = getattr(documents.source, "fingerprint", None)
    key = {
        "documents": len(documents),
        "source": f"{source.__module__}.{source.__qualname__}",
        "fingerprint": fingerprint() if callable(fingerprint) else None,
        "counts": f"field {field}" if field is not None else "tokens",
        "column": documents.column,
        "tokenizer": None,
    }
    if field is None and documents.encoder is not None:
        key["tokenizer"] = hashlib.blake2b(documents.encoder.identity().encode(), digest_size=16).hexdigest()
    return json.dumps(key, sort_keys=True)


def load_cached(path: Path, key: str) -> np.ndarray | None:
    try:
        with np.load(path, allow_pickle=False) as saved:
            if str(saved["key"]) != key:
                return None
            return saved["lengths"].astype(np.int64)
    except (OSError, KeyError, ValueError):
        return None


def save_cached(path: Path, key: str, lengths: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as out:
        np.savez(out, key=np.array(key), lengths=lengths)
    os.replace(temporary, path)


def column_counts(documents: Documents, field: str) -> np.ndarray | None:
    """The field's column read whole where the source can (``read_column``: an
    ``aioload.Parquet`` fetches that column's chunks alone), else ``None``."""
    read_column = getattr(documents.source, "read_column", None)
    if not callable(read_column):
        return None
    column = read_column(field)
    if column.null_count:
        raise ValueError(f"the column {field!r} that lengths= names has {column.null_count} missing values: "
                         "every document needs its token count")
    return given_lengths(column.to_numpy(), len(documents))


def document_lengths(documents: Documents, lengths, cache, workers: int) -> np.ndarray:
    """Each document's token count, as :mod:`aioload._tokens.lengths` says."""
    if lengths is not None and not isinstance(lengths, str):
        return given_lengths(lengths, len(documents))
    if lengths is not None:
        found = column_counts(documents, lengths)
        if found is not None:
            return found
    path = Path(cache) if cache is not None else None
    key = cache_key(documents, lengths)
    if path is not None:
        found = load_cached(path, key)
        if found is not None and found.size == len(documents):
            return found
    found = index_pass(documents, lengths, workers)
    if path is not None:
        save_cached(path, key, found)
    return found
