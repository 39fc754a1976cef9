"""The packing: documents concatenated and cut into rows of ``seq_len + 1`` tokens.

The documents (those with at least one token) are laid end to end in an order seeded by the
dataset's ``seed`` (or in index order), and the stream is cut into rows of ``seq_len + 1``
tokens, no padding: row ``r`` holds tokens ``[r (seq_len + 1), (r + 1) (seq_len + 1))`` of the
stream. The last ``total mod (seq_len + 1)`` tokens, fewer than one row, are in no row (the
tail rule); every other token of every document is in exactly one row.

A row is described by its *spans*: ``(document, start, stop)``, the document's tokens
``[start, stop)``, in the row's order. The packing is a pure function of the lengths,
``seq_len`` and the seed, so any process computes the same rows from them; which rows an epoch
visits and in which order is the loader's plan over the row indices (``aioload._plan``), a pure
function of ``(seed, epoch)``: a uniform shuffle, or (``window=k``) drawn from ``k`` open
*blocks* at a time, a block being the rows that begin in one of the source's row groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioload._base.seeding import derive_seed


@dataclass(frozen=True, eq=False)
class Packing:
    """Rows of ``row_len`` tokens over the documents concatenated in ``order``.

    ``order``: the documents with tokens, in the order they are laid end to end; ``ends``:
    ``ends[k]`` is the number of tokens of ``order[: k + 1]`` (int64, nondecreasing);
    ``rows``: whole rows in the stream; ``tail``: tokens after the last whole row, in no row.
    """

    row_len: int
    order: np.ndarray
    ends: np.ndarray
    rows: int
    tail: int

    def spans(self, row: int) -> list[tuple[int, int, int]]:
        """Row ``row``'s ``(document, start, stop)`` spans, in order; together they hold
        ``row_len`` tokens."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} is out of range for {self.rows} rows")
        first, last = row * self.row_len, (row + 1) * self.row_len
        # The documents whose tokens overlap [first, last): from the one holding `first`.
        k = int(np.searchsorted(self.ends, first, side="right"))
        found = []
        while first < last:
            begin = int(self.ends[k - 1]) if k else 0
            end = int(self.ends[k])
            stop = min(end, last)
            found.append((int(self.order[k]), first - begin, stop - begin))
            first = stop
            k += 1
        return found


def pack(lengths: np.ndarray, seq_len: int, seed: int, shuffle: bool) -> Packing:
    """The packing of documents of ``lengths`` tokens into rows of ``seq_len + 1``:
    documents in a permutation seeded by ``seed`` (``shuffle``) or in index order."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths.size and int(lengths.min()) < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"document {bad} has a negative length ({int(lengths[bad])}): lengths count tokens")
    if shuffle:
        order = np.random.Generator(np.random.PCG64(derive_seed(seed, 0x70AC))).permutation(lengths.size)
    else:
        order = np.arange(lengths.size)
    order = order[lengths[order] > 0]
    index_type = np.int32 if lengths.size < 2**31 else np.int64
    ends = np.cumsum(lengths[order], dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    row_len = seq_len + 1
    return Packing(row_len, order.astype(index_type), ends, total // row_len, total % row_len)


GROUP_DOCUMENTS = 1024
"""Documents per group where the source has no row groups of its own (window mode's blocks)."""


def document_groups(source, documents: int) -> np.ndarray:
    """Which group each document is in, for window mode: the source's row groups where it says
    them (``row_group_rows``, as ``aioload.Parquet`` does), else runs of ``GROUP_DOCUMENTS``."""
    rows = getattr(source, "row_group_rows", None)
    if rows is not None:
        counts = np.asarray(rows, dtype=np.int64)
        if counts.ndim == 1 and int(counts.sum()) == documents:
            return np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    return np.arange(documents, dtype=np.int64) // GROUP_DOCUMENTS


def blocks(packing: Packing, groups: np.ndarray) -> np.ndarray:
    """Rows per block: the runs of consecutive rows whose first token's document is in the same
    group. With the documents laid down in index order, a block's rows read from one or two of
    the source's row groups."""
    if packing.rows == 0:
        return np.zeros(0, dtype=np.int64)
    firsts = np.searchsorted(packing.ends, np.arange(packing.rows, dtype=np.int64) * packing.row_len, side="right")
    group = groups[packing.order[firsts]]
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(group)) + 1, [packing.rows]])
    return np.diff(bounds).astype(np.int64)
