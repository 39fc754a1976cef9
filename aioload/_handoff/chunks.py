"""Chunk mode: a worker collates a whole chunk of a batch straight into its slot rows.

Used on both sides: :class:`ChunkWriter` in the worker, :func:`join_chunks` in the parent (and
:func:`move_chunk_into_slot` there for the sample that taught the layout, and
:func:`chunk_samples` for a batch whose parts do not join).

With default collation and samples made of tensors, numeric arrays, numbers and strings
(nested in tuples, lists, dicts, namedtuples), a worker runs torch's own ``collate`` over its
chunk with leaf functions that stack each column into the slot (``torch.stack(out=...)``) and
return its place instead (:class:`~aioload._handoff.layout.Column`, or
:class:`~aioload._handoff.layout.Inline` for a stack that is not in the slot). The parent receives
one skeleton per chunk and joins the chunks column by column: a column whose chunks fill rows
``0..n-1`` is a view of the slot. The cost per sample is then one ``__getitem__`` and a share
of one ``stack``; structure, dtypes and errors stay ``default_collate``'s.
"""

from __future__ import annotations

import functools
import itertools
import pickle
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from aioload._handoff.layout import Column, Inline, Layout, LeafSpec, in_column
from aioload._handoff.tree import leaves, map_leaves

CHUNK_MAGIC = b"\x00K"
"""First bytes of a chunk-mode payload (a pickle starts with b"\\x80")."""

_NUMPY_SCALARS = (np.bool_, np.number, np.object_)


class _Seq:
    """Strings or bytes: ``default_collate`` keeps the column as it is (a tuple or a list)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (_Seq, (self.value,))


class _Numbers:
    """A column of Python numbers, stored losslessly (float64, int64 or bool) by ``inner``.
    ``default_collate`` gives such a column the dtype of the whole batch (float64 when its
    first value is a float, else what ``torch.tensor`` infers from every value), which one
    chunk cannot see: ``first`` is the kind of the chunk's first value and ``kinds`` every
    kind it held ("b" bool, "i" int, "f" float); the parent decides when it joins. ``each``
    is every value's kind, kept only when they differ (to give each value back as it was)."""

    __slots__ = ("inner", "first", "kinds", "each")

    def __init__(self, inner, first: str, kinds: str, each: str | None = None):
        self.inner, self.first, self.kinds, self.each = inner, first, kinds, each

    def __reduce__(self):
        return (_Numbers, (self.inner, self.first, self.kinds, self.each))


def _kind_of(t: type) -> str | None:
    if issubclass(t, bool):
        return "b"
    if issubclass(t, int):
        return "i"
    if issubclass(t, float):
        return "f"
    return None


_LOSSLESS = {"f": torch.float64, "i": torch.int64, "b": torch.bool}


def batch_dtype(first: str, kinds: str) -> torch.dtype:
    """``default_collate``'s dtype for a batch of Python numbers (see :class:`_Numbers`)."""
    if first == "f":
        return torch.float64  # collate_float_fn
    if "f" in kinds:
        return torch.get_default_dtype()  # collate_int_fn: torch.tensor(batch) infers it
    return torch.int64 if "i" in kinds else torch.bool


class Unsupported(Exception):
    """A leaf that chunk mode cannot join across chunks (a type with its own collate
    function registered in ``default_collate_fn_map``): the worker falls back to rows."""


def _spec(t: torch.Tensor) -> LeafSpec:
    return LeafSpec("t", str(t.dtype), tuple(t.shape[1:]))


class ChunkWriter:
    """Collates one chunk (rows ``row0 .. row0 + n``) into a slot; see the module docstring."""

    def __init__(self, segment, layout: Layout | None, row0: int, columns):
        self.layout = layout if segment is not None else None
        self.columns = columns
        self.row0 = row0
        self.specs: list[LeafSpec] = []

    def dump(self, samples: list) -> bytes:
        self.specs = []
        fn_map = dict(default_collate_fn_map)  # a local map: no cycle through bound methods
        fn_map[torch.Tensor] = self._tensor
        fn_map[float] = fn_map[int] = fn_map[bool] = self._number
        fn_map[_NUMPY_SCALARS] = self._numpy_scalar
        fn_map[str] = fn_map[bytes] = self._strings
        skeleton = collate(samples, collate_fn_map=fn_map)
        check_supported(skeleton)
        return CHUNK_MAGIC + pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    # -- leaf functions (called by torch's collate) -----------------------------------------
    def _column(self, k: int, spec: LeafSpec):
        layout = self.layout
        if layout is None or k >= len(layout.leaves) or layout.leaves[k] != spec:
            return None
        return self.columns.tensor(k)

    def _put(self, stacked: torch.Tensor):
        k = len(self.specs)
        spec = _spec(stacked)
        self.specs.append(spec)
        column = self._column(k, spec)
        n = stacked.shape[0]
        if column is None or self.row0 + n > column.shape[0]:
            return Inline(stacked)
        column[self.row0 : self.row0 + n].copy_(stacked)
        return in_column(k)

    def _tensor(self, batch, *, collate_fn_map=None):
        elem = batch[0]
        if elem.is_nested or elem.layout is not torch.strided:
            return Inline(default_collate_fn_map[torch.Tensor](batch))  # raises torch's error
        k = len(self.specs)
        spec = LeafSpec("t", str(elem.dtype), tuple(elem.shape))
        column = self._column(k, spec)
        n = len(batch)
        if column is not None and self.row0 + n <= column.shape[0]:
            self.specs.append(spec)
            torch.stack(batch, 0, out=column[self.row0 : self.row0 + n])
            return in_column(k)
        return self._put(torch.stack(batch, 0))

    def _number(self, batch, *, collate_fn_map=None):
        kinds = set()
        types = set(map(type, batch))
        for t in types:
            kind = _kind_of(t)
            if kind is None:  # not a number after all: torch's own function raises its error
                return self._put(default_collate_fn_map[float if type(batch[0]) is float else int](batch))
            kinds.add(kind)
        kinds = "".join(sorted(kinds))
        lossless = _LOSSLESS["f" if "f" in kinds else "i" if "i" in kinds else "b"]
        inner = self._store_numbers(batch, lossless)
        if inner is None:
            inner = self._put(torch.tensor(batch, dtype=lossless))
        each = "".join(_kind_of(type(value)) for value in batch) if len(kinds) > 1 else None
        return _Numbers(inner, _kind_of(type(batch[0])), kinds, each)

    def _store_numbers(self, batch, dtype: torch.dtype):
        """The values straight into their column of the slot: one numpy store, a sixth of the
        cost of building a tensor first. ``None`` when the column is not there, or a value
        does not fit (an int beyond int64: torch's own conversion then raises its error)."""
        k = len(self.specs)
        spec = LeafSpec("t", str(dtype), ())
        n = len(batch)
        if self._column(k, spec) is None or self.row0 + n > self.layout.rows:
            return None
        try:
            self.columns[k][self.row0 : self.row0 + n] = batch
        except (OverflowError, ValueError, TypeError):
            return None
        self.specs.append(spec)
        return in_column(k)

    def _numpy_scalar(self, batch, *, collate_fn_map=None):
        if isinstance(batch[0], np.object_):
            return default_collate_fn_map[_NUMPY_SCALARS](batch)
        return self._put(torch.as_tensor(batch))

    def _strings(self, batch, *, collate_fn_map=None):
        return _Seq(batch)


def _unjoinable(node) -> bool:
    """A mapping other than a dict (a tokenizer's ``BatchEncoding``, say): ``collate`` copies
    it with whatever else it carries, which a join of chunks cannot, so it is not looked into
    and fails the check below; the batch then goes to rows mode."""
    return isinstance(node, Mapping) and not isinstance(node, dict)


def check_supported(skeleton) -> None:
    """Raise :class:`Unsupported` if a leaf of ``skeleton`` is not a chunk-mode marker."""
    for leaf in leaves(skeleton, is_leaf=_unjoinable):
        kind = type(leaf)
        if kind is _Numbers:
            check_supported(leaf.inner)
        elif kind is not Column and kind is not Inline and kind is not _Seq:
            raise Unsupported(kind.__name__)


# ----------------------------------------------------------------------------- parent side


def join_chunks(chunks: list[tuple[int, int, object]], view):
    """The batch from ``(first row, rows, skeleton)`` per chunk, in row order. The skeletons
    are walked in lockstep (``aioload._handoff.tree``): a sequence whose length differs between
    chunks raises ``ValueError``, as ``default_collate`` does in rows."""
    contiguous = chunks[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    spans = [(r0, n) for r0, n, _ in chunks]
    # a partial of a module-level function, not a closure calling itself: a self-referencing
    # closure is a reference cycle that would keep the slot view (and so the slot) alive
    # until gc runs
    join = functools.partial(_join, view, spans, contiguous)
    return map_leaves(join, *(skeleton for _, _, skeleton in chunks))


def _join(view, spans, contiguous: bool, *nodes):
    """One leaf of the batch from that leaf of every chunk."""
    first = nodes[0]
    kind = type(first)
    if kind is Column and contiguous and all(type(n) is Column for n in nodes):
        return view.column(first.k, sum(n for _, n in spans))
    if kind is Column or kind is Inline:
        parts = [view.rows(n.k, r0, count) if type(n) is Column else n.value for n, (r0, count) in zip(nodes, spans)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    if kind is _Numbers:
        joined = _join(view, spans, contiguous, *(n.inner for n in nodes))
        dtype = batch_dtype(first.first, "".join(n.kinds for n in nodes))
        return joined if joined.dtype == dtype else joined.to(dtype)
    if kind is _Seq:
        if len(nodes) == 1:
            return first.value
        return type(first.value)(itertools.chain(*(n.value for n in nodes)))
    raise TypeError(f"cannot join chunks holding {kind.__name__}")


_PYTHON = {"b": bool, "i": int, "f": float}


def chunk_samples(skeleton, view, row0: int, count: int) -> list:
    """The ``count`` samples of a chunk (rows ``row0 ..``), each as its sample held it: its
    tensors (views of the slot), numbers and strings, in the containers ``collate`` made of
    them (a tuple comes back as a list, as ``collate`` makes it). For a batch whose chunks do
    not join, or that also holds rows: the parent collates every sample again, so that the
    batch and its error are ``default_collate``'s over the whole batch."""
    columns: dict = {}

    def column(k: int):
        if k not in columns:
            columns[k] = view.rows(k, row0, count)
        return columns[k]

    def value(node, i: int):
        kind = type(node)
        if kind is Column:
            return column(node.k)[i]
        if kind is Inline:
            return node.value[i]
        if kind is _Numbers:
            number = value(node.inner, i).item()
            return _PYTHON[node.each[i] if node.each is not None else node.kinds[0]](number)
        if kind is _Seq:
            return node.value[i]
        raise TypeError(f"cannot take rows from a chunk holding {kind.__name__}")

    return [map_leaves(functools.partial(value, i=i), skeleton) for i in range(count)]


def load_chunk(payload: bytes):
    return pickle.loads(payload[len(CHUNK_MAGIC):])


def move_chunk_into_slot(payload: bytes, segment, layout: Layout, columns, row0: int) -> bytes:
    """Rewrite a chunk collated without a slot (the sample that taught the layout) so that
    its leaves live in the slot's rows from ``row0``."""
    writer = ChunkWriter(segment, layout, row0, columns)
    moved = map_leaves(functools.partial(_move, writer), load_chunk(payload))
    return CHUNK_MAGIC + pickle.dumps(moved, protocol=pickle.HIGHEST_PROTOCOL)


def _move(writer: ChunkWriter, node):
    kind = type(node)
    if kind is Inline:
        return writer._put(node.value)
    if kind is _Numbers:
        return _Numbers(_move(writer, node.inner), node.first, node.kinds, node.each)
    return node
