"""One batch's ownership, from its permit to its delivery: :class:`Lease`.

A batch holds two things while it is being made: a permit (one of the epoch's bound on
batches between the sampler and the consumer) and, once the layout is known, a slot (the
shared memory its samples are written into). Both must go back exactly once, whatever
happens to the batch: delivered, skipped, failed, or abandoned with its epoch. The lease is
the one place that knows where each goes:

* the sampler stage takes the permit and makes the lease (:meth:`Lease.__init__`);
* the stage that makes the batch takes a slot into it (:meth:`Lease.hold`) and, when the
  batch is built, passes the slot on to the batch's tensors (:meth:`Lease.view`: the slot
  then returns to its pool when the consumer drops the batch);
* :meth:`Lease.deliver` puts what became of the batch in the ready queue: the consumer
  returns the permit when it takes it, except for a batch handed straight to a consumer that
  was waiting, or nothing to take (``SKIP``), whose permit goes back at once;
* :meth:`Lease.close`, in the sampler stage's one ``finally``, returns what is left: a slot
  no batch took, the permit of a batch that was never delivered (its epoch is ending).
"""

from __future__ import annotations

import functools
from typing import Any

from aioload._engine.ready import skips
from aioload._handoff.views import SlotView


class Lease:
    """Batch ``seq``: its ``indices`` (normalised: one list of dataset indices) and ``raw``
    (as the sampler gave them), its round-robin ``turn`` (or ``None``), and what it holds.

    Given: ``permits`` (the epoch's Limiter of batches), ``ready`` (the ready queue),
    ``shared`` (whose slot pool takes a slot back) and ``inflight`` (the open batches the
    stuck report reads: the lease is open there from its making to its close)."""

    __slots__ = ("seq", "raw", "indices", "turn", "slot", "_permits", "_ready", "_shared", "_inflight", "_delivered")

    def __init__(self, seq: int, raw: Any, indices: list, turn, *, permits, ready, shared, inflight):
        self.seq = seq
        self.raw = raw
        self.indices = indices
        self.turn = turn
        self.slot = None  # the slot the batch is written into, until a view of it takes it
        self._permits = permits
        self._ready = ready
        self._shared = shared
        self._inflight = inflight
        self._delivered = False
        inflight.batches[seq] = indices

    def hold(self, slot):
        """Keep ``slot`` (``None``: the batch has none) until :meth:`view` or :meth:`close`."""
        self.slot = slot
        return slot

    def view(self) -> SlotView | None:
        """The hand-out of the slot the batch is built from: the slot is the batch's from now
        on, and goes back to its pool when the last tensor viewing it is gone."""
        slot, self.slot = self.slot, None
        if slot is None:
            return None
        # the pool's own method, not a closure over the lease: a batch the consumer keeps must
        # not keep the epoch's objects (the ready queue, the stuck record) alive
        return SlotView(slot.segment, slot.layout, functools.partial(self._shared.slots.release, slot))

    def deliver(self, item) -> None:
        """``item`` (a ``Ready``, a ``Failure`` or ``SKIP``) to the ready queue, and the permit
        where it goes: back now when nothing is to be taken or a waiting consumer took it."""
        self._delivered = True
        handed = self._ready.put(self.seq, item)
        if skips(item) or handed:
            self._permits.release()

    def sent(self) -> None:
        """This batch has queued all of its tasks: the next batch of its worker may go."""
        if self.turn is not None:
            self.turn.sent()

    def close(self) -> None:
        """Return what is left (see the module docstring). Idempotent."""
        self._inflight.batches.pop(self.seq, None)
        self.sent()  # a batch that failed or sent nothing holds up no other
        slot, self.slot = self.slot, None
        if slot is not None:
            self._shared.slots.release(slot)
        if not self._delivered:
            self._delivered = True
            self._permits.release()
