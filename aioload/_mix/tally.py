"""How many samples of each source a mixed loader has delivered (``loader.stats().per_source``).

The plan knows each batch's indices when the engine pulls it (:class:`aioload._plan.sampling._Numbered`
tells the tally then, on the engine's thread); a batch counts once the consumer has it (its
sequence number is in the epoch's delivered set), so batches made again after a weight change
or dropped with their epoch are not counted twice.
"""

from __future__ import annotations

import threading

import torch


class SourceTally:
    """Samples delivered per source of an :class:`aioload.Mix`, over the loader's life."""

    def __init__(self, names, offsets):
        self.names = tuple(names)
        self._offsets = torch.tensor(offsets[1:], dtype=torch.int64)
        self._pending: dict[int, list[int]] = {}  # seq -> samples per source, until delivered
        self._totals = [0] * len(self.names)
        self._lock = threading.Lock()

    def pulled(self, seq: int, indices) -> None:
        flat = torch.as_tensor(indices if isinstance(indices, (list, tuple)) else [indices], dtype=torch.int64)
        counts = torch.bincount(torch.bucketize(flat, self._offsets, right=True), minlength=len(self.names))
        with self._lock:
            self._pending[seq] = counts.tolist()

    def settle(self, delivered) -> None:
        """Count the pulled batches the consumer has received (``delivered``: the epoch's set)."""
        with self._lock:
            for seq in [seq for seq in self._pending if seq in delivered]:
                for s, n in enumerate(self._pending.pop(seq)):
                    self._totals[s] += n

    def new_epoch(self) -> None:
        with self._lock:
            self._pending.clear()

    def figures(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(self.names, self._totals))
