"""Slot geometry: where each leaf of a batch lives in a shared-memory slot.

Used by both sides of the hand-off: the worker (and, for a sample that taught the layout, the
parent) writes leaves where this module says, and the parent reads them back from there.

A slot of ``rows`` rows holds one *column* per leaf position of a sample (a tensor, a numeric
numpy array or a Python number), each column ``rows * nbytes`` long and starting on an
``ALIGN``-byte boundary, then an *overflow* area for leaves whose shape differs from their
column's. A leaf's place is one of three small values, pickled into the skeleton that travels
over the socket and read back by the parent:

* :class:`Column` ``(k)``: in column ``k``, at the sample's row (a whole batch: row 0; a chunk:
  its rows);
* :class:`Overflow` ``(offset, spec)``: ``spec.nbytes`` bytes at ``offset`` in the overflow area;
* :class:`Inline` ``(value)``: not in the slot, carried in the pickle itself (no slot yet, no
  room, or a leaf no slot can hold).

Guarantees: a layout's offsets depend only on its leaves, rows and overflow size, so the
worker and the parent that build it from the same description agree on every byte; every
column and every overflow leaf starts ``ALIGN``-aligned.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64
_NUMERIC_KINDS = frozenset("biufc")


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
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
    """Shape and dtype of one leaf position. ``kind``: ``"t"`` a tensor, ``"n"`` a numpy array
    (``dtype`` is numpy's ``dtype.str``), ``"p"`` a Python number (stored as a 0-d tensor of
    ``dtype``), ``"x"`` a position no slot can hold (:data:`NO_SPEC`)."""

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
        return (self.kind, self.dtype, self.shape)  # not the memoised properties

    def __setstate__(self, state):
        for name, value in zip(("kind", "dtype", "shape"), state):
            object.__setattr__(self, name, value)


NO_SPEC = LeafSpec("x", "", ())
"""A leaf position that cannot live in a slot (an object array, a huge int)."""

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)``, one string object per dtype: a skeleton that names it many times (a list
    of overflow leaves) pickles it once, the rest as back-references."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = sys.intern(str(dtype))
    return name


def leaf_spec(obj) -> LeafSpec | None:
    """The spec of ``obj`` if it can live in a slot, else ``None`` (it is pickled instead)."""
    if type(obj) is torch.Tensor:
        if obj.layout is not torch.strided or obj.device.type != "cpu" or obj.requires_grad:
            return None
        if obj.is_quantized or obj.is_conj() or obj.is_neg():
            return None
        return LeafSpec("t", _dtype_name(obj.dtype), tuple(obj.shape))
    if type(obj) is np.ndarray and obj.dtype.kind in _NUMERIC_KINDS and obj.dtype.isnative:
        return LeafSpec("n", obj.dtype.str, tuple(obj.shape))
    return None


INT64 = (-(2**63), 2**63)
"""The ints a column of Python ints holds (``[lo, hi)``); a larger one is carried inline."""

NUMBER_SPECS = {
    bool: LeafSpec("p", "torch.bool", ()),
    int: LeafSpec("p", "torch.int64", ()),
    float: LeafSpec("p", "torch.float64", ()),
}


def number_spec(obj) -> LeafSpec | None:
    """Python numbers become columns too in row mode: ``default_collate`` turns a column of
    ints into int64, floats into float64 and bools into bool tensors."""
    spec = NUMBER_SPECS.get(type(obj))
    if spec is not None and type(obj) is int and not INT64[0] <= obj < INT64[1]:
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
            end = align(end + spec.nbytes * rows)
        self.fixed_bytes = end
        self.overflow = align(overflow)
        self.size = self.fixed_bytes + self.overflow

    def with_overflow(self, overflow: int) -> "Layout":
        return Layout(self.leaves, self.rows, overflow)

    def with_rows(self, rows: int) -> "Layout":
        """The same leaves for ``rows`` rows; the overflow area keeps its share per row."""
        return Layout(self.leaves, rows, self.overflow * rows // max(1, self.rows))

    def describe(self) -> tuple:
        """What a task sends so that the worker can build the same layout: ``Layout(*desc)``."""
        return (self.leaves, self.rows, self.overflow)


# ----------------------------------------------------------------------------- places
#
# Plain slotted classes, not namedtuples: a place sits in a skeleton where torch's collate and
# the leaf walker (aioload._handoff.tree) would take a namedtuple for a container to look into.


@dataclass(frozen=True, slots=True)
class Column:
    """The leaf is in column ``k`` of the slot (at the sample's row, or the chunk's rows)."""

    k: int

    def __reduce__(self):
        return (in_column, (self.k,))


_COLUMNS = [Column(k) for k in range(256)]


def in_column(k: int) -> Column:
    """The place ``Column(k)``; one shared instance per column (a skeleton pickles it once)."""
    return _COLUMNS[k] if k < len(_COLUMNS) else Column(k)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 2x to unpickle
class Overflow:
    """The leaf is ``spec.nbytes`` bytes at ``offset`` in the slot (its overflow area)."""

    offset: int
    spec: LeafSpec

    def __reduce__(self):
        return (Overflow, (self.offset, self.spec))


@dataclass(slots=True, eq=False)  # not frozen (see Overflow); eq: a tensor's == is elementwise
class Inline:
    """The leaf is carried in the pickle itself (no slot yet, no room, or no slot can hold it)."""

    value: object

    def __reduce__(self):
        return (Inline, (self.value,))
