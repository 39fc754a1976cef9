"""Writing samples into a slot: used in the worker process (and by the parent for the one
sample per worker that taught the layout, see :func:`move_into_slot`).

A writer copies each leaf of what it is given (a tensor, a numeric numpy array, a Python
number) into the slot where :mod:`aioload._handoff.layout` places it, and returns the small
*skeleton* that travels over the socket instead of the data: the sample's containers, labels
and strings, with each leaf replaced by its place (:class:`Column`, :class:`Overflow`, or
:class:`Inline` when it is carried in the pickle).

* :class:`RowWriter`, rows mode (default collation): one sample per row. Its leaves are found
  by walking exactly the containers a row's skeleton keeps (``aioload._handoff.tree``, ``exact=True``);
  the skeleton is pickled by the plain C pickler.
* :class:`SlotWriter`, a whole batch (a custom ``collate_fn``, an ``IterableDataset``): any
  object, pickled with every tensor and numeric array it holds taken out as a leaf.

Guarantees: a leaf is written into its column only when its spec is exactly the column's and
its row exists; otherwise into the overflow area when it fits (``overflow_wanted`` then counts
the bytes that did not, so the next slots can be made larger), else inline: nothing is lost,
only copied less well. ``first_specs`` is the spec of every leaf position of the first thing
written, which is how a layout is learned.
"""

from __future__ import annotations

import io
import pickle
import weakref

import numpy as np
import torch

from aioload._handoff.layout import (
    INT64,
    NO_SPEC,
    NUMBER_SPECS,
    Column,
    Inline,
    Layout,
    LeafSpec,
    Overflow,
    align,
    in_column,
    leaf_spec,
    number_spec,
)
from aioload._handoff.tree import map_leaves


def _numpy_dtype(dtype: torch.dtype):
    """numpy's equivalent of a torch dtype, or ``None`` (bfloat16, float8, ...)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return None


class Columns(list):
    """Column views of one slot (a tensor, or an ndarray where numpy has the dtype: a numpy
    store is the cheaper write), plus their row views and tensor views, made on first use."""

    def __init__(self, count: int):
        super().__init__()
        self.rows: list = [None] * count
        self.tensors: list = [None] * count

    def tensor(self, k: int) -> torch.Tensor:
        """Column ``k`` as a tensor (a column kept as an ndarray is wrapped once)."""
        found = self.tensors[k]
        if found is None:
            view = self[k]
            found = self.tensors[k] = view if type(view) is torch.Tensor else torch.from_numpy(view)
        return found

    def row(self, k: int, row: int) -> torch.Tensor:
        """Row ``row`` of column ``k`` as a tensor; the row views are made once per slot."""
        views = self.rows[k]
        if views is None:
            views = self.rows[k] = list(self.tensor(k).unbind(0))
        return views[row]


def column_views(segment, layout: Layout | None) -> Columns | None:
    """Per leaf, the slot's column as a tensor (or ndarray) of ``(rows, *shape)``."""
    if segment is None or layout is None:
        return None
    columns = Columns(len(layout.leaves))
    for spec, offset in zip(layout.leaves, layout.offsets):
        shape = (layout.rows, *spec.shape)
        if spec.kind == "x":
            columns.append(None)
        elif spec.kind == "t" and _numpy_dtype(spec.torch_dtype) is None:
            columns.append(segment.tensor(offset, spec.nbytes * layout.rows, spec.torch_dtype, shape))
        elif spec.kind == "t":
            columns.append(np.ndarray(shape, dtype=_numpy_dtype(spec.torch_dtype), buffer=segment.map, offset=offset))
        else:
            dtype = spec.dtype if spec.kind == "n" else torch.empty((), dtype=spec.torch_dtype).numpy().dtype
            columns.append(np.ndarray(shape, dtype=np.dtype(dtype), buffer=segment.map, offset=offset))
    return columns


def _matches(obj, kind, spec: LeafSpec) -> bool:
    """A cheap check that ``obj`` has exactly the layout's spec (the hot path)."""
    if kind is torch.Tensor:
        return (spec.kind == "t" and obj.dtype is spec.torch_dtype and obj.shape == spec.shape
                and obj.is_cpu and obj.layout is torch.strided and not obj.requires_grad
                and not obj.is_conj() and not obj.is_neg())
    return spec.kind == "n" and obj.dtype.str == spec.dtype and obj.shape == spec.shape


class SlotWriter:
    """Pickles a whole batch (or anything else) for one task, its leaves written into a slot.

    ``segment`` and ``layout`` are ``None`` before the layout is known: every leaf is then
    inline. ``overflow`` is the ``(start, end)`` byte range of the overflow area this task may
    use; ``columns`` the slot's :func:`column_views`, when the caller keeps them per slot."""

    def __init__(self, segment, layout: Layout | None, overflow: tuple[int, int] | None, columns=None):
        self.segment = segment
        self.layout = layout
        self._ovf_next, self._ovf_end = overflow if overflow else (0, 0)
        self.overflow_wanted = 0
        self.first_specs: list[LeafSpec] | None = None
        self.columns = columns if columns is not None else column_views(segment, layout)
        self._buf = io.BytesIO()
        self._pickler = None

    def dump(self, obj, row: int) -> bytes:
        if self._pickler is None:
            # the pickler refers back to this writer weakly: no cycle keeps slot memory alive
            self._pickler = _LeafPickler(self._buf, weakref.proxy(self))
        buf, pickler = self._buf, self._pickler
        buf.seek(0)
        buf.truncate()
        pickler.start(row)
        pickler.dump(obj)
        if self.first_specs is None:
            self.first_specs = pickler.specs
        return buf.getvalue()

    def expected(self, k: int) -> LeafSpec | None:
        """The spec of column ``k`` (``None``: no layout, or no such column)."""
        layout = self.layout
        if layout is None or k >= len(layout.leaves):
            return None
        return layout.leaves[k]

    def place(self, obj, spec: LeafSpec, k: int, row: int) -> Column | Overflow | None:
        """Write leaf ``obj`` (position ``k``, of ``spec``) into the slot: its column at ``row``
        when it fits there, else the overflow area. ``None``: it stays inline."""
        layout = self.layout
        if self.segment is None or layout is None:
            return None
        if k < len(layout.leaves) and row < layout.rows and (layout.leaves[k] is spec or layout.leaves[k] == spec):
            view = self.columns[k]
            if type(view) is torch.Tensor:
                view[row].copy_(obj)
            elif spec.kind == "t":
                view[row] = obj.numpy()
            else:
                view[row] = obj
            return in_column(k)
        if spec.kind == "p":
            return None  # a number that is not in its column stays in the pickle
        size = align(spec.nbytes)
        if self._ovf_next + size > self._ovf_end:
            self.overflow_wanted += size
            return None
        offset = self._ovf_next
        self._ovf_next += size
        if spec.kind == "t":
            self.segment.tensor(offset, spec.nbytes, obj.dtype, obj.shape).copy_(obj)
        else:
            target = np.ndarray(obj.shape, dtype=obj.dtype, buffer=self.segment.map, offset=offset)
            np.copyto(target, obj, casting="no")
        return Overflow(offset, spec)


class _LeafPickler(pickle.Pickler):
    """Takes every tensor and numeric array out of the pickle: its place is pickled instead
    (a persistent id), and :func:`aioload._handoff.views.load_batch` puts the leaf back."""

    def __init__(self, buf, writer: SlotWriter):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer = writer
        self._row = 0
        self._inline: set[int] = set()
        self.specs: list[LeafSpec] = []

    def start(self, row: int) -> None:
        self.clear_memo()
        self._row = row
        self._inline.clear()
        self.specs = []

    def persistent_id(self, obj):
        kind = type(obj)
        if kind is not torch.Tensor and kind is not np.ndarray:
            return None  # the common case: containers, strings
        if id(obj) in self._inline:
            return None  # pickling the value of its own Inline place
        k = len(self.specs)
        spec = self._writer.expected(k)
        if spec is None or not _matches(obj, kind, spec):
            spec = leaf_spec(obj)
            if spec is None:
                return None
        self.specs.append(spec)
        placed = self._writer.place(obj, spec, k, self._row)
        if placed is not None:
            return placed
        self._inline.add(id(obj))
        return Inline(obj)


class RowWriter:
    """Writes one task's samples into their rows of a slot; returns pickled skeletons."""

    def __init__(self, segment, layout: Layout | None, overflow: tuple[int, int] | None, columns=None):
        self._slot = SlotWriter(segment, layout, overflow, columns)
        self.first_specs: list[LeafSpec] | None = None
        self._specs: list[LeafSpec] = []
        self._row = 0

    @property
    def overflow_wanted(self) -> int:
        return self._slot.overflow_wanted

    def dump(self, sample, row: int) -> bytes:
        self._specs = []
        self._row = row
        skeleton = map_leaves(self._leaf, sample, exact=True)
        if self.first_specs is None:
            self.first_specs = self._specs
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def _leaf(self, obj):
        """The place of ``obj``, written into the slot, when it is a leaf; else ``obj``."""
        kind = type(obj)
        if kind is not torch.Tensor and kind is not np.ndarray and kind not in NUMBER_SPECS:
            return obj  # strings, None, objects of other types: part of the skeleton
        writer = self._slot
        k = len(self._specs)
        spec = writer.expected(k)
        if kind in NUMBER_SPECS:
            if spec is None or spec.kind != "p" or spec.dtype != NUMBER_SPECS[kind].dtype:
                spec = number_spec(obj)
                if spec is None:
                    self._specs.append(NO_SPEC)
                    return Inline(obj)
                # NOTE: this falls through to the tensor check below, which finds no leaf_spec
                # for a number: numbers are noted as NO_SPEC and carried inline, so no layout
                # has a number column yet and the store below is never reached.
            elif self._row < writer.layout.rows and (kind is not int or INT64[0] <= obj < INT64[1]):
                self._specs.append(spec)
                writer.columns[k][self._row] = obj  # the hot path: a numpy scalar store
                return in_column(k)
        elif spec is not None and self._row < writer.layout.rows and _matches(obj, kind, spec):
            # the hot path: one copy into a precomputed view of the row
            self._specs.append(spec)
            target = writer.columns.row(k, self._row)
            if kind is torch.Tensor:
                target.copy_(obj)
            else:
                target.numpy()[...] = obj
            return in_column(k)
        if spec is None or not _matches(obj, kind, spec):
            spec = leaf_spec(obj)
            if spec is None:
                self._specs.append(NO_SPEC)
                return Inline(obj)
        self._specs.append(spec)
        placed = writer.place(obj, spec, k, self._row)
        return Inline(obj) if placed is None else placed


def _inline_value(leaf):
    return leaf.value if type(leaf) is Inline else leaf


def move_into_slot(payload: bytes, segment, layout: Layout, row: int) -> bytes:
    """In the parent: rewrite a row pickled without a slot (the sample that taught the layout)
    so that its leaves live in ``row`` of the slot, like every other row (one small copy)."""
    writer = RowWriter(segment, layout, None, column_views(segment, layout))
    sample = map_leaves(_inline_value, pickle.loads(payload), exact=True)
    return writer.dump(sample, row)
