"""A list of strings that forked workers share instead of copying (the copy-on-read problem).

A worker started by ``fork`` shares its parent's memory until either writes a page. Reading a
Python object writes to it: its reference count changes. So a dataset holding a list of a
million path strings, indexed by every worker, ends up copied page by page into every worker,
and each worker's memory grows towards the size of the list over an epoch. Arrays of plain
bytes have no per-item objects to count: :class:`StringList` keeps all the strings in one
``uint8`` buffer with an ``int64`` array of offsets, and builds a ``str`` only when an item is
asked for. Numbers (labels, sizes) belong in numpy arrays for the same reason.
"""

from __future__ import annotations

import array
import itertools
import os
import sys
from collections.abc import Iterable, Sequence

_ENCODING = (sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())


class StringList(Sequence):
    """A read-only sequence of ``str`` stored in two buffers (no Python object per item).

    ``StringList(paths)`` accepts any iterable of ``str`` or path-like objects;
    ``strings[i]`` returns a ``str``, ``strings[a:b]`` a ``StringList``. The strings live in
    one ``bytes`` object and their offsets in one ``array('q')``; both pickle as single
    buffers, so a ``StringList`` also travels cheaply to ``spawn``/``forkserver`` workers.
    """

    __slots__ = ("_data", "_offsets")

    def __init__(self, strings: Iterable[str | os.PathLike] = ()):
        encoded = [os.fsencode(s) for s in strings]
        self._offsets = array.array("q", itertools.accumulate((len(b) for b in encoded), initial=0))
        self._data = b"".join(encoded)

    @classmethod
    def _from_arrays(cls, data: bytes, offsets: array.array) -> "StringList":
        out = cls.__new__(cls)
        out._data, out._offsets = data, offsets
        return out

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return StringList(self[i] for i in range(start, stop, step))
            stop = max(start, stop)
            first = self._offsets[start]
            offsets = array.array("q", (o - first for o in self._offsets[start : stop + 1]))
            return StringList._from_arrays(self._data[first : self._offsets[stop]], offsets)
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"StringList index {index} out of range for length {n}")
        return self._data[self._offsets[i] : self._offsets[i + 1]].decode(*_ENCODING)

    def __getstate__(self):
        return self._data, self._offsets

    def __setstate__(self, state):
        self._data, self._offsets = state

    @property
    def nbytes(self) -> int:
        """Memory held by the two buffers."""
        return len(self._data) + self._offsets.itemsize * len(self._offsets)

    def __repr__(self) -> str:
        return f"StringList({len(self)} strings, {self.nbytes} bytes)"
