"""The bounded hand-off between the engine thread and the consumer.

Batches finish out of order (workers run in parallel); this buffer gives them back in sampler
order (``in_order=True``) or as they finish. It never blocks the engine: the engine only starts
a batch when it holds a permit, and the consumer returns a permit with every batch it takes, so
at most ``permits`` batches exist between the sampler and the training loop.

A batch put while the consumer is already waiting for it is handed over at once: the engine
keeps that batch's permit (``put`` says so) and the consumer owes none, which saves waking the
engine's thread once per batch whenever the loader, not the training step, is the bottleneck.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

SKIP = object()
"""What a sequence number holds when it yields no batch: an IterableDataset worker that ran
out, a batch whose every sample was skipped (``on_error="skip"``) or that had no samples to
read, an executor batch that came back empty. The consumer never sees it; its permit goes back
to the sampler at once."""


class Passed(NamedTuple):
    """A sequence number that yields no batch (as :data:`SKIP`) but holds a ``note`` the
    consumer applies when it passes the number: an IterableDataset worker's state once its
    copy ran out."""

    note: Any


def skips(item) -> bool:
    """Whether ``item`` yields no batch (:data:`SKIP` or :class:`Passed`)."""
    return item is SKIP or type(item) is Passed


class EndOfEpoch(Exception):
    pass


class Delivered:
    """Batch sequence numbers the consumer has received: every one below ``low``, and
    ``above``. Deliveries arrive nearly in order, so ``above`` holds at most about as many
    numbers as batches are in flight."""

    def __init__(self, low: int = 0, above=()):
        self.low = low
        self.above: set[int] = set()
        self.complete = False  # the consumer saw the end of the epoch
        for seq in above:
            self.add(seq)

    def add(self, seq: int) -> None:
        if seq < self.low:
            return
        self.above.add(seq)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def __len__(self) -> int:
        return self.low + len(self.above)

    def copy(self) -> "Delivered":
        return Delivered(self.low, tuple(self.above))


class ReadyQueue:
    def __init__(self, in_order: bool, delivered: Delivered | None = None):
        self._cond = threading.Condition()
        self._items: dict[int, object] = {}
        self._next = 0
        self._in_order = in_order
        self.delivered = delivered if delivered is not None else Delivered()
        self._total: int | None = None
        self._fatal: BaseException | None = None
        self._listeners: list = []
        self._hungry = False  # a thread waits in get() with nothing to take
        self._prepaid: set[int] = set()  # handed over: the engine kept their permits
        self.taken = 0
        self._notes: list = []  # the notes of the items popped, in the order the consumer passed them

    def _notify(self) -> None:
        """Wake blocked threads and async waiters (call with the lock held)."""
        self._cond.notify_all()
        listeners, self._listeners = self._listeners, []
        for wake in listeners:
            wake()

    def when_ready(self, wake) -> bool:
        """Call ``wake()`` (from the engine's thread) once something changes; ``False`` if
        something can already be taken, in which case ``wake`` is not kept."""
        with self._cond:
            if self._can_take():
                return False
            self._listeners.append(wake)
            return True

    def _can_take(self) -> bool:
        """Whether :meth:`get_nowait` would return or raise rather than find nothing. In
        order, a later batch that is ready does not count: the awaited one may be stuck."""
        if self._fatal is not None or self._total is not None:
            return True  # the engine has put everything it will put
        if not self._in_order:
            return bool(self._items)
        return self._awaited() in self._items

    def _awaited(self) -> int:
        """In order: the sequence number the consumer takes next (a resumed epoch skips the
        batches it already delivered)."""
        seq = self._next
        while seq in self.delivered:
            seq += 1
        return seq

    def put(self, seq: int, item: object) -> bool:
        """Add ``item``; ``True`` when a waiting consumer takes it next, in which case the
        caller keeps the batch's permit and the consumer is told it owes none."""
        with self._cond:
            self._items[seq] = item
            handed = not skips(item) and (self._hungry or bool(self._listeners)) and self._wanted(seq)
            if handed:
                self._hungry = False
                self._prepaid.add(seq)
            self._notify()
            return handed

    def _wanted(self, seq: int) -> bool:
        """Whether ``seq`` is the item the consumer takes next."""
        return not self._in_order or seq == self._awaited()

    def finish(self, total: int) -> None:
        """No sequence number at or beyond ``total`` will come."""
        with self._cond:
            self._total = total
            self._notify()

    def fail(self, exc: BaseException) -> None:
        """The engine broke: the consumer raises ``exc`` next (after nothing else)."""
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _pop(self):
        """``(found, item, owed)``: ``owed`` is whether taking it returns a permit."""
        delivered = self.delivered
        if self._in_order:
            while True:
                if self._next < delivered.low:  # a resumed epoch's earlier batches, in one step
                    self._next = delivered.low
                while self._next in delivered:  # and those delivered out of order
                    self._next += 1
                seq = self._next
                if seq not in self._items:
                    return False, None, False
                item = self._items.pop(seq)
                delivered.add(seq)
                self._note(item)
                if not skips(item):
                    return True, item, self._owed(seq)
        while self._items:
            seq = min(self._items)
            item = self._items.pop(seq)
            delivered.add(seq)
            self._note(item)
            if not skips(item):
                return True, item, self._owed(seq)
        return False, None, False

    def _note(self, item) -> None:
        note = getattr(item, "note", None)
        if type(note) is list:  # a batch made by several tasks: each one's note, in order
            self._notes.extend(note)
        elif note is not None:
            self._notes.append(note)

    def take_notes(self) -> list:
        """The notes of the items the consumer passed since the last call, in that order."""
        with self._cond:
            notes, self._notes = self._notes, []
            return notes

    def _owed(self, seq: int) -> bool:
        if seq in self._prepaid:
            self._prepaid.remove(seq)
            return False
        return True

    def _exhausted(self) -> bool:
        return self._total is not None and self.delivered.low >= self._total and not self._items

    def _try(self):
        found, item, owed = self._pop()
        if found:
            self.taken += 1
            return True, item, owed
        if self._fatal is not None:
            raise self._fatal
        if self._exhausted():
            self.delivered.complete = True
            raise EndOfEpoch
        return False, None, False

    def get_nowait(self):
        """``(True, item, owed)``, or ``(False, None, False)`` when nothing is ready yet;
        ``owed`` says whether the caller must return a permit for ``item``. Raises like
        :meth:`get`."""
        with self._cond:
            return self._try()

    def get(self, timeout: float | None = None):
        """``(item, owed)`` for the next item (see :meth:`get_nowait`); raises
        :class:`EndOfEpoch`, the engine's fatal error, or ``TimeoutError`` after ``timeout``
        seconds. Sleeps on the condition until the engine puts something (``put``, ``finish``
        and ``fail`` notify it): no timer runs meanwhile. Ctrl-C still reaches the caller at
        once: a lock wait is interrupted by signals (Python 3.2 and later, on POSIX)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            try:
                while True:
                    found, item, owed = self._try()
                    if found:
                        return item, owed
                    wait = None
                    if deadline is not None:
                        wait = deadline - time.monotonic()
                        if wait <= 0:
                            raise TimeoutError
                    self._hungry = True
                    self._cond.wait(wait)
            finally:
                self._hungry = False

    def drain(self) -> list:
        """Remove and return what is buffered (used when an epoch is abandoned)."""
        with self._cond:
            items = list(self._items.values())
            self._items.clear()
            return items
