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


class _memo:
    """``functools.cached_property`` without its lock. Before Python 3.12 that lock is one per
    property for every instance: a worker forked while another thread (another loader's engine)
    held it would wait for it for ever."""

    def __init__(self, compute):
        self.compute = compute
        self.name = compute.__name__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = self.compute(obj)
        obj.__dict__[self.name] = value  # later reads find it before this descriptor
        return value


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one leaf; ``kind`` is ``"t"`` for a tensor, ``"n"`` for an ndarray."""

    kind: str
    dtype: str
    shape: tuple

    @_memo
    def torch_dtype(self) -> torch.dtype:
        if self.kind in ("t", "p"):
            return getattr(torch, self.dtype.removeprefix("torch."))
        return torch.from_numpy(np.empty(0, dtype=np.dtype(self.dtype))).dtype

    @_memo
    def nbytes(self) -> int:
        if self.kind == "x":
            return 0
        count = 1
        for d in self.shape:
            count *= d
        return count * torch.empty((), dtype=self.torch_dtype).element_size()

    def __getstate__(self):
        return (self.kind, self.dtype, self.shape)

    def __setstate__(self, state):
        for name, value in zip(("kind", "dtype", "shape"), state):
            object.__setattr__(self, name, value)


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


_INT64 = (-(2**63), 2**63)
_NUMBER_SPECS = {
    bool: LeafSpec("p", "torch.bool", ()),
    int: LeafSpec("p", "torch.int64", ()),
    float: LeafSpec("p", "torch.float64", ()),
}


def number_spec(obj) -> LeafSpec | None:
    """Python numbers become columns too in row mode: ``default_collate`` turns a column of
    ints into int64, floats into float64 and bools into bool tensors."""
    spec = _NUMBER_SPECS.get(type(obj))
    if spec is not None and type(obj) is int and not _INT64[0] <= obj < _INT64[1]:
        return None
    return spec


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

    def with_rows(self, rows: int) -> "Layout":
        """The same leaves for ``rows`` rows; the overflow area keeps its share per row."""
        return Layout(self.leaves, rows, self.overflow * rows // max(1, self.rows))

    def describe(self) -> tuple:
        return (self.leaves, self.rows, self.overflow)


# ----------------------------------------------------------------------------- worker side


class SlotWriter:
    """Pickles samples for one task, writing their leaves into a slot (or inline if none)."""

    def __init__(self, segment, layout: Layout | None, overflow: tuple[int, int] | None, columns=None):
        self.segment = segment
        self.layout = layout
        self._ovf_next, self._ovf_end = overflow if overflow else (0, 0)
        self.overflow_wanted = 0
        self.first_specs: list[LeafSpec] | None = None
        self._columns = columns if columns is not None else column_views(segment, layout)
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

    def row_view(self, k: int, row: int) -> torch.Tensor:
        """Row ``row`` of column ``k`` as a tensor; the views are made once per slot."""
        views = self._columns.rows[k]
        if views is None:
            column = self._columns[k]
            column = column if type(column) is torch.Tensor else torch.from_numpy(column)
            views = self._columns.rows[k] = list(column.unbind(0))
        return views[row]

    def expected(self, k: int) -> LeafSpec | None:
        layout = self.layout
        if layout is None or k >= len(layout.leaves):
            return None
        return layout.leaves[k]

    def _place(self, obj, spec: LeafSpec, k: int, row: int):
        layout = self.layout
        if self.segment is not None and layout is not None:
            if k < len(layout.leaves) and row < layout.rows and (layout.leaves[k] is spec or layout.leaves[k] == spec):
                column = self._columns[k]
                if type(column) is torch.Tensor:
                    column[row].copy_(obj)
                elif spec.kind == "t":
                    column[row] = obj.numpy()
                else:
                    column[row] = obj
                return _COLUMN_IDS[k] if k < len(_COLUMN_IDS) else f"c{k}"
            if spec.kind == "p":
                return None
            size = _align(spec.nbytes)
            if self._ovf_next + size <= self._ovf_end:
                offset = self._ovf_next
                self._ovf_next += size
                self._write(obj, spec, offset)
                return f"o{offset}|{spec.kind}|{spec.dtype}|{','.join(map(str, spec.shape))}"
            self.overflow_wanted += size
        return None

    def _write(self, obj, spec: LeafSpec, offset: int) -> None:
        if spec.kind == "t":
            self.segment.tensor(offset, spec.nbytes, obj.dtype, obj.shape).copy_(obj)
        else:
            target = np.ndarray(obj.shape, dtype=obj.dtype, buffer=self.segment.map, offset=offset)
            np.copyto(target, obj, casting="no")


_COLUMN_IDS = [f"c{k}" for k in range(64)]


# ----------------------------------------------------------------------------- row mode
#
# With default collation a sample's leaves are found by walking exactly the containers that
# ``collate`` walks (dict, list, tuple, namedtuple). Each leaf -- tensor, numeric ndarray or
# Python number -- is replaced by a small marker: ``_Ref(k)`` (written into column k of the
# slot), ``_Ovf`` (written into the overflow area) or ``_Inline`` (carried in the pickle). The
# skeleton is pickled with the plain C pickler; objects of any other type are left untouched.


class _Ref:
    """Column ``k`` of the slot, at this sample's row. One shared instance per column."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __reduce__(self):
        return (_ref, (self.k,))


_REFS = [_Ref(k) for k in range(256)]


def _ref(k: int) -> _Ref:
    return _REFS[k] if k < len(_REFS) else _Ref(k)


class _Ovf:
    """A leaf written into the overflow area (its shape differs from the column's)."""

    __slots__ = ("offset", "spec")

    def __init__(self, offset: int, spec: LeafSpec):
        self.offset, self.spec = offset, spec

    def __reduce__(self):
        return (_Ovf, (self.offset, self.spec))


class _Inline:
    """A leaf carried in the pickle itself (no slot yet, or no room)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (_Inline, (self.value,))


class RowWriter:
    """Writes one task's samples into their rows of a slot; returns pickled skeletons."""

    def __init__(self, segment, layout: Layout | None, overflow: tuple[int, int] | None, columns=None):
        self._slot = SlotWriter(segment, layout, overflow, columns)
        self.first_specs: list[LeafSpec] | None = None
        self._specs: list[LeafSpec] = []

    @property
    def overflow_wanted(self) -> int:
        return self._slot.overflow_wanted

    def dump(self, sample, row: int) -> bytes:
        self._specs = []
        self._row = row
        skeleton = self._walk(sample)
        if self.first_specs is None:
            self.first_specs = self._specs
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def _walk(self, obj):
        kind = type(obj)
        if kind is torch.Tensor or kind is np.ndarray or kind in _NUMBER_SPECS:
            return self._leaf(obj, kind)
        if kind is tuple:
            return tuple([self._walk(v) for v in obj])
        if kind is list:
            return [self._walk(v) for v in obj]
        if kind is dict:
            return {key: self._walk(v) for key, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            return kind(*[self._walk(v) for v in obj])
        return obj

    def _leaf(self, obj, kind):
        writer = self._slot
        k = len(self._specs)
        spec = writer.expected(k)
        if kind in _NUMBER_SPECS:
            if spec is None or spec.kind != "p" or spec.dtype != _NUMBER_SPECS[kind].dtype:
                spec = number_spec(obj)
                if spec is None:
                    self._specs.append(_NO_SPEC)
                    return _Inline(obj)
            elif self._row < writer.layout.rows and (kind is not int or _INT64[0] <= obj < _INT64[1]):
                self._specs.append(spec)
                writer._columns[k][self._row] = obj  # the hot path: a numpy scalar store
                return _REFS[k] if k < len(_REFS) else _Ref(k)
        elif spec is not None and self._row < writer.layout.rows and _matches(obj, kind, spec):
            # the hot path: one copy into a precomputed view of the row
            self._specs.append(spec)
            target = writer.row_view(k, self._row)
            if kind is torch.Tensor:
                target.copy_(obj)
            else:
                target.numpy()[...] = obj
            return _REFS[k] if k < len(_REFS) else _Ref(k)
        if spec is None or not _matches(obj, kind, spec):
            spec = leaf_spec(obj)
            if spec is None:
                self._specs.append(_NO_SPEC)
                return _Inline(obj)
        self._specs.append(spec)
        placed = writer._place(obj, spec, k, self._row)
        if placed is None:
            return _Inline(obj)
        if placed[0] == "c":
            return _ref(k)
        offset, spec = _overflow_spec(placed)
        return _Ovf(offset, spec)


_NO_SPEC = LeafSpec("x", "", ())
"""A leaf position that cannot live in a slot (an object array, a huge int)."""


def _unwrap(obj):
    """A skeleton made without a slot, with its ``_Inline`` leaves turned back into values."""
    kind = type(obj)
    if kind is _Inline:
        return obj.value
    if kind is tuple:
        return tuple([_unwrap(v) for v in obj])
    if kind is list:
        return [_unwrap(v) for v in obj]
    if kind is dict:
        return {key: _unwrap(v) for key, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return kind(*[_unwrap(v) for v in obj])
    return obj


def move_into_slot(payload: bytes, segment, layout: Layout, row: int) -> bytes:
    """Rewrite a row pickled without a slot (the sample that taught the layout) so that its
    leaves live in ``row`` of the slot, like every other row (one small copy, in the parent)."""
    writer = RowWriter(segment, layout, None, column_views(segment, layout))
    return writer.dump(_unwrap(pickle.loads(payload)), row)


def load_rows(rows: list[tuple[int, bytes]]) -> list:
    """Skeletons for ``(row, payload)`` pairs (``b""`` repeats the previous payload). When
    every payload is the same, one skeleton stands for every row."""
    samples = []
    last_payload = last = None
    for _, payload in rows:
        if payload and payload is not last_payload and payload != last_payload:
            last_payload = payload
            last = pickle.loads(payload)
        samples.append(last)
    return samples


def collate_rows(samples: list, rows: list[int], view: SlotView | None):
    """``default_collate`` over skeletons, with whole slot columns where rows are 0..n-1."""
    contiguous = rows == list(range(len(rows)))

    def column(batch, *, collate_fn_map=None):
        first = batch[0]
        if contiguous and view is not None and type(first) is _Ref and all(leaf is first for leaf in batch):
            return view.column(first.k, len(batch))
        values = [_value(leaf, row, view) for leaf, row in zip(batch, rows)]
        return collate(values, collate_fn_map=default_collate_fn_map)

    fn_map = dict(default_collate_fn_map)
    fn_map[_Ref] = fn_map[_Ovf] = fn_map[_Inline] = column
    return collate(samples, collate_fn_map=fn_map)


def _value(leaf, row: int, view: SlotView | None):
    kind = type(leaf)
    if kind is _Ref:
        return view.cell(leaf.k, row, as_numpy=False)
    if kind is _Ovf:
        return view.region(leaf.offset, leaf.spec, as_numpy=False)
    if kind is _Inline:
        return leaf.value
    return leaf


def _overflow_spec(pid: str) -> tuple[int, LeafSpec]:
    offset, kind, dtype, shape = pid[1:].split("|")
    return int(offset), LeafSpec(kind, dtype, tuple(int(d) for d in shape.split(",") if d))


def _numpy_dtype(dtype: torch.dtype):
    """numpy's equivalent of a torch dtype, or ``None`` (bfloat16, float8, ...)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        return None


class _Columns(list):
    """Column views of one slot, plus their row views and tensor views (made on first use)."""

    def __init__(self):
        super().__init__()
        self.rows: list = []
        self.tensors: list = []

    def tensor(self, k: int) -> torch.Tensor:
        """Column ``k`` as a tensor (a column kept as an ndarray is wrapped once)."""
        found = self.tensors[k]
        if found is None:
            column = self[k]
            found = self.tensors[k] = column if type(column) is torch.Tensor else torch.from_numpy(column)
        return found


def column_views(segment, layout: Layout | None) -> list | None:
    """Per leaf, the slot's column as a tensor (or ndarray) of ``(rows, *shape)``."""
    if segment is None or layout is None:
        return None
    columns = _Columns()
    columns.rows = [None] * len(layout.leaves)
    columns.tensors = [None] * len(layout.leaves)
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


class _LeafPickler(pickle.Pickler):
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
            return None
        k = len(self.specs)
        spec = self._writer.expected(k)
        if spec is None or not _matches(obj, kind, spec):
            spec = leaf_spec(obj)
            if spec is None:
                return None
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
        self.layout = layout
        weakref.finalize(hold, on_free)

    def _tensor(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A tensor over ``nbytes`` of the slot from ``offset``; it keeps the slot's array alive."""
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._hold, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)

    def column(self, k: int, n: int) -> torch.Tensor:
        spec = self.layout.leaves[k]
        return self._tensor(self.layout.offsets[k], spec.nbytes * n, spec.torch_dtype, (n, *spec.shape))

    def rows(self, k: int, row0: int, n: int) -> torch.Tensor:
        """Rows ``row0 .. row0 + n`` of column ``k``."""
        spec = self.layout.leaves[k]
        off = self.layout.offsets[k] + row0 * spec.nbytes
        return self._tensor(off, spec.nbytes * n, spec.torch_dtype, (n, *spec.shape))

    def cell(self, k: int, row: int, as_numpy: bool):
        spec = self.layout.leaves[k]
        value = self.region(self.layout.offsets[k] + row * spec.nbytes, spec, as_numpy)
        return value.item() if spec.kind == "p" else value

    def region(self, offset: int, spec: LeafSpec, as_numpy: bool):
        if as_numpy and spec.kind == "n":
            return self._hold[offset : offset + spec.nbytes].view(np.dtype(spec.dtype)).reshape(spec.shape)
        return self._tensor(offset, spec.nbytes, spec.torch_dtype, spec.shape)

    def release(self) -> None:
        """Drop this object's own references; the finalizer fires once user tensors are gone."""
        self._hold = None


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, view: SlotView | None):
        super().__init__(io.BytesIO(data))
        self._view = view

    def persistent_load(self, pid):
        if type(pid) is tuple and pid[0] == "i":
            return pid[1]
        if pid[0] == "c":
            return self._view.cell(int(pid[1:]), 0, as_numpy=True)
        if pid[0] == "o":
            offset, spec = _overflow_spec(pid)
            return self._view.region(offset, spec, as_numpy=True)
        raise pickle.UnpicklingError(f"unknown leaf id {pid!r}")


def load_batch(data: bytes, view: SlotView | None):
    """A whole batch pickled by :class:`SlotWriter` (custom ``collate_fn`` and the like)."""
    return _LeafUnpickler(data, view).load()
