"""Batch layout in a shared-memory slot: how samples are written by workers and read back.

A sample (or, with a custom ``collate_fn``, a whole batch) is pickled with its tensors and
numeric numpy arrays taken out as *leaves*. A leaf whose shape and dtype match the layout
learned from the first sample is written into its row of a column of the slot; other leaves go
to the slot's overflow area when they fit, and are pickled inline only as a last resort. What
travels back over the socket is the small skeleton: containers, labels, strings.

The parent rebuilds samples from skeletons and lets torch's own ``collate`` assemble the batch,
with one addition: a column of leaves that fills rows ``0..n-1`` becomes a view of the slot
instead of a ``torch.stack`` copy. The structure of the result, and every error, is therefore
exactly ``default_collate``'s.
"""

from __future__ import annotations

import io
import pickle
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

ALIGN = 64
_NUMERIC_KINDS = frozenset("biufc")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one leaf; ``kind`` is ``"t"`` for a tensor, ``"n"`` for an ndarray."""

    kind: str
    dtype: str
    shape: tuple

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.kind == "t":
            return getattr(torch, self.dtype.removeprefix("torch."))
        return torch.from_numpy(np.empty(0, dtype=np.dtype(self.dtype))).dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * torch.empty((), dtype=self.torch_dtype).element_size()


def leaf_spec(obj) -> LeafSpec | None:
    """The spec of ``obj`` if it can live in a slot, else ``None`` (it is pickled instead)."""
    if type(obj) is torch.Tensor:
        if obj.layout is not torch.strided or obj.device.type != "cpu" or obj.requires_grad:
            return None
        if obj.is_quantized or obj.is_conj() or obj.is_neg():
            return None
        return LeafSpec("t", str(obj.dtype), tuple(obj.shape))
    if type(obj) is np.ndarray and obj.dtype.kind in _NUMERIC_KINDS and obj.dtype.isnative:
        return LeafSpec("n", obj.dtype.str, tuple(obj.shape))
    return None


class Layout:
    """Where each leaf column lives in a slot of ``rows`` rows, plus an overflow area."""

    def __init__(self, leaves: list[LeafSpec], rows: int, overflow: int):
        self.leaves = list(leaves)
        self.rows = rows
        self.offsets = []
        end = 0
        for spec in self.leaves:
            self.offsets.append(end)
            end = _align(end + spec.nbytes * rows)
        self.fixed_bytes = end
        self.overflow = _align(overflow)
        self.size = self.fixed_bytes + self.overflow

    def with_overflow(self, overflow: int) -> "Layout":
        return Layout(self.leaves, self.rows, overflow)

    def describe(self) -> tuple:
        return (self.leaves, self.rows, self.overflow)


# ----------------------------------------------------------------------------- worker side


class SlotWriter:
    """Pickles samples for one task, writing their leaves into a slot (or inline if none)."""

    def __init__(self, segment, layout: Layout | None, overflow: tuple[int, int] | None):
        self.segment = segment
        self.layout = layout
        self._ovf_next, self._ovf_end = overflow if overflow else (0, 0)
        self.overflow_wanted = 0
        self.first_specs: list[LeafSpec] | None = None

    def dump(self, obj, row: int) -> bytes:
        buf = io.BytesIO()
        pickler = _LeafPickler(buf, self, row)
        pickler.dump(obj)
        if self.first_specs is None:
            self.first_specs = pickler.specs
        return buf.getvalue()

    def _place(self, obj, spec: LeafSpec, k: int, row: int):
        layout = self.layout
        if self.segment is not None and layout is not None:
            if k < len(layout.leaves) and layout.leaves[k] == spec and row < layout.rows:
                offset = layout.offsets[k] + row * spec.nbytes
                self._write(obj, spec, offset)
                return ("c", k)
            size = _align(spec.nbytes)
            if self._ovf_next + size <= self._ovf_end:
                offset = self._ovf_next
                self._ovf_next += size
                self._write(obj, spec, offset)
                return ("o", offset, spec)
            self.overflow_wanted += size
        return None

    def _write(self, obj, spec: LeafSpec, offset: int) -> None:
        if spec.kind == "t":
            self.segment.tensor(offset, spec.nbytes, obj.dtype, obj.shape).copy_(obj)
        else:
            target = np.ndarray(obj.shape, dtype=obj.dtype, buffer=self.segment.map, offset=offset)
            np.copyto(target, obj, casting="no")


class _LeafPickler(pickle.Pickler):
    def __init__(self, buf, writer: SlotWriter, row: int):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer = writer
        self._row = row
        self._inline: set[int] = set()
        self.specs: list[LeafSpec] = []

    def persistent_id(self, obj):
        if id(obj) in self._inline:
            return None
        spec = leaf_spec(obj)
        if spec is None:
            return None
        k = len(self.specs)
        self.specs.append(spec)
        placed = self._writer._place(obj, spec, k, self._row)
        if placed is not None:
            return placed
        self._inline.add(id(obj))
        return ("i", obj)


# ----------------------------------------------------------------------------- parent side


class SlotView:
    """One hand-out of a slot's memory. When every tensor made from it is gone, ``on_free`` runs.

    The views share one storage that owns a private numpy array over the mapping; a
    ``weakref.finalize`` on that array is the signal that the consumer dropped the batch.
    """

    def __init__(self, segment, layout: Layout, on_free: Callable[[], None]):
        hold = np.frombuffer(segment.map, dtype=np.uint8)
        self._hold = hold
        self._base = torch.from_numpy(hold)
        self.layout = layout
        weakref.finalize(hold, on_free)

    def column(self, k: int, n: int) -> torch.Tensor:
        spec = self.layout.leaves[k]
        off = self.layout.offsets[k]
        return self._base[off : off + spec.nbytes * n].view(spec.torch_dtype).view((n, *spec.shape))

    def cell(self, k: int, row: int, as_numpy: bool):
        spec = self.layout.leaves[k]
        return self.region(self.layout.offsets[k] + row * spec.nbytes, spec, as_numpy)

    def region(self, offset: int, spec: LeafSpec, as_numpy: bool):
        raw = self._base[offset : offset + spec.nbytes]
        if as_numpy and spec.kind == "n":
            return self._hold[offset : offset + spec.nbytes].view(np.dtype(spec.dtype)).reshape(spec.shape)
        return raw.view(spec.torch_dtype).view(spec.shape)

    def release(self) -> None:
        """Drop this object's own references; the finalizer fires once user tensors are gone."""
        self._hold = None
        self._base = None


class _Leaf:
    """A sample's leaf as seen by ``collate``: a row of a slot column, or a standalone value."""

    __slots__ = ("view", "col", "row", "value")

    def __init__(self, view, col, row, value):
        self.view, self.col, self.row, self.value = view, col, row, value

    def materialize(self):
        if self.col is None:
            return self.value
        return self.view.cell(self.col, self.row, as_numpy=False)


def _collate_leaves(batch, *, collate_fn_map=None):
    first = batch[0]
    if first.col is not None:
        view, col = first.view, first.col
        contiguous = True
        for i, leaf in enumerate(batch):
            if type(leaf) is not _Leaf or leaf.col != col or leaf.row != i or leaf.view is not view:
                contiguous = False
                break
        if contiguous:
            return view.column(col, len(batch))
    values = [leaf.materialize() if type(leaf) is _Leaf else leaf for leaf in batch]
    return collate(values, collate_fn_map=default_collate_fn_map)


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, view: SlotView | None, row: int, rows_mode: bool):
        super().__init__(io.BytesIO(data))
        self._view, self._row, self._rows_mode = view, row, rows_mode

    def persistent_load(self, pid):
        tag = pid[0]
        if tag == "i":
            value = pid[1]
            return _Leaf(None, None, None, value) if self._rows_mode else value
        if tag == "c":
            if self._rows_mode:
                return _Leaf(self._view, pid[1], self._row, None)
            return self._view.cell(pid[1], 0, as_numpy=True)
        if tag == "o":
            value = self._view.region(pid[1], pid[2], as_numpy=not self._rows_mode)
            return _Leaf(None, None, None, value) if self._rows_mode else value
        raise pickle.UnpicklingError(f"unknown leaf tag {tag!r}")


def load_sample(data: bytes, view: SlotView | None, row: int, rows_mode: bool):
    return _LeafUnpickler(data, view, row, rows_mode).load()


def collate_rows(samples: list):
    """``default_collate`` over samples whose leaves are :class:`_Leaf` placeholders."""
    fn_map = dict(default_collate_fn_map)
    fn_map[_Leaf] = _collate_leaves
    return collate(samples, collate_fn_map=fn_map)


def unwrap_leaves(sample):
    """Turn placeholders back into values (used when no collation happens)."""
    if type(sample) is _Leaf:
        return sample.materialize()
    return sample
