"""``aioload.PackedTokens``: a map-style dataset whose samples are packed rows of tokens.

Row ``r``'s read fetches the documents its spans name through the source (its ``read``, all
at once, where the source is split; nothing where it is a plain dataset, which is loaded in
the decode); its decode tokenizes them, cuts the spans and builds the row's tensors
(:mod:`aioload._tokens.rows`). The epoch's order over rows is the loader's, computed from
``(seed, epoch)`` (:meth:`PackedTokens.epoch_order`), dealt to ranks in equal numbers of rows,
resumed as a position, the same at any ``num_workers``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from aioload._data.dataset import NOT_READY, Dataset
from aioload._plan.order import BLOCKS, STRIDE, epoch_order
from aioload._shards.order import window_order
from aioload._tokens.documents import Documents
from aioload._tokens.lengths import document_lengths
from aioload._tokens.plan import blocks, document_groups, pack
from aioload._tokens.rows import cu_seqlens, row_tensors


class PackedTokens(Dataset):
    """Documents tokenized, concatenated and cut into rows of ``seq_len + 1`` tokens.

    ``source``: a map-style dataset of documents (``aioload.Parquet``, a list of strings, any
    dataset with ``__len__``); with ``tokenizer`` each document is text (a ``str``, or a dict
    with it in ``column``, ``"text"`` by default), tokenized by a callable ``str ->
    list[int]``, a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer (without special
    tokens); without one each document is token ids (or a dict with them in ``column``).

    Each sample is a dict of ``[seq_len]`` tensors: ``input_ids``, ``labels`` (the next token;
    ``-100`` where it belongs to another document), ``position_ids`` (restarting at each
    document) and ``document_ids`` (which of the row's documents each token is in; see
    :meth:`cu_seqlens` for flash-attention's varlen boundaries).

    * ``bos``, ``eos`` -- token ids put before and after every document (``None``: none).
    * ``lengths`` -- each document's token count, if known: a sequence of ints (without
      ``bos``/``eos``), or the name of a field of each document that holds it (read as one
      column where the source can: ``aioload.Parquet.read_column``). ``None``: counted in
      one index pass over the source when the dataset is made.
    * ``cache`` -- a file that keeps the counts of an index pass for the next run (``.npz``).
    * ``index_workers`` -- worker processes of the index pass (0: in this process).
    * ``seed``, ``shuffle_documents`` -- the order the documents are laid end to end in
      before they are cut: seeded by ``seed`` (the default without ``window``), or index
      order. The packing is fixed for the dataset; each epoch visits its rows in the loader's
      order for ``(seed, epoch)``.
    * ``window`` -- ``None``: a uniform shuffle over the rows. ``k``: the documents laid down
      in index order, and each epoch's rows drawn from ``k`` open *blocks* at a time (the rows
      that begin in one of the source's row groups: ``aioload.Parquet``'s, else 1,024
      documents), a block opening when another's last row has been drawn; the rows reaching
      a worker then read from about ``k`` row groups at a time, not one row group per row.

    Every token of every document is in exactly one row (a document without tokens is in
    none, and gets no ``bos``/``eos``), except the last ``len(tokens) mod
    (seq_len + 1)`` of the stream (:attr:`tail`), which are in none.
    """

    def __init__(self, source, seq_len: int, *, tokenizer=None, column: str | None = None, lengths=None,
                 bos: int | None = None, eos: int | None = None, seed: int = 0,
                 shuffle_documents: bool | None = None, window: int | None = None, cache=None,
                 index_workers: int = 0):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        for name, value in (("bos", bos), ("eos", eos)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a token id (an int >= 0) or None, got {value!r}")
        if isinstance(index_workers, bool) or not isinstance(index_workers, int) or index_workers < 0:
            raise ValueError(f"index_workers must be an int >= 0, got {index_workers!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
        if window is not None and shuffle_documents:
            raise ValueError("window= draws rows from blocks of documents that are neighbours in the source, "
                             "so the documents are laid down in index order: leave shuffle_documents out (or "
                             "False) with window=")
        self.window = window
        self.documents = Documents(source, tokenizer, column)
        self.seq_len = seq_len
        self.bos, self.eos = bos, eos
        self._extra = (bos is not None) + (eos is not None)
        counts = document_lengths(self.documents, lengths, cache, index_workers)
        # A document without tokens is in no row: it gets no bos/eos either.
        self.lengths = counts + self._extra * (counts > 0)
        self.packing = pack(self.lengths, seq_len, seed, window is None and shuffle_documents is not False)
        if self.packing.rows == 0:
            raise ValueError(f"the {len(self.documents)} documents hold {self.packing.tail} tokens, fewer than one "
                             f"row of seq_len + 1 = {seq_len + 1}: no row can be made; pass a smaller seq_len or "
                             "more documents")

        # window mode: rows per block, the blocks in row order
        self.block_rows = (blocks(self.packing, document_groups(source, len(self.documents))).tolist()
                           if window is not None else None)

    # -- the plan ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.packing.rows

    @property
    def tail(self) -> int:
        """Tokens at the end of the stream that are in no row (fewer than ``seq_len + 1``)."""
        return self.packing.tail

    def spans(self, row: int) -> list[tuple[int, int, int]]:
        """Row ``row``'s ``(document, start, stop)`` spans: the tokens ``[start, stop)`` of each
        document (counting ``bos``), in the row's order."""
        return self.packing.spans(row)

    @property
    def deal(self) -> str:
        """Every ``world_size``-th row to a rank (uniform), or contiguous runs of the order
        (window mode: each rank then reads row groups of its own)."""
        return STRIDE if self.window is None else BLOCKS

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """Epoch ``epoch``'s order over the rows, computed on every rank: a permutation seeded
        from ``(seed, epoch)`` (the loader's own rule), or drawn from ``window`` open blocks
        at a time; row order without shuffling."""
        if self.window is None or self.block_rows is None:
            return epoch_order(None, len(self), seed, epoch, shuffle)
        return window_order(self.block_rows, self.window, seed, epoch, shuffle)

    @staticmethod
    def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens, max_seqlen)`` for flash-attention's varlen functions from a batch's
        ``document_ids`` ``[batch, seq_len]``: int32 boundaries over the batch's tokens
        flattened row after row, each document of each row a sequence."""
        return cu_seqlens(document_ids)

    # -- loading ------------------------------------------------------------------------------
    @property
    def read_in_workers(self) -> bool:
        return self.documents.read_in_workers

    def read_nowait(self, index: int) -> Any:
        spans = self.spans(index)
        raws = []
        for doc, _, _ in spans:
            raw = self.documents.read_nowait(doc)
            if raw is NOT_READY:
                return NOT_READY
            raws.append(raw)
        return index, spans, raws

    async def read(self, index: int) -> Any:
        spans = self.spans(index)
        if not self.documents.split:
            return index, spans, [None] * len(spans)
        if len(spans) == 1:
            return index, spans, [await self.documents.read(spans[0][0])]
        reads = [asyncio.ensure_future(self.documents.read(doc)) for doc, _, _ in spans]
        try:
            raws = await asyncio.gather(*reads)
        except BaseException:
            # One read failed (or the row's read was cancelled): the others end with it.
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            raise
        return index, spans, list(raws)

    def read_blocking(self, index: int) -> Any:
        spans = self.spans(index)
        return index, spans, [self.documents.read_blocking(doc) for doc, _, _ in spans]

    def decode(self, raw: Any) -> dict[str, torch.Tensor]:
        index, spans, raws = raw
        pieces = [self._piece(doc, item, start, stop) for (doc, start, stop), item in zip(spans, raws)]
        return row_tensors(pieces)

    def _piece(self, doc: int, item: Any, start: int, stop: int) -> np.ndarray:
        tokens = self.documents.tokens(doc, self.documents.load(doc, item))
        if tokens.size + self._extra != self.lengths[doc]:
            raise ValueError(
                f"{self.documents.describe(doc)} has {tokens.size} tokens now and had {self.lengths[doc] - self._extra} "
                "when the packing was computed: the lengths (given, or a cache file made with another source or "
                "tokenizer) do not match the documents; pass the right lengths, or delete the cache file")
        return self._cut(tokens, start, stop)

    def _cut(self, tokens: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the document framed by ``bos``/``eos``, without copying
        the whole document to frame it."""
        if not self._extra:
            return tokens[start:stop]
        lead = int(self.bos is not None)
        parts = []
        if lead and start == 0:
            parts.append(np.array([self.bos], dtype=np.int64))
        parts.append(tokens[max(start - lead, 0): max(stop - lead, 0)])
        if self.eos is not None and stop == tokens.size + self._extra:
            parts.append(np.array([self.eos], dtype=np.int64))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def describe(self, index: int) -> str | None:
        if not 0 <= index < len(self):
            return None
        docs = ", ".join(self.documents.describe(doc) for doc, _, _ in self.spans(index))
        return f"packed row {index}: {docs}"

    def __repr__(self) -> str:
        return (f"PackedTokens({len(self)} rows of {self.seq_len} tokens from {len(self.documents)} documents, "
                f"{self.tail} tokens in the tail)")
