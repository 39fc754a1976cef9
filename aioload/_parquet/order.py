"""Rows and row groups across files, and the epoch's order over them.

Every row of every file has one global index: file after file, row group after row group
(:class:`Layout`). The order is the shards' (:mod:`aioload._shards.order`) with row groups in
the part of shards: ``window=None`` is a uniform shuffle over every row; ``window=k`` draws
each next row from ``k`` open row groups, a row group opening when another's last row has been
drawn. Either is a pure function of ``(seed, epoch)`` and the row counts, never of timing, the
worker count or the rank.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import numpy as np
import torch

from aioload._shards import order as _order


class Layout:
    """The global row index over files' row groups. ``rows[f]``: the row counts of file
    ``f``'s row groups."""

    def __init__(self, rows: Sequence[np.ndarray]):
        counts = [np.asarray(r, dtype=np.int64) for r in rows]
        self.group_rows = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        # the first global row group of each file, and the first row of each global row group
        self.first_group = np.concatenate([[0], np.cumsum([len(c) for c in counts])]).astype(np.int64)
        self.first_row = np.concatenate([[0], np.cumsum(self.group_rows)]).astype(np.int64)
        # the same as lists, for locate: numpy's searchsorted called on one index at a time (a
        # few calls per row) was 7 % of a worker's busy CPU in a uniform shuffle without decoding
        # (py-spy); bisect on a list skips numpy's per-call overhead
        self._first_group, self._first_row = self.first_group.tolist(), self.first_row.tolist()
        self._group_file = np.repeat(np.arange(len(counts)), [len(c) for c in counts]).tolist()

    def __len__(self) -> int:
        return self._first_row[-1]

    def locate(self, index: int) -> tuple[int, int, int]:
        """``(file, row group within the file, row within the row group)`` of a global row."""
        group = bisect_right(self._first_row, index) - 1
        file = self._group_file[group]
        return file, group - self._first_group[file], index - self._first_row[group]

    def group_of(self, indices):
        """The global row group of each of ``indices``."""
        return np.searchsorted(self.first_row, indices, side="right") - 1

    def epoch_order(self, window: int | None, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """Every row once: uniformly shuffled (``window=None``) or drawn from ``window`` open
        row groups at a time; in file order when ``shuffle`` is false."""
        if window is None:
            return _order.uniform_order(len(self), seed, epoch, shuffle)
        return _order.window_order(self.group_rows.tolist(), window, seed, epoch, shuffle)
