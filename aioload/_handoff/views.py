"""Reading batches out of a slot: used in the parent process, by the decode stage.

The parent receives skeletons (see :mod:`aioload._handoff.writers`) and builds the batch from them
and the slot's memory:

* rows mode: :func:`load_rows` unpickles the rows' skeletons and :func:`collate_rows` runs
  torch's own ``collate`` over them, with one addition: a column of leaves that fills rows
  ``0..n-1`` becomes a view of the slot instead of a ``torch.stack`` copy (and
  :func:`row_samples` gives each row back as its sample held it);
* a whole batch: :func:`load_batch` unpickles it with each leaf put back from its place.

Guarantees: the structure of the result, and every error, is ``default_collate``'s (or the
``collate_fn``'s); every tensor made from a slot views it through one :class:`SlotView`, and
the slot goes back to its pool only once the last of them is gone.
"""

from __future__ import annotations

import functools
import io
import pickle
import weakref
from typing import Callable

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from aioload._handoff.layout import Column, Inline, Layout, LeafSpec, Overflow
from aioload._handoff.tree import map_leaves


class SlotView:
    """One hand-out of a slot's memory. When every tensor made from it is gone, ``on_free`` runs.

    The views share one storage that owns a private numpy array over the mapping; a
    ``weakref.finalize`` on that array is the signal that the consumer dropped the batch.
    """

    def __init__(self, segment, layout: Layout, on_free: Callable[[], None]):
        hold = np.frombuffer(segment.map, dtype=np.uint8)
        self._hold = hold
        self.layout = layout
        weakref.finalize(hold, on_free)

    def _tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A tensor over ``nbytes`` of the slot from ``offset``; it keeps the slot's array alive."""
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._hold, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)

    def column(self, k: int, n: int) -> torch.Tensor:
        """The first ``n`` rows of column ``k``, as one tensor."""
        return self.rows(k, 0, n)

    def rows(self, k: int, row0: int, n: int) -> torch.Tensor:
        """Rows ``row0 .. row0 + n`` of column ``k``."""
        spec = self.layout.leaves[k]
        off = self.layout.offsets[k] + row0 * spec.nbytes
        return self._tensor(off, spec.nbytes * n, spec.torch_dtype, (n, *spec.shape))

    def cell(self, k: int, row: int, as_numpy: bool):
        """Row ``row`` of column ``k`` (a Python number for a column of numbers)."""
        spec = self.layout.leaves[k]
        value = self.region(self.layout.offsets[k] + row * spec.nbytes, spec, as_numpy)
        return value.item() if spec.kind == "p" else value

    def region(self, offset: int, spec: LeafSpec, as_numpy: bool):
        """The leaf of ``spec`` at ``offset``: an ndarray for an array leaf when ``as_numpy``,
        else a tensor."""
        if as_numpy and spec.kind == "n":
            return self._hold[offset : offset + spec.nbytes].view(np.dtype(spec.dtype)).reshape(spec.shape)
        return self._tensor(offset, spec.nbytes, spec.torch_dtype, spec.shape)

    def release(self) -> None:
        """Drop this object's own references; the finalizer fires once user tensors are gone."""
        self._hold = None


# ----------------------------------------------------------------------------- rows mode


def load_rows(rows: list[tuple[int, bytes]]) -> list:
    """Skeletons for ``(row, payload)`` pairs. Rows with the same payload as the row before
    share one skeleton: it is unpickled once (a worker's reply names each distinct payload
    once, and uniform rows all name the first)."""
    samples = []
    last_payload = last = None
    for _, payload in rows:
        if payload is not last_payload and payload != last_payload:
            last_payload = payload
            last = pickle.loads(payload)
        samples.append(last)
    return samples


def collate_rows(samples: list, rows: list[int], view: SlotView | None):
    """``default_collate`` over skeletons, with whole slot columns where rows are 0..n-1."""
    contiguous = rows == list(range(len(rows)))

    def leaf_column(batch, *, collate_fn_map=None):
        first = batch[0]
        if contiguous and view is not None and type(first) is Column and all(leaf is first for leaf in batch):
            return view.column(first.k, len(batch))
        values = [_value(leaf, row, view) for leaf, row in zip(batch, rows)]
        return collate(values, collate_fn_map=default_collate_fn_map)

    fn_map = dict(default_collate_fn_map)
    fn_map[Column] = fn_map[Overflow] = fn_map[Inline] = leaf_column
    return collate(samples, collate_fn_map=fn_map)


def row_samples(skeletons: list, rows: list[int], view: SlotView | None) -> list:
    """Each row's sample as the worker's sample held it (its leaves taken from the slot)."""
    return [map_leaves(functools.partial(_value, row=row, view=view), skeleton, exact=True)
            for skeleton, row in zip(skeletons, rows)]


def _value(leaf, row: int, view: SlotView | None):
    """A row's leaf, from its place."""
    kind = type(leaf)
    if kind is Column:
        return view.cell(leaf.k, row, as_numpy=False)
    if kind is Overflow:
        return view.region(leaf.offset, leaf.spec, as_numpy=False)
    if kind is Inline:
        return leaf.value
    return leaf


# ----------------------------------------------------------------------------- a whole batch


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, view: SlotView | None):
        super().__init__(io.BytesIO(data))
        self._view = view

    def persistent_load(self, pid):
        kind = type(pid)
        if kind is Inline:
            return pid.value
        if kind is Column:
            return self._view.cell(pid.k, 0, as_numpy=True)
        if kind is Overflow:
            return self._view.region(pid.offset, pid.spec, as_numpy=True)
        raise pickle.UnpicklingError(f"unknown leaf place {pid!r}")


def load_batch(data: bytes, view: SlotView | None):
    """A whole batch pickled by :class:`~aioload._handoff.writers.SlotWriter` (a custom
    ``collate_fn`` and the like), its leaves put back from the slot."""
    return _LeafUnpickler(data, view).load()
