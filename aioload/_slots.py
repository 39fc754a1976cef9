"""Shared-memory batch slots: allocated once the layout is known, recycled, bounded.

A slot holds one batch. It is *busy* while workers write it and the batch waits to be
consumed, *out* while the consumer holds tensors that view it, and *free* again when those
tensors are gone (on a GPU: once the copy out of it has finished). The pool keeps at most
``target`` free slots; a slot beyond that (a consumer that keeps every batch, say) is freed
when released, so steady-state memory is ``target`` slots whatever the epoch count.
"""

from __future__ import annotations

import itertools
import threading

import torch

from aioload._layout import Layout
from aioload._shm import Segment


class Slot:
    __slots__ = ("id", "segment", "layout", "pinned")

    def __init__(self, slot_id: int, segment: Segment, layout: Layout):
        self.id, self.segment, self.layout, self.pinned = slot_id, segment, layout, False


def _cuda_register(segment: Segment) -> bool:
    cudart = torch.cuda.cudart()
    return int(cudart.cudaHostRegister(segment.address, segment.size, 0)) == 0


def _cuda_unregister(segment: Segment) -> None:
    torch.cuda.cudart().cudaHostUnregister(segment.address)


class SlotPool:
    """Free list of slots for one layout; thread-safe (slots are released by finalizers)."""

    def __init__(self, layout: Layout, target: int, register, pin: bool):
        self.layout = layout
        self.target = target
        self._register = register
        self._pin = pin
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._ids = itertools.count()
        self._retired: list[int] = []
        self.live = 0
        self.peak_bytes = 0
        self.closed = False

    def acquire(self) -> Slot:
        with self._lock:
            while self._free:
                slot = self._free.pop()
                if slot.layout is self.layout:
                    return slot
                self._retire(slot)
            slot_id = next(self._ids)
            self.live += 1
            self.peak_bytes = max(self.peak_bytes, self.live * self.layout.size)
            layout = self.layout
        segment = Segment.create(layout.size)
        slot = Slot(slot_id, segment, layout)
        if self._pin:
            slot.pinned = _cuda_register(segment)
        self._register(slot_id, segment)
        return slot

    def release(self, slot: Slot) -> None:
        with self._lock:
            if self.closed or slot.layout is not self.layout or len(self._free) >= self.target:
                self._retire(slot)
            else:
                self._free.append(slot)

    def grow_overflow(self, wanted: int) -> None:
        """Make later slots' overflow area fit ``wanted`` bytes per batch (variable shapes)."""
        with self._lock:
            if wanted > self.layout.overflow:
                self.layout = self.layout.with_overflow(max(wanted, 2 * self.layout.overflow))

    def take_retired(self) -> list[int]:
        with self._lock:
            retired, self._retired = self._retired, []
            return retired

    def _retire(self, slot: Slot) -> None:
        self.live -= 1
        self._retired.append(slot.id)
        if slot.pinned:
            _cuda_unregister(slot.segment)
        slot.segment.close()

    @property
    def bytes_in_use(self) -> int:
        return self.live * self.layout.size

    def close(self) -> None:
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
            for slot in free:
                self._retire(slot)
