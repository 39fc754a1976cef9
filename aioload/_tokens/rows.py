"""A packed row's tensors, from the tokens of its spans.

A row holds ``seq_len + 1`` tokens; the model reads the first ``seq_len`` and predicts the
last ``seq_len`` (``labels`` are the inputs shifted by one). Per row:

* ``input_ids`` ``[seq_len]`` int64;
* ``labels`` ``[seq_len]`` int64: the next token, or ``-100`` (PyTorch's and Hugging Face's
  ``ignore_index``) where the next token belongs to another document, so that no position
  learns to predict across a document boundary;
* ``position_ids`` ``[seq_len]`` int64: restarting at 0 where each document starts in the row,
  and at the row's first token (a document continued from another row starts again at 0: its
  earlier tokens are not in this row, and Hugging Face's flash-attention path reads a 0 as the
  start of a sequence);
* ``document_ids`` ``[seq_len]`` int32: which of the row's documents each input token is in
  (0, 1, ...). A fixed-size column that collates into ``[batch, seq_len]``: document-wise
  causal attention is ``document_ids[:, :, None] == document_ids[:, None, :]`` under the
  causal mask (``flex_attention``'s document mask), and :func:`cu_seqlens` turns a batch of
  them into flash-attention's varlen boundaries.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100
"""The label of a position whose next token belongs to another document."""


def row_tensors(pieces: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The row made of ``pieces`` (each a document's tokens in the row, in order; together
    ``seq_len + 1`` tokens)."""
    tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    sizes = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
    segment = np.repeat(np.arange(len(pieces), dtype=np.int32), sizes)
    starts = np.cumsum(sizes) - sizes
    positions = np.arange(tokens.size, dtype=np.int64) - np.repeat(starts, sizes)
    labels = tokens[1:].astype(np.int64, copy=True)
    labels[segment[1:] != segment[:-1]] = IGNORE
    return {
        "input_ids": torch.from_numpy(tokens[:-1].astype(np.int64, copy=True)),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions[:-1]),
        "document_ids": torch.from_numpy(segment[:-1]),
    }


def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flash-attention's varlen boundaries for a batch of packed rows: ``(cu_seqlens,
    max_seqlen)``, ``cu_seqlens`` int32 ``[sequences + 1]`` over the batch's tokens flattened
    row after row (every row's documents are sequences of their own; a document never runs on
    into the next row). ``document_ids`` is ``[batch, seq_len]`` or ``[seq_len]``, on any
    device; ``max_seqlen`` is a Python int (on a GPU, reading it waits for the device)."""
    if document_ids.dim() == 1:
        document_ids = document_ids.unsqueeze(0)
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq_len] or [seq_len], got shape {tuple(document_ids.shape)}")
    batch, length = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([batch * length], dtype=first.dtype, device=first.device)
    bounds = torch.cat([first, end]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    return bounds, longest
