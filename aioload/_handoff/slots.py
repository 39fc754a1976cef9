"""Shared-memory batch slots: allocated once the layout is known, recycled, bounded.

A slot holds one batch. It is *busy* while workers write it and the batch waits to be
consumed, *out* while the consumer holds tensors that view it, and *free* again when those
tensors are gone (on a GPU: once the copy out of it has finished). The pool keeps at most
``target`` free slots; a slot beyond that (a consumer that keeps every batch, say) is freed
when released, so steady-state memory is ``target`` slots whatever the epoch count.

A page-locked slot can be released while a copy out of it still runs: the consumer's own
``batch.to("cuda", non_blocking=True)`` returns at once, and dropping the batch then releases
the slot. Such a slot *cools*: the pool records an event on the releasing thread's current
CUDA stream (the one that queued the copy) and hands the slot out again only once that event
has fired, as torch's pinned-memory allocator does for its own blocks.
"""

from __future__ import annotations

import itertools
import threading

import torch

from aioload._handoff.layout import Layout
from aioload._handoff.shm import Segment


class Slot:
    __slots__ = ("id", "segment", "layout", "pinned")

    def __init__(self, slot_id: int, segment: Segment, layout: Layout):
        self.id, self.segment, self.layout, self.pinned = slot_id, segment, layout, False


def _cuda_register(segment: Segment) -> bool:
    cudart = torch.cuda.cudart()
    return int(cudart.cudaHostRegister(segment.address, segment.size, 0)) == 0


def _cuda_unregister(segment: Segment) -> None:
    torch.cuda.cudart().cudaHostUnregister(segment.address)


def cuda_fence():
    """An event after the work queued so far on this thread's current CUDA stream, or
    ``None`` when CUDA is not in use in this process (nothing can be reading the slot)."""
    try:
        if not torch.cuda.is_initialized():
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event
    except Exception:  # noqa: BLE001 - a finalizer at interpreter exit, a broken context
        return None


class SlotPool:
    """Free list of slots for one layout; thread-safe (slots are released by finalizers)."""

    def __init__(self, layout: Layout, target: int, register, pin: bool, fence=cuda_fence):
        self.layout = layout
        self.target = target
        self._register = register
        self._pin = pin
        self._fence = fence
        # Re-entrant: slots are released by finalizers, which a garbage collection started
        # inside a locked section can run on the same thread.
        self._lock = threading.RLock()
        self._free: list[Slot] = []
        self._cooling: list[tuple[Slot, object]] = []  # (slot, event) in release order
        self._ids = itertools.count()
        self._retired: list[int] = []
        self.live = 0
        self.peak_bytes = 0
        self.closed = False

    def acquire(self) -> Slot:
        with self._lock:
            self._cool()
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
        event = self._fence() if slot.pinned else None
        cooling = (slot, event)  # made outside the lock (see _lock)
        with self._lock:
            if event is not None and not self.closed:
                self._cooling.append(cooling)
                return
            if event is not None:
                event.synchronize()  # closed: the slot is unmapped now, after its copy
            self._keep(slot)

    def _keep(self, slot: Slot) -> None:
        if self.closed or slot.layout is not self.layout or len(self._free) >= self.target:
            self._retire(slot)
        else:
            self._free.append(slot)

    def _cool(self) -> None:
        """Move cooled slots to the free list. A new slot is made while copies are pending (a
        copy queued behind a training step can take that long); with ``target`` of them pending,
        the device is a whole queue behind, and the pool waits for the oldest instead."""
        cooling = self._cooling
        if len(cooling) >= self.target and not self._free:
            cooling[0][1].synchronize()
        i = 0
        while i < len(cooling):  # in place: a release from a finalizer may append meanwhile
            slot, event = cooling[i]
            if event.query():
                del cooling[i]
                self._keep(slot)
            else:
                i += 1

    def grow_overflow(self, wanted: int) -> None:
        """Make later slots' overflow area fit ``wanted`` bytes per batch (variable shapes)."""
        with self._lock:
            if wanted > self.layout.overflow:
                self.layout = self.layout.with_overflow(max(wanted, 2 * self.layout.overflow))

    def grow_rows(self, rows: int) -> None:
        """Make later slots hold at least ``rows`` samples (a batch sampler's batch longer than
        any before), with a quarter to spare so that slowly growing batches do not remake the
        slots every time. Slots of the old layout are freed as they come back."""
        with self._lock:
            old = self.layout
            if rows > old.rows:
                self.layout = old.with_rows(max(rows, old.rows + old.rows // 4))

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
            for _, event in self._cooling:
                event.synchronize()  # a copy still reading a slot must end before it is unmapped
            free = self._free + [slot for slot, _ in self._cooling]
            self._free, self._cooling = [], []
            for slot in free:
                self._retire(slot)
