"""The source's documents, and how each becomes token ids.

A source is any map-style dataset of documents: aioload's split datasets (``aioload.Parquet``
rows, a dataset of one's own) are read with their ``read`` (on the event loop, many at once)
and decoded with their ``decode``; any other (a list, a torch dataset) is loaded with
``source[i]``. A document is

* text (``str``, or ``bytes`` in UTF-8), or a dict with the text in ``column`` (``"text"``
  unless told), when a ``tokenizer`` is given: any callable ``str -> list[int]``, a
  ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer (called without special tokens:
  ``bos=``/``eos=`` add them);
* token ids (a list, an array, a 1-D tensor), or a dict with them in ``column``, without one.

A missing value (``None``: a null in a Parquet column) is a document without tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, is_split

TEXT_COLUMN = "text"

_CALL, _TOKENIZERS, _TRANSFORMERS = "call", "tokenizers", "transformers"


class Encoder:
    """Text to token ids with any of the tokenizers :mod:`aioload._tokens.documents` accepts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if hasattr(tokenizer, "convert_tokens_to_ids") and callable(getattr(tokenizer, "encode", None)):
            self.kind = _TRANSFORMERS
        elif callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None)) \
                and hasattr(tokenizer, "get_vocab_size"):
            self.kind = _TOKENIZERS
        elif callable(tokenizer):
            self.kind = _CALL
        else:
            raise TypeError(f"tokenizer must be a callable str -> list[int], a tokenizers.Tokenizer or a "
                            f"transformers tokenizer, got {type(tokenizer).__name__}")

    def __call__(self, text: str):
        if self.kind == _TRANSFORMERS:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self.kind == _TOKENIZERS:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text)

    def identity(self) -> str:
        """What names this tokenizer across runs, for the lengths cache: its whole definition
        where it has one (``to_str``), else its type."""
        backend = self.tokenizer if self.kind == _TOKENIZERS else getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and callable(getattr(backend, "to_str", None)):
            return backend.to_str()
        kind = type(self.tokenizer)
        return f"{kind.__module__}.{kind.__qualname__}"


class Documents:
    """The source's documents as token ids: fetched (:meth:`read`, :meth:`read_nowait`),
    loaded (:meth:`load`) and tokenized (:meth:`tokens`).

    ``keep_tokens``: tokenized documents kept in each process (by their tokens, least recently
    used first), for rows that cut one long document in turn (an order without shuffling).
    """

    def __init__(self, source, tokenizer=None, column: str | None = None, keep_tokens: int = 1 << 20):
        if isinstance(source, torch.utils.data.IterableDataset):
            raise TypeError("source is an IterableDataset: packing reads documents by index, so the source must "
                            "be map-style (aioload.Parquet, a list, a torch Dataset with __len__)")
        try:
            len(source)
        except TypeError:
            raise TypeError(f"source must be a map-style dataset of documents with a len(), got "
                            f"{type(source).__name__}") from None
        if column is not None and not isinstance(column, str):
            raise TypeError(f"column must be a string naming a field of the documents, got {column!r}")
        self.source = source
        self.split = is_split(source)
        self.encoder = Encoder(tokenizer) if tokenizer is not None else None
        self.column = column
        self.keep_tokens = keep_tokens
        self._kept: OrderedDict[int, np.ndarray] = OrderedDict()
        self._kept_size = 0
        self._kept_lock = threading.Lock()  # an executor's thread pool decodes in threads at once

    def __len__(self) -> int:
        return len(self.source)

    # -- fetching ----------------------------------------------------------------------------
    @property
    def read_in_workers(self) -> bool:
        return getattr(self.source, "read_in_workers", True) if self.split else True

    def read_nowait(self, doc: int) -> Any:
        if not self.split:
            return None
        return self.source.read_nowait(doc)

    async def read(self, doc: int) -> Any:
        return await self.source.read(doc) if self.split else None

    def read_blocking(self, doc: int) -> Any:
        return self.source.read_blocking(doc) if self.split else None

    def load(self, doc: int, raw: Any) -> Any:
        """Document ``doc`` from what :meth:`read` returned for it."""
        return self.source.decode(raw) if self.split else self.source[doc]

    def describe(self, doc: int) -> str:
        describe = getattr(self.source, "describe", None)
        where = describe(doc) if callable(describe) else None
        return f"document {doc}" + (f" ({where})" if where else "")

    # -- tokens ------------------------------------------------------------------------------
    def tokens(self, doc: int, document: Any) -> np.ndarray:
        """The token ids of document ``doc`` (``document``, as loaded), int64."""
        with self._kept_lock:
            kept = self._kept.get(doc)
            if kept is not None:
                self._kept.move_to_end(doc)
                return kept
        ids = self._ids(doc, document)
        if ids.size <= self.keep_tokens // 4:
            with self._kept_lock:
                if doc not in self._kept:
                    self._kept[doc] = ids
                    self._kept_size += ids.size
                while self._kept_size > self.keep_tokens:
                    self._kept_size -= self._kept.popitem(last=False)[1].size
        return ids

    def count(self, doc: int, document: Any) -> int:
        """How many tokens document ``doc`` has."""
        return int(self._ids(doc, document).size)

    def _ids(self, doc: int, document: Any) -> np.ndarray:
        value = self._field(doc, document)
        if value is None:  # a missing value (a null in a Parquet column): a document without tokens
            return np.zeros(0, dtype=np.int64)
        if self.encoder is not None:
            if isinstance(value, (bytes, bytearray, memoryview)):
                value = bytes(value).decode("utf-8")
            if not isinstance(value, str):
                raise TypeError(f"{self.describe(doc)} is {type(value).__name__}, not text: with a tokenizer the "
                                "documents (or their column) must be str; without one, token ids")
            value = self.encoder(value)
        elif isinstance(value, (str, bytes)):
            raise TypeError(f"{self.describe(doc)} is text: pass tokenizer= to tokenize it, or column= naming a "
                            "field of token ids")
        try:
            ids = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{self.describe(doc)}'s tokens are {type(value).__name__}, not a sequence of "
                            "integers") from exc
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{self.describe(doc)}'s tokens must be a 1-D sequence of integers, got "
                            f"{ids.dtype} of shape {ids.shape}")
        return ids.astype(np.int64, copy=False)

    def _field(self, doc: int, document: Any) -> Any:
        if not isinstance(document, Mapping):
            if self.column is not None:
                raise TypeError(f"{self.describe(doc)} is {type(document).__name__}, not a dict: column="
                                f"{self.column!r} names a field of dict documents; leave it out for plain ones")
            return document
        column = self.column if self.column is not None else (TEXT_COLUMN if self.encoder is not None else None)
        if column is None:
            raise TypeError(f"{self.describe(doc)} is a dict ({', '.join(map(repr, document))}): pass column= "
                            "naming its token ids, or tokenizer= (and column=) for its text")
        if column not in document:
            raise ValueError(f"{self.describe(doc)} has no field {column!r} (it has "
                           f"{', '.join(map(repr, document))}): pass column= naming the field to pack")
        return document[column]

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_kept"], state["_kept_size"] = OrderedDict(), 0
        del state["_kept_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._kept_lock = threading.Lock()
